"""The one-token step ops (`ops.linear_attention_step`, `ops.window_attention_step`, `ops.delta_window_attention_step`
over `ops_decode`): equal to the general ops for one query behind the retained keys, and backend "auto" choosing torch
or the fused kernel (CUDA tensors it takes, in eager mode) through `pick_backend`. The model's decode steps call them
(tests/test_cache.py holds the decode steps against the general path, tests/test_previous_revision.py against the
revision whose model computed the steps itself)."""


import pytest
import torch
from helpers import triton_test_device

from hf_linear_attn import ops
from hf_linear_attn.ops import (
    delta_window_attention_step,
    linear_attention,
    linear_attention_step,
    window_attention,
    window_attention_step,
)
from hf_linear_attn.ops_triton_common import HAS_TRITON

# ---------------------------------------------------------------------------------------------------------------
# The steps against the general ops: one query behind the retained keys
# ---------------------------------------------------------------------------------------------------------------

B, H, H_KV, D, F_DIM, W, S = 2, 4, 2, 8, 6, 4, 2


def retained(gen: torch.Generator, pads: bool) -> dict[str, torch.Tensor]:
    """A window cache's retained slots in sequence order (S sinks, then positions p − W .. p − 1), the new token's
    k, v [B, 1, H_kv, ·] and q; some retained slots masked (a pad, or not yet filled) where `pads`."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    mask = torch.ones(B, S + W + 1, dtype=torch.bool)
    if pads:
        mask[0, S + 1] = False  # a pad in the window
        mask[1, S] = False  # the leaving position is a pad: nothing folds
        mask[0, -1] = False  # row 0's new token is a pad
    return dict(k=randn(B, S + W + 1, H_KV, D), v=randn(B, S + W + 1, H_KV, D), q=randn(B, 1, H, D), mask=mask)


def step_slots(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """What the step sees after the ring write: sinks, the window without the leaving position (index S), the new
    token; and the leaving token's key, value and mask (sinks are never in the ring: it leaves as it is)."""
    keep = [i for i in range(S + W + 1) if i != S]
    k, v, mask = inputs["k"], inputs["v"], inputs["mask"]
    leaving = (x[:, S : S + 1].contiguous() for x in (k, v, mask))  # (a step takes views of contiguous inputs)
    return k[:, keep], v[:, keep], mask[:, keep], *leaving


@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
@pytest.mark.parametrize("pads", [False, True])
def test_window_step_is_the_window_op_behind_retained_keys(decay, pads):
    gen = torch.Generator().manual_seed(5)
    inputs = retained(gen, pads)
    k_feat = torch.rand(B, S + W + 1, H, F_DIM, generator=gen, dtype=torch.float64)
    q_feat = torch.rand(B, 1, H, F_DIM, generator=gen, dtype=torch.float64)
    gate = torch.randn(H, generator=gen, dtype=torch.float64)
    state = torch.rand(B, H, F_DIM, D + 1, generator=gen, dtype=torch.float64)
    log_decay = None
    if decay is not None:
        new = -torch.rand((B, 1, H) if decay == "scalar" else (B, 1, H, F_DIM), generator=gen, dtype=torch.float64)
        log_decay = torch.cat([torch.zeros(B, S + W, *new.shape[2:], dtype=torch.float64), new], dim=1)
    real = inputs["mask"][:, -1:] if pads else None
    expected, expected_state = window_attention(
        inputs["q"], inputs["k"], inputs["v"], q_feat, k_feat, gate, window_size=W, num_sink_tokens=S,
        log_decay=log_decay, key_padding_mask=inputs["mask"], initial_state=state, output_final_state=True,
        backend="recurrent")
    keys, values, mask, leaving_k, leaving_v, leaving_real = step_slots(inputs)
    state = state.clone()
    o = window_attention_step(inputs["q"], q_feat, None if log_decay is None else log_decay[:, -1:], state, keys,
                              values, mask, k_feat[:, S : S + 1].contiguous(), leaving_v, leaving_real, gate, real,
                              scale=D**-0.5)
    torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, expected_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("pads", [False, True])
