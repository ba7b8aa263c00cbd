"""linear_attention: every backend against the token-loop oracle, packed sequences, dtypes, validation."""

import pytest
import torch
from helpers import assert_all_close, make_inputs, with_resets

from hf_linear_attn import ops, ops_chunked, ops_common
from hf_linear_attn.ops import linear_attention
from hf_linear_attn.ops_common import CHUNK_SIZE

C = CHUNK_SIZE
DECAYS = [None, "fixed", "scalar", "vector"]


def run_with_grads(inputs: dict, backend: str, **kwargs) -> list[torch.Tensor]:
    """Output, final state and the gradients of a fixed random weighting of both w.r.t. every input."""
    o, state = linear_attention(**inputs, output_final_state=True, backend=backend, **kwargs)
    gen = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    loss = loss + (state * torch.randn(state.shape, generator=gen, dtype=state.dtype)).sum()
    leaves = [x for x in inputs.values() if x is not None]
    return [o, state, *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("key_dim, value_dim", [(5, 3), (16, 8)])
@pytest.mark.parametrize("length", [1, 7, C - 1, C + 1, 3 * C + 5])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", DECAYS)
def test_backends_match_recurrent(decay, normalize, length, key_dim, value_dim, with_state):
    inputs = make_inputs(decay, normalize, length, key_dim, value_dim, with_state=with_state)
    expected = run_with_grads(inputs, "recurrent", normalize=normalize)
    for backend in ("parallel", "torch"):
        assert_all_close(run_with_grads(inputs, backend, normalize=normalize), expected, 1e-10)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", DECAYS)
def test_torch_float32_matches_recurrent(decay, normalize):
    inputs = make_inputs(decay, normalize, 3 * C + 5, 16, 8, with_state=True, dtype=torch.float32)
    expected = run_with_grads(inputs, "recurrent", normalize=normalize)
    assert_all_close(run_with_grads(inputs, "torch", normalize=normalize), expected, 1e-5)


@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_decayed_state_scan_across_groups(decay, normalize, group_size, monkeypatch):
    """The torch backend scans the states of groups of SCAN_GROUP_SIZE chunks at once, and the lengths above
    fit in one group: here 4 chunks make 4 groups of one, or 2 groups of 3 with the last one padded."""
    monkeypatch.setattr(ops_chunked, "SCAN_GROUP_SIZE", group_size)
    inputs = make_inputs(decay, normalize, 3 * C + 5, 16, 8, with_state=True)
    expected = run_with_grads(inputs, "recurrent", normalize=normalize)
    assert_all_close(run_with_grads(inputs, "torch", normalize=normalize), expected, 1e-10)


@pytest.mark.parametrize(
    "dtype, log_decay_value, tol",
    [
        (torch.float64, -30.0, 1e-9),
        (torch.float64, -1e4, 1e-9),
        # float32 decays are differences of prefix sums: error ≈ 1e-7 · |Σ log_decay| over a chunk (or, for
        # the parallel oracle, the whole sequence), relative to the output.
        (torch.float32, -30.0, 5e-4),
        (torch.float32, -1e4, 1e-1),
    ],
)
@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_strong_decay_stays_finite(decay, dtype, log_decay_value, tol):
    """Decays far past exp underflow: no inf / nan in outputs, states or gradients."""
    inputs = make_inputs(decay, False, 3 * C + 5, 16, 8, with_state=True, dtype=dtype)
    log_decay = inputs["log_decay"].detach()
    # Half the steps (and, for vector decay, some key dims) decay hard, the rest gently.
    strong = torch.rand(log_decay.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    inputs["log_decay"] = torch.where(strong, log_decay_value, log_decay).requires_grad_()
    expected = run_with_grads(inputs, "recurrent")
    for backend in ("parallel", "torch"):
        assert_all_close(run_with_grads(inputs, backend), expected, tol)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_reset_decays_match_the_token_loop(decay, normalize, with_state):
    """log_decay = −inf (a full reset, e.g. a document boundary) and ≤ −1e30 anywhere: every backend gives what
    the token loop gives, outputs, final states and gradients, without inf or nan."""
    inputs = make_inputs(decay, normalize, 3 * C + 5, 16, 8, with_state=with_state)
    inputs["log_decay"] = with_resets(inputs["log_decay"])
    expected = run_with_grads(inputs, "recurrent", normalize=normalize)
    for backend in ("parallel", "torch"):
        assert_all_close(run_with_grads(inputs, backend, normalize=normalize), expected, 1e-10)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_reset_decays_in_float32(decay, normalize):
    """Decays between positions are differences of prefix sums, raised to the floor (about −87 in float32) where
    lower: the error is about 1e-7 · |Σ log_decay| over a chunk, here some 20 steps at the floor (1e-4)."""
    inputs = make_inputs(decay, normalize, 3 * C + 5, 16, 8, with_state=True, dtype=torch.float32)
    inputs["log_decay"] = with_resets(inputs["log_decay"])
    expected = run_with_grads(inputs, "recurrent", normalize=normalize)
    assert_all_close(run_with_grads(inputs, "torch", normalize=normalize), expected, 1e-4)


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "torch"])
def test_minus_inf_forgets_everything_before(backend):
    """A user marks a document boundary with log_decay = −inf: outputs from there on are those of the second
    document run alone, from no state, whatever came before (and whatever initial state was given)."""
    inputs = {name: x.detach() for name, x in make_inputs("scalar", True, 2 * C + 9, 16, 8, with_state=True).items()}
    boundary = C - 5
    inputs["log_decay"][:, boundary] = -torch.inf
    o, state = linear_attention(**inputs, normalize=True, output_final_state=True, backend=backend)
    second = {name: inputs[name][:, boundary:] for name in ("q", "k", "v", "log_decay")}
    second["log_decay"] = second["log_decay"].clone()
    second["log_decay"][:, 0] = 0.0
    o_alone, state_alone = linear_attention(**second, normalize=True, output_final_state=True, backend="recurrent")
    torch.testing.assert_close(o[:, boundary:], o_alone, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state, state_alone, rtol=1e-10, atol=1e-12)


