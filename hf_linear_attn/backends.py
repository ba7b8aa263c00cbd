"""The backend names of the attention ops, declared once, and which of them each op accepts.

`ops_common.pick_backend` checks an op's `backend` argument against them, and the config its
`linear_attention_backend` (for the ops its layer kind calls). This module imports nothing: the config, which
is remote code, reads it without torch.
"""

# Every backend name, in the order error messages list them (the docstring of `ops` says what each runs).
BACKENDS = ("auto", "torch", "recurrent", "parallel", "triton")
# The names each op accepts: the delta rule has no quadratic closed form ("parallel").
OP_BACKENDS = {
    "linear_attention": BACKENDS,
    "window_attention": BACKENDS,
    "delta_rule_attention": ("auto", "torch", "recurrent", "triton"),
}


def accepted_by(*ops: str) -> tuple[str, ...]:
    """The backend names that every one of `ops` (keys of OP_BACKENDS) accepts, in the order of BACKENDS."""
    return tuple(name for name in BACKENDS if all(name in OP_BACKENDS[op] for op in ops))
