"""The fused Triton decode steps (`ops_triton_decode`) against their torch twins: `ops_decode.linear_decode_step`
and the additive window hybrid's decode step (`WindowHybridAttention.decode_step` on torch; no sparse memory), on
the output and on every cache buffer the step updates, for each decay mode, normaliser on / off, GQA, odd head and
feature dims, input dtypes, pad rows and masked ring slots; plus the in-place update and the input errors.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1): tiny shapes.
Both sides compute in float32 from the same inputs, so they agree to float32 rounding; outputs in a 16-bit dtype
may then differ by one unit in the last place of that dtype.
"""

import pytest
import torch
from helpers import (
    VARIANTS,
    assert_close_in_float64,
    assert_runs_without_triton,
    left_pad,
    prompts,
    tiny_config,
    tiny_model,
    triton_test_device,
)

from hf_linear_attn import modeling_linear_attention as modeling
from hf_linear_attn import ops
from hf_linear_attn.cache_linear_attention import WindowStateLayer
from hf_linear_attn.modeling_linear_attention import LinearAttention, WindowHybridAttention
from hf_linear_attn.ops_decode import linear_decode_step
from hf_linear_attn.ops_triton_decode import triton_linear_decode_step, triton_window_decode_step

DEVICE = triton_test_device()

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative to the largest magnitude: float32 rounding of both sides (measured under the interpreter: below 1e-6),
# else one unit in the last place of the output dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}
STATE_TOLERANCE = 1e-5  # the state is float32 on both sides


def log_decays(mode: str | None, batch: int, heads: int, key_dim: int, gen: torch.Generator) -> torch.Tensor | None:
    """None, [B, 1, H] or [B, 1, H, K] log decays in (−1, 0], with one −inf (a full reset) in the first row."""
    if mode is None:
        return None
    shape = (batch, 1, heads) if mode == "scalar" else (batch, 1, heads, key_dim)
    log_decay = -torch.rand(shape, generator=gen)
    log_decay.view(-1)[0] = float("-inf")
    return log_decay.to(DEVICE)


# ---------------------------------------------------------------------------------------------------------------
# Linear attention
# ---------------------------------------------------------------------------------------------------------------