def test_auto_backend_and_default_scale():
    inputs = make_inputs("vector", False, 70, 16, 8)
    inputs = {name: x.detach() for name, x in inputs.items() if x is not None}
    o_auto, _ = linear_attention(**inputs)
    o_torch, _ = linear_attention(**inputs, backend="torch")
    assert torch.equal(o_auto, o_torch)
    scaled = dict(inputs, q=inputs["q"] * 16**-0.5)
    torch.testing.assert_close(linear_attention(**scaled, scale=1.0, backend="recurrent")[0], o_auto)


def test_final_state_only_on_request():
    inputs = make_inputs(None, True, 9, 5, 3)
    o, state = linear_attention(**inputs)
    assert state is None
    _, state = linear_attention(**inputs, normalize=True, output_final_state=True)
    assert state.shape == (2, 2, 5, 3 + 1) and state.dtype == torch.float64


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "torch"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_packed_sequences_match_separate_runs(decay, normalize, backend):
    lengths = [5, 0, C + 6, 1, C]  # a zero-length sequence keeps its initial state
    packed = make_inputs(decay, normalize, sum(lengths), 16, 8, batch=1, seed=1)
    states = make_inputs(decay, normalize, 1, 16, 8, batch=len(lengths), with_state=True, seed=2)
    initial_state = states["initial_state"].detach()
    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    o, final_state = linear_attention(
        **{name: x for name, x in packed.items() if name != "initial_state"},
        normalize=normalize, initial_state=initial_state, output_final_state=True,
        cu_seqlens=cu_seqlens, backend=backend,
    )
    assert o.shape == packed["v"].shape and final_state.shape == initial_state.shape
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)):
        if start == end:
            torch.testing.assert_close(final_state[n], initial_state[n])
            continue
        alone = {name: packed[name][:, start:end] for name in ("q", "k", "v", "log_decay")}
        o_n, state_n = linear_attention(
            **alone, normalize=normalize, initial_state=initial_state[n : n + 1], output_final_state=True,
            backend="recurrent",
        )
        torch.testing.assert_close(o[:, start:end], o_n)
        torch.testing.assert_close(final_state[n : n + 1], state_n)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype, normalize):
    """Low-precision inputs: output in the input dtype, states in float32, close to the float32 oracle."""
    inputs = make_inputs("vector", normalize, 2 * C + 3, 16, 8, with_state=True, dtype=torch.float32)
    inputs = {name: x.detach() for name, x in inputs.items()}
    low = dict(inputs, q=inputs["q"].to(dtype), k=inputs["k"].to(dtype), v=inputs["v"].to(dtype))
    o, state = linear_attention(**low, normalize=normalize, output_final_state=True, backend="torch")
    assert o.dtype == dtype and state.dtype == torch.float32
    exact = {name: x.float() for name, x in low.items()}
    o_ref, state_ref = linear_attention(
        **exact, normalize=normalize, output_final_state=True, backend="recurrent"
    )
    assert_all_close([o.float(), state], [o_ref, state_ref], 2e-2)


