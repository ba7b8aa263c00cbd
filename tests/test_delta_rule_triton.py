"""delta_rule_attention's Triton backend against the token-loop oracle and the torch chunked backend: outputs, final
states and gradients (q, k, v, beta, log_decay, initial_state), odd lengths, packed sequences, resets, dtypes,
backend selection and errors.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), 100-400x slower
than torch: shapes are tiny. On a GPU the same tests run on CUDA tensors, where float32 dots use TF32 (hence the
looser float32 tolerance there). The oracle runs in float64 on the very values the kernels see (inputs rounded to
the tested dtype first), so the tolerances measure the kernels' own arithmetic.
"""

import pytest
import torch
from helpers import (
    assert_close_in_float64,
    assert_runs_without_triton,
    make_delta_rule_inputs,
    outputs_and_grads,
    triton_test_device,
)

from hf_linear_attn import ops_triton_delta_rule
from hf_linear_attn.ops_common import CHUNK_SIZE
from hf_linear_attn.ops_delta_rule import delta_rule_attention

DEVICE = triton_test_device()

C = CHUNK_SIZE
# Largest error relative to the oracle's largest magnitude (at least 1). Measured under the interpreter: float32
# 1e-6, float16 4e-4, bfloat16 6e-3; a GPU adds TF32 (float32, float16) and bf16 rounding of dot operands.
TOLERANCE = {
    torch.float32: 1e-2 if DEVICE == "cuda" else 1e-5,
    torch.float16: 1e-2 if DEVICE == "cuda" else 2e-3,
    torch.bfloat16: 3e-2 if DEVICE == "cuda" else 1e-2,
}


def compare(inputs: dict, dtype: torch.dtype = torch.float32, *, reference: str = "recurrent", tol: float | None = None,
            **kwargs) -> None:
    """backend "triton" on DEVICE with q, k, v, beta, log_decay in `dtype` (the state in float32) against
    `reference` on CPU on the same rounded values: in float64 for the oracle, as given for "torch"."""
    rounded = {name: None if x is None else x.detach().to(torch.float32 if name == "initial_state" else dtype)
               for name, x in inputs.items()}
    exact_dtype = torch.float64 if reference == "recurrent" else None
    exact = {name: None if x is None else x.to(exact_dtype or x.dtype).requires_grad_() for name, x in rounded.items()}
    expected = outputs_and_grads(delta_rule_attention, exact, backend=reference, **kwargs)
    tested = {name: None if x is None else x.to(DEVICE).requires_grad_() for name, x in rounded.items()}
    actual = outputs_and_grads(delta_rule_attention, tested, backend="triton",
                               **{n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in kwargs.items()})
    o, state, *grads = actual
    assert o.dtype == dtype and state.dtype == torch.float32
    assert [g.dtype for g in grads] == [x.dtype for x in tested.values() if x is not None]
    assert_close_in_float64(actual, expected, TOLERANCE[dtype] if tol is None else tol)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("length", [1, C + 7, 2 * C])
def test_matches_recurrent_oracle(length, decay, with_state):
    compare(make_delta_rule_inputs(length, decay=decay, with_state=with_state))


def test_matches_torch_chunked_backend():
    """Head dims that are not powers of two (partial tiles), three chunks, the last one partial."""
    inputs = make_delta_rule_inputs(2 * C + 3, with_state=True, batch=1, key_dim=20, value_dim=7)
    compare(inputs, reference="torch")


def test_key_dims_over_several_key_blocks_match_torch_chunked_backend():
    """dq and dk in K blocks of DQK_KEY_WIDTH, the last one partial; dβ and db summed over the blocks' parts."""
    key_dim = ops_triton_delta_rule.DQK_KEY_WIDTH + 17
    inputs = make_delta_rule_inputs(C + 5, with_state=True, batch=1, heads=1, key_dim=key_dim, value_dim=7)
    compare(inputs, reference="torch")


@pytest.mark.parametrize("with_state", [True, False])
def test_packed_sequences_match_recurrent(with_state):
    """cu_seqlens with an empty sequence, a partial and a whole chunk: each sequence starts from its own state."""
    lengths = [5, 0, C + 6, C, 1]
    inputs = make_delta_rule_inputs(sum(lengths), batch=1, heads=1)
    inputs["initial_state"] = torch.randn(len(lengths), 1, 8, 5, dtype=torch.float64) if with_state else None
    compare(inputs, cu_seqlens=torch.tensor([0, *lengths]).cumsum(0))


def test_minus_inf_decay_resets_the_state():
    """a_t = exp(−inf) = 0 inside a chunk, at its last and at its first token: outputs, states and gradients
    (zero for the −inf log decays, as the oracle's) stay finite and equal the oracle's.

    The kernels raise −inf to log(float32 tiny) ≈ −87.3, so the summed log decays after a reset lie near −87, where
    float32 numbers are 7.6e-6 apart: measured 9.5e-6, hence 3e-5 on the interpreter."""
    inputs = make_delta_rule_inputs(2 * C + 5, with_state=True, heads=1)
    for reset in (0, 3, C - 1, C, C + 40):
        inputs["log_decay"][0, reset, 0] = -torch.inf
    compare(inputs, tol=max(3e-5, TOLERANCE[torch.float32]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_float64_oracle(dtype):
    compare(make_delta_rule_inputs(C + 9, with_state=True), dtype)


def test_backend_selection_and_errors():
    inputs = make_delta_rule_inputs(C + 3, with_state=True, batch=1, heads=1)
    o_auto, _ = delta_rule_attention(**inputs)
    if DEVICE == "cpu":  # "auto" runs the Triton kernels on CUDA tensors only
        o_torch, _ = delta_rule_attention(**inputs, backend="torch")
        assert torch.equal(o_auto, o_torch)
    else:
        on_device = {name: x.float().cuda() for name, x in inputs.items()}
        o_auto, _ = delta_rule_attention(**on_device)
        o_triton, _ = delta_rule_attention(**on_device, backend="triton")
        assert torch.equal(o_auto, o_triton)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32 tensors, got q in torch.float64"):
        delta_rule_attention(**inputs, backend="triton")
    wide = ops_triton_delta_rule.MAX_KEY_DIM + 1
    too_wide = make_delta_rule_inputs(3, batch=1, heads=1, key_dim=wide, value_dim=2)
    with pytest.raises(ValueError, match=f"key dims K ≤ {wide - 1}, got K = {wide}"):
        delta_rule_attention(**{n: None if x is None else x.float() for n, x in too_wide.items()}, backend="triton")


def test_without_triton_the_backend_explains_itself():
    code = """
        import torch
        import torch.nn.functional as F
        from hf_linear_attn import delta_rule_attention, ops_triton_delta_rule
        assert not ops_triton_delta_rule.HAS_TRITON
        q, k = torch.randn(1, 5, 2, 4), F.normalize(torch.randn(1, 5, 2, 4), dim=-1)
        delta_rule_attention(q, k, q, torch.rand(1, 5, 2))
        """
    assert_runs_without_triton(code, 'delta_rule_attention(q, k, q, torch.rand(1, 5, 2), backend="triton")')
