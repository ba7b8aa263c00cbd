"""Public entry points of the attention math: `linear_attention` and `window_attention` (defined here), and
`delta_rule_attention` (the delta rule, re-exported from `ops_delta_rule`, which has its own backends).

Both validate every input before any work, pick the backend and dispatch to it, so callers (the model layers)
pass `backend="auto"` or a user's choice and never need to know which one ran. Shapes follow `[B, T, H, D]`:
batch, time, heads, head dim.

Backends (the names `BACKENDS`, which the config's `linear_attention_backend` mirrors):
- "recurrent": the token loop (`ops_reference`), the oracle; for `window_attention` the hybrid's one oracle,
  its quadratic form, runs under this name and under "parallel".
- "parallel": the quadratic closed form (`ops_reference`), a second oracle.
- "torch": chunked PyTorch (`ops_chunked`), any device.
- "triton": chunked Triton kernels (`ops_triton_linear`, `ops_triton_window`): CUDA tensors (or CPU ones under
  TRITON_INTERPRET=1), float16, bfloat16 or float32, window head dims up to 256.
- "auto": one query (a decode step) runs the direct form, "recurrent" for linear attention (one state update)
  and the quadratic form for the window (one row of scores over the retained tokens); otherwise "triton" for
  CUDA tensors it supports, else "torch".
`window_attention` takes fewer queries than keys (queries behind a cache's retained keys) with every backend:
the chunked ones get zero queries in front, whose outputs are dropped.

Validation: shapes, dtypes and argument types are always checked. Checks that read tensor values (log_decay
≤ 0 and not nan, cu_seqlens boundaries, the triton window's contiguous padding) would force a host-device sync
in every layer call on a GPU, so they run for CPU tensors only, or for every tensor when the environment
variable HF_LINEAR_ATTN_CHECK_VALUES=1 is set (debugging), and never while torch.compile / torch.export
trace. The backends stay finite without them: any log_decay in [−inf, 0] (−inf: a full reset) gives what
the token loop gives.

State layout of `linear_attention` (the decode cache depends on it): float32 (float64 for float64
inputs) [B, H, K, V]; with normalize=True [B, H, K, V + 1], whose last column is the normaliser z.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops_triton_common
from .backends import BACKENDS
from .ops_chunked import chunk_linear_attention, chunk_window_attention
from .ops_common import (
    check_4d_floating,
    check_cu_seqlens,
    check_log_decay,
    check_qkv,
    check_sizes,
    checked_scale,
    pick_backend,
)
from .ops_delta_rule import delta_rule_attention
from .ops_reference import parallel_linear_attention, recurrent_linear_attention, reference_window_attention
from .ops_triton_linear import triton_linear_attention
from .ops_triton_window import triton_window_attention

__all__ = ["BACKENDS", "delta_rule_attention", "linear_attention", "window_attention"]


LINEAR_FORMS: dict[str, Callable[..., tuple[Tensor, Tensor | None]]] = {
    "recurrent": recurrent_linear_attention,
    "parallel": parallel_linear_attention,
    "torch": chunk_linear_attention,
    "triton": triton_linear_attention,
}
WINDOW_FORMS: dict[str, Callable[..., tuple[Tensor, Tensor | None]]] = {
    "recurrent": reference_window_attention,  # the hybrid has no token loop: its oracle is the quadratic form
    "parallel": reference_window_attention,
    "torch": chunk_window_attention,
    "triton": triton_window_attention,
}
CHUNKED = ("torch", "triton")  # the forms that need one query per key (ops pads the queries for them)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    *,
    scale: float | None = None,
    normalize: bool = False,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Causal linear attention with optional decay, normalisation, carried state and packed sequences.

    Per batch row and head, with a_t = exp(log_decay_t) scaling the K rows of the state S (K x V):

        S_t = a_t ⊙ S_{t-1} + k_t v_tᵀ      o_t = (scale · q_t)ᵀ S_t
        normalize=True: z_t = a_t ⊙ z_{t-1} + k_t,  o_t = (scale · q_t)ᵀ S_t / ((scale · q_t)ᵀ z_t + 1e-6)

    Args:
        q, k: [B, T, H, K], already feature-mapped. v: [B, T, H, V]. B, T, H, K, V ≥ 1.
        log_decay: None (no decay), [B, T, H] (one decay per head and step; a per-head constant expanded
            over B and T gives a fixed decay) or [B, T, H, K] (one per key dim). Values in [−inf, 0]; −inf
            forgets everything before the step (a full reset).
        scale: a finite number > 0 that multiplies q; None means K ** -0.5.
        normalize: divide by the normaliser, as in the Linear Transformer.
        initial_state: None or the state to start from, [B, H, K, V] ([B, H, K, V + 1] if normalize; with
            cu_seqlens, N instead of B).
        output_final_state: also return the state after the last token (same layout, accumulation dtype).
        cu_seqlens: None or int [N + 1] boundaries (0, ..., T) of N sequences packed into a batch of 1;
            the state restarts at each boundary (from initial_state[n] if given).
        backend: one of BACKENDS (see the module docstring).

    Returns:
        o: [B, T, H, V] in the dtype of v; the final state, or None unless output_final_state.
    """
    check_qkv(q, k, v)
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    scale = checked_scale(scale, key_dim**-0.5)
    if log_decay is not None:
        check_log_decay(log_decay, (batch, length, heads), (batch, length, heads, key_dim))
        if log_decay.dim() == 3:
            log_decay = log_decay[..., None]  # one decay shared by all K rows of the state
    states = batch
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, batch, length)
        states = len(cu_seqlens) - 1
    if initial_state is not None:
        expected = (states, heads, key_dim, value_dim + int(normalize))
        if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != expected:
            raise ValueError(
                f"initial_state must have shape {expected} ([N, H, K, V{' + 1' if normalize else ''}], N = "
                f"{'sequences' if cu_seqlens is not None else 'batch'}), got {getattr(initial_state, 'shape', None)}"
            )
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state must have a floating-point dtype, got {initial_state.dtype}")

    tensors = {"q": q, "k": k, "v": v, "log_decay": log_decay, "initial_state": initial_state}
    name = pick_backend(
        backend, q.device, single_query=length == 1,
        triton_problem=lambda: ops_triton_common.unsupported_inputs(
            {n: x for n, x in tensors.items() if x is not None}
        ),
    )
    return LINEAR_FORMS[name](
        q, k, v, log_decay,
        scale=scale,
        normalize=normalize,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


def _check_contiguous_padding(key_padding_mask: Tensor) -> None:
    """The triton window kernels take each row's real tokens as one run [lo, hi) (left or right padding)."""
    batch, length = key_padding_mask.shape
    lo, hi = ops_triton_common.real_token_bounds(key_padding_mask, batch, length, key_padding_mask.device).unbind(-1)
    pos = torch.arange(length, device=key_padding_mask.device)
    if not torch.equal((pos >= lo[:, None]) & (pos < hi[:, None]), key_padding_mask):
        raise ValueError("key_padding_mask: backend 'triton' needs the real tokens of each row contiguous (left or "
                         "right padding); backend 'torch' takes any mask")


def window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_feat: Tensor,
    k_feat: Tensor,
    window_gate: Tensor,
    *,
    window_size: int,
    num_sink_tokens: int = 0,
    scale: float | None = None,
    log_decay: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Sliding-window softmax + linear attention sharing one normaliser (LoLCATs), optionally with a decayed
    linear part.

    Query t attends with softmax to the window W_t (keys i ≤ t with t − i < window_size, plus the first
    num_sink_tokens real tokens) and linearly to every older real key (L_t):

        o_t = (Σ_{W_t} γ e^{s_ti − c_t} v_i + Σ_{L_t} (d_tj ⊙ q_feat_t)·k_feat_j v_j)
              / (Σ_{W_t} γ e^{s_ti − c_t} + Σ_{L_t} (d_tj ⊙ q_feat_t)·k_feat_j)

    with s_ti = scale · q_t·k_i, c_t = max_{i∈W_t} s_ti, γ = sigmoid(window_gate) and the decay of key j at
    query t d_tj = Π_{i = j + window_size + 1}^{t} a_i, a_i = exp(log_decay_i) (1 without log_decay; per
    feature dimension for a [B, T, H, F] log_decay). The decay acts on the linear part only and its clock
    starts when the key leaves the window: the linear part is causal linear attention, decayed at every step,
    over keys and values delayed by window_size positions. When window_size ≥ T this is exactly causal
    softmax attention.

    The queries may cover only the last T_q ≤ T positions (q, q_feat [B, T_q, H, ·]): a decode step behind
    a cache's retained keys computes just the new rows. Every backend takes T_q < T (the chunked ones compute
    the rows in front too, and drop them).

    Args:
        q, k: [B, T_q, H, D] queries and [B, T, H, D] keys of the softmax part (after RoPE). v: [B, T, H, V].
            B, T_q, H, D, V ≥ 1.
        q_feat, k_feat: [B, T_q, H, F] and [B, T, H, F] feature-mapped queries and keys of the linear part; F ≥ 1.
        window_gate: [H] logits of the per-head softmax weight γ.
        window_size: ≥ 1, number of most recent tokens (the query's own included) under softmax.
        num_sink_tokens: ≥ 0, number of first real tokens always under softmax.
        scale: of the softmax scores, a finite number > 0; None means D ** -0.5.
        log_decay: None (no decay), [B, T, H] or [B, T, H, F]: log a_i ≤ 0 at every one of the T positions
            (values in [−inf, 0]; −inf forgets every key that has left the window, and the initial state).
            Positions in front of the queries count too: a decode step behind a cache's retained keys passes 0
            there (their steps have already decayed the cache's state).
        key_padding_mask: None or bool [B, T], True for real tokens (the queries are its last T_q
            positions). Pad keys contribute nothing; pad queries output 0. Windows count positions, pads
            included. Backend "triton" needs the real tokens of each row contiguous (left or right padding;
            checked, at the price of one host sync on a GPU), so "auto" picks it only without a mask.
        initial_state: None or [B, H, F, V + 1]: Σ φ(k_j) [v_j, 1]ᵀ over keys older than the whole input
            (a decode cache's folded tokens), added to every query's linear part, decayed at query t by
            Π_{i=0}^{t} a_i.
        output_final_state: also return initial_state (decayed by Π_{i<T} a_i) plus every real, non-sink key
            that lies outside the window of the *next* query (index T), i.e. keys j ≤ T − 1 − window_size, each
            decayed by d_{T−1, j}: what a cache carries forward beside the last window_size tokens and the
            sinks (the next step decays it by its own a_t, and a key that leaves the window enters undecayed).
        backend: one of BACKENDS (see the module docstring; "recurrent" and "parallel" both run the quadratic
            reference form).

    Returns:
        o: [B, T_q, H, V] in the dtype of v; the final linear state (fp32, [B, H, F, V + 1]) or None.
    """
    for arg, x, dims in (
        ("q", q, "[B, T_q, H, D]"),
        ("k", k, "[B, T, H, D]"),
        ("v", v, "[B, T, H, V]"),
        ("q_feat", q_feat, "[B, T_q, H, F]"),
        ("k_feat", k_feat, "[B, T, H, F]"),
    ):
        check_4d_floating(arg, x, dims)
    batch, length, heads, head_dim = k.shape
    queries = q.shape[1]
    if (q.shape[0], q.shape[2], q.shape[3]) != (batch, heads, head_dim) or queries > length:
        raise ValueError(f"q must be [B, T_q, H, D] with T_q ≤ T and the B, H, D of k {tuple(k.shape)}, "
                         f"got shape {tuple(q.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must have B, T, H = {tuple(k.shape[:3])}, got shape {tuple(v.shape)}")
    if q_feat.shape[:3] != q.shape[:3]:
        raise ValueError(f"q_feat must have B, T_q, H = {tuple(q.shape[:3])}, got shape {tuple(q_feat.shape)}")
    if k_feat.shape != (*k.shape[:3], q_feat.shape[-1]):
        raise ValueError(f"k_feat must have shape {(*k.shape[:3], q_feat.shape[-1])} ([B, T, H, F] with the F of "
                         f"q_feat), got {tuple(k_feat.shape)}")
    if queries == 0:
        raise ValueError("q, k, v must hold at least one token, got T = 0")
    check_sizes("k", k, "[B, T, H, D]", (0, 2, 3))
    check_sizes("v", v, "[B, T, H, V]", (3,))
    check_sizes("q_feat", q_feat, "[B, T_q, H, F]", (3,))
    if (
        not isinstance(window_gate, Tensor) or tuple(window_gate.shape) != (heads,)
        or not window_gate.is_floating_point()
    ):
        raise ValueError(
            f"window_gate must be a floating-point tensor of shape ({heads},) (one logit per head), "
            f"got {getattr(window_gate, 'shape', window_gate)!r} of type {getattr(window_gate, 'dtype', None)}"
        )
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
        raise ValueError(f"window_size must be an int ≥ 1, got {window_size!r}")
    if isinstance(num_sink_tokens, bool) or not isinstance(num_sink_tokens, int) or num_sink_tokens < 0:
        raise ValueError(f"num_sink_tokens must be an int ≥ 0, got {num_sink_tokens!r}")
    scale = checked_scale(scale, head_dim**-0.5)
    if log_decay is not None:
        check_log_decay(log_decay, (batch, length, heads), (batch, length, heads, q_feat.shape[-1]))
    if key_padding_mask is not None and (
        not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool
        or tuple(key_padding_mask.shape) != (batch, length)
    ):
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape ({batch}, {length}) (True = real token), "
            f"got {getattr(key_padding_mask, 'shape', key_padding_mask)!r} of type "
            f"{getattr(key_padding_mask, 'dtype', None)}"
        )
    state_shape = (batch, heads, q_feat.shape[-1], v.shape[-1] + 1)
    if initial_state is not None and (
        not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != state_shape
        or not initial_state.is_floating_point()
    ):
        raise ValueError(
            f"initial_state must be a floating-point tensor of shape {state_shape} ([B, H, F, V + 1]), "
            f"got {getattr(initial_state, 'shape', initial_state)!r} of type {getattr(initial_state, 'dtype', None)}"
        )

    tensors = {"q": q, "k": k, "v": v, "q_feat": q_feat, "k_feat": k_feat, "window_gate": window_gate,
               "log_decay": log_decay, "initial_state": initial_state}

    def triton_problem() -> str | None:
        if backend == "auto" and key_padding_mask is not None:
            # The Triton kernels take each row's real tokens as one run; only a host sync could tell whether a
            # mask has holes, so "auto" runs masked inputs on "torch", which takes any mask.
            return "key_padding_mask given"
        return ops_triton_common.unsupported_inputs(
            {n: x for n, x in tensors.items() if x is not None}, window_head_dims=(head_dim, v.shape[-1])
        )

    name = pick_backend(backend, q.device, single_query=queries == 1, triton_problem=triton_problem)
    if name == "triton" and key_padding_mask is not None:  # chosen explicitly: checked on every device
        _check_contiguous_padding(key_padding_mask)
    skipped = length - queries if name in CHUNKED else 0
    if skipped:  # the chunked forms need a query per key: zero queries in front, whose rows are dropped
        # (log_decay already covers all T positions: the padding shifts no decay)
        q, q_feat = (F.pad(x, (0, 0, 0, 0, skipped, 0)) for x in (q, q_feat))
    if log_decay is not None and log_decay.dim() == 3:
        log_decay = log_decay[..., None]  # one decay shared by all F rows of the state
    o, state = WINDOW_FORMS[name](
        q, k, v, q_feat, k_feat, window_gate, log_decay,
        window_size=window_size,
        num_sink_tokens=num_sink_tokens,
        scale=scale,
        key_padding_mask=key_padding_mask,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
    return o[:, skipped:], state