def _args(batch: int = 1, length: int = 6, heads: int = 2, key_dim: int = 4, value_dim: int = 3, **changes) -> dict:
    """Valid arguments for linear_attention (of the given sizes, any of which may be 0) with `changes` applied."""
    args = {
        "q": torch.randn(batch, length, heads, key_dim),
        "k": torch.randn(batch, length, heads, key_dim),
        "v": torch.randn(batch, length, heads, value_dim),
        "log_decay": -torch.rand(batch, length, heads),
    }
    return {**args, **changes}


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (_args(q=torch.randn(6, 2, 4)), "q"),
        (_args(v=torch.randn(1, 6, 2)), "v"),
        (_args(k=torch.randn(1, 6, 2, 5)), "k"),
        (_args(k=torch.randn(1, 5, 2, 4)), "k"),
        (_args(v=torch.randn(1, 6, 3, 3)), "v"),
        (_args(q=torch.ones(1, 6, 2, 4, dtype=torch.int64)), "q"),
        (_args(length=0), "q, k, v"),
        (_args(log_decay=-torch.rand(1, 6, 2, 3)), "log_decay"),
        (_args(log_decay=torch.full((1, 6, 2), 0.1)), "log_decay must be ≤ 0"),
        (_args(log_decay=torch.tensor([[[-0.1, float("nan")]] * 6])), "log_decay must not contain nan"),
        (_args(log_decay=torch.full((1, 6, 2), -1, dtype=torch.int64)), "log_decay"),
        (_args(batch=0), "q must have B, H, K ≥ 1"),
        (_args(heads=0), "q must have B, H, K ≥ 1"),
        (_args(key_dim=0), "q must have B, H, K ≥ 1"),
        (_args(value_dim=0), "v must have V ≥ 1"),
        (_args(scale=0.0), "scale must be a finite number > 0"),
        (_args(scale=-0.5), "scale must be a finite number > 0"),
        (_args(scale=float("inf")), "scale must be a finite number > 0"),
        (_args(scale=float("nan")), "scale must be a finite number > 0"),
        (_args(initial_state=torch.zeros(1, 2, 4, 4)), "initial_state"),
        (_args(initial_state=torch.zeros(1, 2, 4, 3), normalize=True), "initial_state"),
        (_args(batch=2, cu_seqlens=torch.tensor([0, 2, 6])), "cu_seqlens"),
        (_args(cu_seqlens=torch.tensor([0.0, 6.0])), "cu_seqlens"),
        (_args(cu_seqlens=torch.tensor([[0, 6]])), "cu_seqlens"),
        (_args(cu_seqlens=torch.tensor([1, 6])), "cu_seqlens"),
        (_args(cu_seqlens=torch.tensor([0, 5])), "cu_seqlens"),
        (_args(cu_seqlens=torch.tensor([0, 4, 2, 6])), "cu_seqlens"),
        (_args(cu_seqlens=torch.tensor([0, 2, 6]), initial_state=torch.zeros(1, 2, 4, 3)), "initial_state"),
        (_args(backend="triton-ish"), "backend"),
        (_args(backend="reference"), "backend"),
    ],
)
def test_invalid_arguments_raise(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        linear_attention(**kwargs)


@pytest.mark.parametrize("scale", ["0.5", [0.5], True, torch.tensor(0.5)])
def test_non_numeric_scale_raises_type_error(scale):
    with pytest.raises(TypeError, match="scale must be a number"):
        linear_attention(**_args(scale=scale))


def test_value_checks_read_no_values_off_the_cpu(monkeypatch):
    """On an accelerator, reading log_decay's or cu_seqlens' values would sync with the host in every layer call:
    validation leaves them alone there (meta tensors have no values to read), unless the debug switch is on."""
    meta = {name: x.to("meta") for name, x in _args().items()}
    o, _ = linear_attention(**meta, backend="recurrent")
    assert o.device.type == "meta" and o.shape == (1, 6, 2, 3)
    monkeypatch.setenv(ops_common.CHECK_VALUES_ENV, "1")
    with pytest.raises(RuntimeError, match="meta"):  # the checks now try to read the values
        linear_attention(**meta, backend="recurrent")


def test_auto_picks_by_device_query_count_and_what_triton_takes():
    def pick(device, single_query=False, problem=None):
        return ops.pick_backend("auto", torch.device(device), single_query=single_query, triton_problem=lambda: problem)

    assert pick("cpu") == "torch"
    assert pick("cuda") == "triton"
    assert pick("cuda", problem="float64") == "torch"
    assert pick("cuda", single_query=True) == "recurrent"  # one decode step: the direct form
    assert pick("cpu", single_query=True) == "recurrent"
    with pytest.raises(ValueError, match="needs the triton package"):
        ops.pick_backend("triton", torch.device("cuda"), single_query=False,
                         triton_problem=lambda: "backend 'triton' needs the triton package")


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "torch"])
@pytest.mark.parametrize("cu_seqlens", [None, [0, 2, 6]])
def test_grouped_values_equal_the_repeated_call(backend, cu_seqlens):
    """v with H_kv heads (H_kv dividing H, repeated inside) gives exactly what the repeated v gives."""
    states = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    args = _args(batch=1, heads=4, log_decay=-torch.rand(1, 6, 4), initial_state=torch.rand(states, 4, 4, 3))
    args["v"] = torch.randn(1, 6, 2, 3)
    kwargs = dict(output_final_state=True, backend=backend,
                  cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens))
    o, state = linear_attention(**args, **kwargs)
    expected, expected_state = linear_attention(**{**args, "v": args["v"].repeat_interleave(2, dim=2)}, **kwargs)
    assert torch.equal(o, expected) and torch.equal(state, expected_state)
    with pytest.raises(ValueError, match="H_kv dividing H = 4"):
        linear_attention(**{**args, "v": torch.randn(1, 6, 3, 3)}, **kwargs)