def test_delta_window_step_is_the_delta_window_op_behind_retained_keys(decay, pads):
    gen = torch.Generator().manual_seed(6)
    inputs = retained(gen, pads)
    k_hat = torch.nn.functional.normalize(torch.randn(B, S + W + 1, H, F_DIM, generator=gen, dtype=torch.float64),
                                          dim=-1)
    q_hat = torch.nn.functional.normalize(torch.randn(B, 1, H, F_DIM, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(B, S + W + 1, H, generator=gen, dtype=torch.float64)
    gate = torch.randn(H, generator=gen, dtype=torch.float64)
    state = torch.randn(B, H, F_DIM, D, generator=gen, dtype=torch.float64)
    log_decay = None
    if decay:
        log_decay = torch.cat([torch.zeros(B, S + W, H, dtype=torch.float64),
                               -torch.rand(B, 1, H, generator=gen, dtype=torch.float64)], dim=1)
    real = inputs["mask"][:, -1:] if pads else None

    def output(read):
        return read * 2.0 - 0.5

    expected, expected_state = window_attention(
        inputs["q"], inputs["k"], inputs["v"], q_hat, k_hat, gate, window_size=W, num_sink_tokens=S,
        log_decay=log_decay, key_padding_mask=inputs["mask"], initial_state=state, output_final_state=True,
        update_rule="delta", beta=beta, state_output=output, backend="recurrent")
    keys, values, mask, _, leaving_v, leaving_real = step_slots(inputs)
    state = state.clone()
    o = delta_window_attention_step(
        inputs["q"], q_hat, None if log_decay is None else log_decay[:, -1:], state, keys, values, mask,
        k_hat[:, S : S + 1].contiguous(), leaving_v, beta[:, S : S + 1], leaving_real, gate, real, scale=D**-0.5,
        state_output=output)
    if pads:  # a pad query: the op gives λ · output(0) (not 0 for this output map), the step 0
        expected = torch.where(real.view(B, 1, 1, 1), expected, 0.0)
    torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, expected_state, rtol=1e-12, atol=1e-12)


def test_linear_step_is_the_linear_op_for_one_token():
    gen = torch.Generator().manual_seed(7)
    q_feat, k_feat = (torch.rand(B, 1, H, F_DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, 1, H_KV, D, generator=gen, dtype=torch.float64)
    log_decay = -torch.rand(B, 1, H, F_DIM, generator=gen, dtype=torch.float64)
    state = torch.rand(B, H, F_DIM, D + 1, generator=gen, dtype=torch.float64)
    expected, expected_state = linear_attention(q_feat, k_feat, v, log_decay, scale=0.3, normalize=True,
                                                initial_state=state, output_final_state=True, backend="recurrent")
    state = state.clone()
    o = linear_attention_step(q_feat, k_feat, v, log_decay, state, scale=0.3, normalize=True)
    torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, expected_state, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Backend choice
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the kernels run in its interpreter without a GPU)")
def test_steps_with_backend_triton_run_the_kernels():
    """The entry points hand their arguments to the fused kernels as to the torch steps: the same results to float32
    rounding (grouped-query values repeated for the linear kernel, the slots of a KV head shared in the window one)."""
    device, gen = triton_test_device(), torch.Generator().manual_seed(8)

    def rand(*shape, dtype=torch.float32):
        return torch.rand(*shape, generator=gen).to(device, dtype)

    q_feat, k_feat, v = rand(B, 1, H, F_DIM), rand(B, 1, H, F_DIM), rand(B, 1, H_KV, D)
    log_decay, state = -rand(B, 1, H), rand(B, H, F_DIM, D + 1)
    twin = state.clone()
    o = linear_attention_step(q_feat, k_feat, v, log_decay, state, scale=0.5, normalize=True, backend="triton")
    expected = linear_attention_step(q_feat, k_feat, v, log_decay, twin, scale=0.5, normalize=True, backend="torch")
    torch.testing.assert_close(o, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, twin, rtol=1e-5, atol=1e-5)

    slots = S + W
    mask = torch.rand(B, slots, generator=gen).to(device) > 0.3
    args = [rand(B, 1, H, D), q_feat, log_decay, state, rand(B, slots, H_KV, D), rand(B, slots, H_KV, D), mask,
            rand(B, 1, H, F_DIM), rand(B, 1, H_KV, D), torch.ones(B, 1, dtype=torch.bool, device=device),
            rand(H), None]
    twin = state.clone()
    o = window_attention_step(*args, scale=D**-0.5, backend="triton")
    expected = window_attention_step(*args[:3], twin, *args[4:], scale=D**-0.5, backend="torch")
    torch.testing.assert_close(o, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, twin, rtol=1e-5, atol=1e-5)


def test_steps_pick_their_backend_through_pick_backend(monkeypatch):
    """"auto" runs the fused kernel for CUDA tensors it takes in eager mode, torch
    on CPU, under torch.compile and with a sparse memory; the delta window step has no kernel; unknown names raise."""
    picked = []
    monkeypatch.setitem(ops.LINEAR_STEPS, "torch", lambda *a, **k: picked.append("torch"))
    monkeypatch.setitem(ops.LINEAR_STEPS, "triton", lambda *a, **k: picked.append("triton"))
    x = torch.zeros(1, 1, 2, 4)

    def step(backend="auto"):
        linear_attention_step(x, x, x, None, torch.zeros(1, 2, 4, 4), scale=1.0, normalize=False, backend=backend)
        return picked.pop()

    assert step() == "torch"
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr("hf_linear_attn.ops_triton_common.unsupported_inputs", lambda tensors, *dims: "float64")
    assert step() == "torch"  # inputs the kernel does not take (a dtype, no triton installed)
    monkeypatch.setattr("hf_linear_attn.ops_triton_common.unsupported_inputs", lambda tensors, *dims: None)
    assert step() == "triton"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert step() == "torch"
    assert step("triton") == "triton"  # an explicit choice is kept
    with pytest.raises(ValueError, match="backend must be one of"):
        step("recurrent")


def test_window_steps_without_a_kernel_stay_on_torch(monkeypatch):
    calls = []
    monkeypatch.setitem(ops.WINDOW_STEPS, "torch", lambda *a, **k: calls.append(("torch", k)))
    monkeypatch.setitem(ops.WINDOW_STEPS, "triton", lambda *a, **k: calls.append(("triton", k)))
    monkeypatch.setitem(ops.DELTA_WINDOW_STEPS, "torch", lambda *a, **k: calls.append(("torch", k)))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr("hf_linear_attn.ops_triton_common.unsupported_inputs", lambda tensors, *dims: None)
    x = torch.zeros(1, 1, 2, 4)
    window_attention_step(x, x, None, x, x, x, x, x, x, x, x, None, scale=1.0)
    assert calls.pop()[0] == "triton"
    window_attention_step(x, x, None, x, x, x, x, None, None, None, x, None, scale=1.0, memory_keys=x,
                          memory_values=x, memory_mask=x)
    name, kwargs = calls.pop()
    assert name == "torch" and kwargs["memory_keys"] is x
    with pytest.raises(ValueError, match="no sparse memory"):
        window_attention_step(x, x, None, x, x, x, x, None, None, None, x, None, scale=1.0, memory_keys=x,
                              memory_values=x, memory_mask=x, backend="triton")
    delta_window_attention_step(x, x, None, x, x, x, x, x, x, x, x, x, None, scale=1.0)
    assert calls.pop()[0] == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        delta_window_attention_step(x, x, None, x, x, x, x, x, x, x, x, x, None, scale=1.0, backend="triton")