def linear_step_inputs(batch: int, heads: int, key_dim: int, value_dim: int, decay: str | None, normalize: bool,
                       dtype: torch.dtype, pad_row: int | None = None) -> dict:
    """Positive features (a real denominator), a state with a positive normaliser column; the row `pad_row` is a pad
    as `LinearAttention.linear_forward` passes it: zero φ(k), v and log decay."""
    gen = torch.Generator().manual_seed(batch * 100 + key_dim)
    q_feat, k_feat = (torch.rand(batch, 1, heads, key_dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
    v = torch.randn(batch, 1, heads, value_dim, generator=gen).to(DEVICE, dtype)
    log_decay = log_decays(decay, batch, heads, key_dim, gen)
    state = torch.randn(batch, heads, key_dim, value_dim + int(normalize), generator=gen)
    if normalize:
        state[..., -1] = state[..., -1].abs() + 1.0
    if pad_row is not None:
        for x in (k_feat, v, log_decay):
            if x is not None:
                x[pad_row] = 0.0
    return dict(q_feat=q_feat, k_feat=k_feat, v=v, log_decay=log_decay, state=state.to(DEVICE))


def compare_linear_step(inputs: dict, *, normalize: bool, scale: float = 0.3) -> torch.Tensor:
    """The kernel and the twin on copies of one state: same output (dtype, values) and same updated state.
    Returns the updated state."""
    dtype = inputs["v"].dtype
    twin_state, state = inputs["state"].clone(), inputs["state"].clone()
    expected = linear_decode_step(**{**inputs, "state": twin_state}, scale=scale, normalize=normalize)
    o = triton_linear_decode_step(**{**inputs, "state": state}, scale=scale, normalize=normalize)
    assert o.dtype == expected.dtype == dtype
    assert_close_in_float64([o], [expected], TOLERANCE[dtype])
    assert_close_in_float64([state], [twin_state], STATE_TOLERANCE)
    return state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
def test_linear_step_matches_twin(decay, normalize, dtype):
    """Odd dims (K = 40 features, V = 24), batch 3 with a pad row, every decay mode."""
    inputs = linear_step_inputs(3, 2, 40, 24, decay, normalize, dtype, pad_row=1)
    before = inputs["state"][1].clone()
    state = compare_linear_step(inputs, normalize=normalize)
    assert torch.equal(state[1], before)  # a pad leaves its state as it was


@pytest.mark.parametrize("decay", [None, "vector"])
def test_linear_step_several_blocks(decay):
    """Batch 1, K = 100 and V = 72: more than one block of state rows and of value columns per program."""
    compare_linear_step(linear_step_inputs(1, 3, 100, 72, decay, True, torch.float32), normalize=True)


def test_linear_step_updates_state_in_place():
    """The caller's tensor holds the new state (same storage); a step on a copy would leave it as it was."""
    inputs = linear_step_inputs(2, 2, 8, 6, "scalar", True, torch.float32)
    state, before = inputs["state"], inputs["state"].clone()
    address = state.data_ptr()
    expected_state = before.clone()
    linear_decode_step(**{**inputs, "state": expected_state}, scale=0.5, normalize=True)
    triton_linear_decode_step(**inputs, scale=0.5, normalize=True)
    assert state.data_ptr() == address
    assert not torch.equal(state, before)
    assert_close_in_float64([state], [expected_state], STATE_TOLERANCE)


def test_linear_step_errors():
    inputs = linear_step_inputs(2, 2, 8, 6, "scalar", True, torch.float32)

    def step(normalize=True, **changes):
        return triton_linear_decode_step(**{**inputs, **changes}, scale=0.5, normalize=normalize)

    with pytest.raises(ValueError, match=r"q_feat must be \[B, 1, H, K\] = \(any, 1, any, any\), got \(2, 2, 2, 8\)"):
        step(q_feat=inputs["q_feat"].expand(2, 2, 2, 8))
    with pytest.raises(ValueError, match="k_feat must be"):
        step(k_feat=inputs["k_feat"][..., :5])
    with pytest.raises(ValueError, match="log_decay must be None or a tensor of shape"):
        step(log_decay=inputs["log_decay"][:, :, :1])
    with pytest.raises(ValueError, match=r"state must be a float32 tensor of shape \(2, 2, 8, 6\)"):
        step(normalize=False)  # the state has the normaliser column
    with pytest.raises(ValueError, match="state must be a float32"):
        step(state=inputs["state"].double())
    with pytest.raises(ValueError, match="contiguous"):
        step(state=inputs["state"].transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        step(q_feat=inputs["q_feat"].double())
    with pytest.raises(ValueError, match="scale"):
        triton_linear_decode_step(**inputs, scale=float("nan"), normalize=True)


# ---------------------------------------------------------------------------------------------------------------
# Window hybrid
# ---------------------------------------------------------------------------------------------------------------


def window_layer(heads: int, kv_heads: int, head_dim: int, feature_dim: int, dtype: torch.dtype, *, window: int,
                 sinks: int) -> LinearAttention:
    """An additive window-hybrid layer (its decode step is the twin) with a random window gate in `dtype` and
    `feature_dim` (even) key features: hedgehog's 2 · feature_dim / 2, which the step computes of the leaving key."""
    config = tiny_config(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         feature_map="hedgehog", feature_dim=feature_dim // 2, window_size=window,
                         num_sink_tokens=sinks)
    layer = WindowHybridAttention(config, layer_idx=0)
    with torch.no_grad():
        layer.window_gate.copy_(torch.randn(heads))
        layer.feature_map_k.weight.normal_(0.0, head_dim**-0.5)  # (a bare module's weights are uninitialised)
    return layer.to(DEVICE, dtype)


def window_cache(
    batch: int, heads: int, kv_heads: int, head_dim: int, feature_dim: int, dtype: torch.dtype, *, window: int,
    sinks: int, seen: int, gen: torch.Generator, empty: bool = False,
) -> dict[str, torch.Tensor]:
    """The buffers of a window-hybrid cache layer after `seen` positions: random ring slots of which about a third
    are masked (pads, or not yet filled), the sinks filled in every row but the last, whose first sink only holds a
    token (or, if empty, no slot held at all); a state with a positive normaliser column."""
    slots = sinks + window
    mask = torch.rand(batch, slots, generator=gen) > 0.35
    mask[:, :sinks] = True
    if batch > 1:
        mask[-1, 1:sinks] = False
    if empty:
        mask[:] = False
    state = torch.randn(batch, heads, feature_dim, head_dim + 1, generator=gen)
    state[..., -1] = state[..., -1].abs() + 1.0
    return dict(
        state=state.to(DEVICE),
        window_keys=torch.randn(batch, slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype),
        window_values=torch.randn(batch, slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype),
        window_mask=mask.to(DEVICE),
        seen=torch.tensor(seen, device=DEVICE),
    )


def cache_layer(buffers: dict[str, torch.Tensor], config) -> WindowStateLayer:
    """A window cache layer of `config`'s sizes holding copies of `buffers`."""
    layer = WindowStateLayer(config.window_size, config.num_sink_tokens)
    for name, x in buffers.items():
        setattr(layer, name, x.clone())
    layer.sinks_filled = False  # the step then checks the sink slots itself
    return layer


def kernel_window_step(layer: LinearAttention, cache: WindowStateLayer, q, k, v, q_feat, log_decay, real):
    """The step as the model would run it with the kernel: the ring write in torch, the leaving key's features,
    then one kernel."""
    leaving_keys, leaving_values, leaving_real = cache.push(k, v, real)
    o = triton_window_decode_step(
        q, q_feat, log_decay, cache.state, cache.window_keys, cache.window_values, cache.window_mask,
        layer.key_features(leaving_keys), leaving_values, leaving_real, layer.window_gate, real,
        scale=layer.head_dim**-0.5)
    cache.advance(1, q.device)
    return o


def compare_window_step(batch: int, heads: int, kv_heads: int, head_dim: int, feature_dim: int, decay: str | None,
                        dtype: torch.dtype, *, pads: bool, window: int = 5, sinks: int = 2, seen: int = 11,
                        steps: int = 1, empty: bool = False) -> None:
    """The kernel step and the twin on copies of one cache, `steps` tokens one after the other: the same output and
    the same buffers after every step."""
    gen = torch.Generator().manual_seed(batch * 1000 + heads * 10 + head_dim)
    layer = window_layer(heads, kv_heads, head_dim, feature_dim, dtype, window=window, sinks=sinks)
    buffers = window_cache(batch, heads, kv_heads, head_dim, feature_dim, dtype, window=window, sinks=sinks,
                           seen=seen, gen=gen, empty=empty)
    twin, ours = cache_layer(buffers, layer.config), cache_layer(buffers, layer.config)
    for _ in range(steps):
        q = torch.randn(batch, 1, heads, head_dim, generator=gen).to(DEVICE, dtype)
        k, v = (torch.randn(batch, 1, kv_heads, head_dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
        q_feat = torch.rand(batch, 1, heads, feature_dim, generator=gen).to(DEVICE, dtype)
        log_decay = log_decays(decay, batch, heads, feature_dim, gen)
        real = None
        if pads:  # the first row's token is a pad: the model zeroes its log decay
            real = torch.ones(batch, 1, dtype=torch.bool, device=DEVICE)
            real[0] = False
            if log_decay is not None:
                log_decay[0] = 0.0
        with torch.no_grad():
            expected = layer.decode_step(q, k, v, q_feat, log_decay, real, twin)
            o = kernel_window_step(layer, ours, q, k, v, q_feat, log_decay, real)
        assert o.dtype == expected.dtype == dtype and o.shape == (batch, 1, heads, head_dim)
        assert_close_in_float64([o], [expected], TOLERANCE[dtype])
        if pads:
            assert (o[0] == 0).all()
        assert_close_in_float64([ours.state], [twin.state], STATE_TOLERANCE)
        for name in ("window_keys", "window_values", "window_mask", "seen"):
            assert torch.equal(getattr(ours, name), getattr(twin, name)), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)], ids=["G1", "G3"])
def test_window_step_matches_twin(heads, kv_heads, decay, dtype):
    """D = 24, F = 40, batch 3 (a pad row, a row with unfilled sinks, masked ring slots), GQA groups 1 and 3."""
    compare_window_step(3, heads, kv_heads, 24, 40, decay, dtype, pads=True)


@pytest.mark.parametrize("pads", [False, True])
def test_window_step_batch_one(pads):
    """Batch 1, with every token real (real=None: no pad handling) or a pad (an output of 0)."""
    compare_window_step(1, 6, 2, 24, 40, "scalar", torch.bfloat16, pads=pads)


@pytest.mark.parametrize("decay", [None, "vector"])
def test_window_steps_from_an_empty_cache(decay):
    """Nine tokens from a cache that holds none yet: the sinks fill, then the ring, which wraps around, and tokens
    leave it into the state (with a decay, each step's one −inf log decay resets a part of the state)."""
    compare_window_step(2, 6, 2, 24, 40, decay, torch.float32, pads=False, seen=0, steps=9, empty=True)


def test_window_step_several_blocks():
    """D = V = 256 (the largest) and 40 slots: several blocks of slots and of state rows per program, so the online
    softmax carries its maximum from block to block."""
    compare_window_step(2, 2, 1, 256, 40, "vector", torch.float32, pads=True, window=36, sinks=4, seen=50)


def test_window_step_updates_state_in_place():
    """The cache's state tensor itself holds the new state; a step on a copy would leave it as it was."""
    gen = torch.Generator().manual_seed(5)
    buffers = window_cache(2, 2, 1, 8, 6, torch.float32, window=4, sinks=1, seen=9, gen=gen)
    layer = window_layer(2, 1, 8, 6, torch.float32, window=4, sinks=1)
    cache, twin = cache_layer(buffers, layer.config), cache_layer(buffers, layer.config)
    state, before = cache.state, cache.state.clone()
    q, k, v = (torch.randn(2, 1, h, 8, generator=gen).to(DEVICE) for h in (2, 1, 1))
    q_feat = torch.rand(2, 1, 2, 6, generator=gen).to(DEVICE)
    log_decay = -torch.rand(2, 1, 2, generator=gen).to(DEVICE)
    with torch.no_grad():
        layer.decode_step(q, k, v, q_feat, log_decay, None, twin)
        kernel_window_step(layer, cache, q, k, v, q_feat, log_decay, None)
    assert cache.state is state and not torch.equal(state, before)
    assert_close_in_float64([state], [twin.state], STATE_TOLERANCE)


def test_window_step_errors():
    gen = torch.Generator().manual_seed(1)
    buffers = window_cache(2, 4, 2, 8, 6, torch.float32, window=4, sinks=1, seen=9, gen=gen)
    q = torch.randn(2, 1, 4, 8, device=DEVICE)
    q_feat = torch.rand(2, 1, 4, 6, device=DEVICE)
    leaving = dict(leaving_feat=torch.rand(2, 1, 4, 6, device=DEVICE), leaving_values=buffers["window_values"][:, :1],
                   leaving_real=buffers["window_mask"][:, :1])
    inputs = dict(q=q, q_feat=q_feat, log_decay=None, state=buffers["state"], window_keys=buffers["window_keys"],
                  window_values=buffers["window_values"], window_mask=buffers["window_mask"], **leaving,
                  window_gate=torch.zeros(4, device=DEVICE), real=None)

    def step(**changes):
        return triton_window_decode_step(**{**inputs, **changes}, scale=0.3)

    step()  # the inputs are valid
    with pytest.raises(ValueError, match=r"q must be \[B, 1, H, D\]"):
        step(q=q.expand(2, 3, 4, 8))
    with pytest.raises(ValueError, match="H_kv KV heads dividing H = 4"):
        step(window_keys=torch.randn(2, 5, 3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="window_values must be"):
        step(window_values=buffers["window_values"][:, :3])
    with pytest.raises(ValueError, match="window_mask must be a bool tensor"):
        step(window_mask=buffers["window_mask"].float())
    with pytest.raises(ValueError, match="real must be a bool tensor of shape"):
        step(real=torch.ones(2, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="window_gate must be a tensor of shape"):
        step(window_gate=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match=r"state must be a float32 tensor of shape \(2, 4, 6, 9\)"):
        step(state=buffers["state"][..., :-1])
    with pytest.raises(ValueError, match="contiguous"):
        step(state=buffers["state"].transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="window head dims up to 256"):
        step(window_keys=torch.randn(2, 5, 2, 300, device=DEVICE), q=torch.randn(2, 1, 4, 300, device=DEVICE))


# ---------------------------------------------------------------------------------------------------------------
# Without triton (the choice of a step's backend: tests/test_decode_ops.py)
# ---------------------------------------------------------------------------------------------------------------


def test_module_imports_without_triton():
    """Remote code loads where triton is missing: the decode kernels are then never picked, and a direct call says
    why."""
    code = """
        import torch
        from hf_linear_attn import ops, ops_triton_decode
        q = torch.randn(1, 1, 2, 4)
        ops.linear_attention_step(q, q, q, None, torch.zeros(1, 2, 4, 4), scale=1.0, normalize=False)  # torch
        """
    assert_runs_without_triton(code, "ops_triton_decode.triton_linear_decode_step(q, q, q, None, "
                                     "torch.zeros(1, 2, 4, 4), scale=1.0, normalize=False)")


# ---------------------------------------------------------------------------------------------------------------
# In the model
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE != "cpu", reason="forces the CUDA-only selection on CPU tensors (the interpreter)")
@pytest.mark.parametrize("variant", ["hedgehog-window-sinks-scalar-decay", "elu", "relu-unnormalized",
                                     "t2r-vector-decay", "hedgehog-window-sinks",
                                     "hedgehog-window-sinks-scalar-decay-sparse-memory"])
def test_generate_with_the_kernels_matches_torch(variant, monkeypatch):
    """The model's decode steps on the kernels (forced here with backend "triton", as "auto" picks them on CUDA): a
    left-padded greedy `generate()` gives the torch steps' tokens and logits, and the kernels really ran (once per
    linear layer and token; the sparse-memory hybrid keeps its torch step, which "auto" picks for it)."""
    model = tiny_model(**VARIANTS[variant]).eval()
    ids = prompts([9, 6])
    ids, mask = left_pad(ids)
    calls, forced = [], []
    for steps in (ops.LINEAR_STEPS, ops.WINDOW_STEPS):
        kernel = steps["triton"]
        monkeypatch.setitem(steps, "triton", lambda *a, kernel=kernel, **k: calls.append(1) or kernel(*a, **k))

    def forcing(step):
        def run(*args, **kwargs):
            kernel_takes_it = kwargs.get("memory_keys") is None  # (no kernel for the sparse memory)
            return step(*args, **kwargs, backend="triton" if forced and kernel_takes_it else "auto")
        return run

    monkeypatch.setattr(modeling, "linear_attention_step", forcing(ops.linear_attention_step))
    monkeypatch.setattr(modeling, "window_attention_step", forcing(ops.window_attention_step))
    runs = []
    with torch.no_grad():
        for force in (False, True):
            forced[:], calls[:] = [True] if force else [], []
            out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
            runs.append((out, len(calls)))
    (eager, no_calls), (fused, kernel_calls) = runs
    assert no_calls == 0
    sparse = model.config.sparse_cache_size > 0
    assert kernel_calls == (0 if sparse else 4 * model.config.num_hidden_layers)  # 4 decode steps after the prefill
    assert torch.equal(fused.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(fused.scores), torch.stack(eager.scores), rtol=1e-5, atol=1e-5)
