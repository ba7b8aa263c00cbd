"""delta_rule_attention: the chunked backend against the token-loop oracle and against transformers' Qwen3-Next
references (outputs, final states, gradients), packed sequences, resets, dtypes, validation."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_in_float64, make_delta_rule_inputs, outputs_and_grads
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from hf_linear_attn.ops_delta_rule import delta_rule_attention
from hf_linear_attn.ops_delta_rule_chunked import CHUNK_SIZE, _ChunkStates, _UnitLowerTriangularSolve

C = CHUNK_SIZE
# The pure-torch functions, not whatever kernel package the decorator may have swapped in.
hf_chunk = getattr(qwen3_next.torch_chunk_gated_delta_rule, "__wrapped__", qwen3_next.torch_chunk_gated_delta_rule)
hf_recurrent = getattr(
    qwen3_next.torch_recurrent_gated_delta_rule, "__wrapped__", qwen3_next.torch_recurrent_gated_delta_rule
)


def make_inputs(length: int, *, dtype: torch.dtype = torch.float64, **options) -> dict[str, torch.Tensor | None]:
    """`make_delta_rule_inputs` as leaf tensors in `dtype` (options: decay, with_state and the sizes)."""
    tensors = make_delta_rule_inputs(length, **options)
    return {n: None if x is None else x.to(dtype).requires_grad_() for n, x in tensors.items()}


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("length", [1, C - 1, C + 1, 2 * C + 2])
def test_chunked_matches_recurrent(length, decay, with_state):
    inputs = make_inputs(length, decay=decay, with_state=with_state)
    expected = outputs_and_grads(delta_rule_attention, inputs, backend="recurrent")
    actual = outputs_and_grads(delta_rule_attention, inputs, backend="torch")
    assert [x.dtype for x in actual] == [x.dtype for x in expected]
    assert_close_in_float64(actual, expected, 1e-11)


# Measured largest relative errors: float32 8e-7, bfloat16 3.5e-3, float16 4e-4 (float64: 1e-15, checked at 1e-11).
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_low_precision_matches_float64_oracle(dtype, tol):
    """q, k, v, beta, log_decay in `dtype` (the keys as rounded, norms within rounding of 1), the state in float32:
    outputs, final state and gradients of the chunked backend agree with the float64 oracle on the same values."""
    inputs = make_inputs(C + 9, with_state=True)
    low = {n: x.detach().to(torch.float32 if n == "initial_state" else dtype).requires_grad_()
           for n, x in inputs.items()}
    exact = {n: x.detach().double().requires_grad_() for n, x in low.items()}
    actual = outputs_and_grads(delta_rule_attention, low, backend="torch")
    o, state, *grads = actual
    assert o.dtype == dtype and state.dtype == torch.float32
    assert [g.dtype for g in grads] == [x.dtype for x in low.values()]
    assert_close_in_float64(actual, outputs_and_grads(delta_rule_attention, exact, backend="recurrent"), tol)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("backend", ["recurrent", "torch"])
def test_packed_sequences_match_separate_runs(backend, with_state):
    lengths = [5, 0, C + 6, C, 1]
    packed = make_inputs(sum(lengths), batch=1)
    del packed["initial_state"]  # None: given per sequence below
    states = torch.randn(len(lengths), 2, 8, 5, dtype=torch.float64)
    if not with_state:
        states.zero_()  # what each sequence starts from when initial_state is None
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    o, final = delta_rule_attention(**packed, initial_state=states if with_state else None, output_final_state=True,
                                    cu_seqlens=cu_seqlens, backend=backend)
    assert final.shape == states.shape
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)):
        if start == end:
            assert torch.equal(final[n], states[n])  # an empty sequence keeps its state
            continue
        alone = {name: x[:, start:end] for name, x in packed.items()}
        o_n, final_n = delta_rule_attention(**alone, initial_state=states[n : n + 1], output_final_state=True,
                                            backend="recurrent")
        assert_close_in_float64([o[:, start:end], final[n : n + 1]], [o_n, final_n], 1e-11)


def test_packed_gradients_match_recurrent():
    lengths = [C + 3, 2, 30]
    inputs = make_inputs(sum(lengths), batch=1, with_state=False)
    inputs["initial_state"] = torch.randn(3, 2, 8, 5, dtype=torch.float64, requires_grad=True)
    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    expected = outputs_and_grads(delta_rule_attention, inputs, cu_seqlens=cu_seqlens, backend="recurrent")
    actual = outputs_and_grads(delta_rule_attention, inputs, cu_seqlens=cu_seqlens, backend="torch")
    assert_close_in_float64(actual, expected, 1e-11)


@pytest.mark.parametrize("backend", ["recurrent", "torch"])
def test_minus_inf_decay_resets_the_state(backend):
    """a_t = exp(−inf) = 0 forgets everything before t: the outputs from t on equal a fresh run from t, and the
    chunked backend's gradients stay finite and equal the oracle's."""
    inputs = make_inputs(2 * C + 5, with_state=True)
    log_decay = inputs["log_decay"].detach().clone()
    for reset in (3, C - 1, C, C + C // 2 + 8):  # inside a chunk, at its last and first token
        log_decay[0, reset, 0] = -torch.inf
    inputs["log_decay"] = log_decay.requires_grad_()
    o, _ = delta_rule_attention(**inputs, backend=backend)
    reset = C + C // 2 + 8
    fresh = {n: x[:1, reset:, :1].detach() for n, x in inputs.items() if n != "initial_state"}
    fresh["log_decay"][:, 0] = 0.0  # the decay at the reset would act on a zero state anyway
    o_fresh, _ = delta_rule_attention(**fresh, backend="recurrent")
    assert_close_in_float64([o[:1, reset:, :1]], [o_fresh], 1e-12)
    if backend == "torch":
        expected = outputs_and_grads(delta_rule_attention, inputs, backend="recurrent")
        assert_close_in_float64(outputs_and_grads(delta_rule_attention, inputs, backend="torch"), expected, 1e-11)


def test_delta_rule_overwrites_the_value_stored_under_a_key():
    """With β = 1, no decay and a repeated unit key, the second write replaces the first: reading with q = k
    (scale 1) returns exactly the second value, where additive attention would return their sum."""
    k = F.normalize(torch.randn(1, 1, 1, 6, dtype=torch.float64), dim=-1).expand(1, 2, 1, 6)
    v = torch.randn(1, 2, 1, 3, dtype=torch.float64)
    for backend in ("recurrent", "torch"):
        o, _ = delta_rule_attention(k, k, v, torch.ones(1, 2, 1, dtype=torch.float64), scale=1.0, backend=backend)
        torch.testing.assert_close(o[0, 1, 0], v[0, 1, 0])


@pytest.mark.parametrize("l2norm_in_kernel", [False, True])
@pytest.mark.parametrize("reference", ["chunk", "recurrent"])
@pytest.mark.parametrize("length", [C - 3, 2 * C + 1])
def test_matches_transformers_qwen3_next(reference, l2norm_in_kernel, length):
    """transformers' references take [B, T, H, D] inputs, `g` = log decay, scale q by K ** -0.5 (our default)
    and compute in float32; with use_qk_l2norm_in_kernel they L2-normalise q and k themselves (their l2norm,
    eps 1e-6), which we then do before our call."""
    inputs = make_inputs(length, with_state=True, dtype=torch.float32)
    if l2norm_in_kernel:  # keys far from unit norm: only the normalisation makes them valid
        inputs["k"] = (inputs["k"].detach() * 3 + 0.1).requires_grad_()
    function = hf_chunk if reference == "chunk" else hf_recurrent

    def reference_attention(q, k, v, beta, log_decay, initial_state, output_final_state):
        return function(q, k, v, g=log_decay, beta=beta, initial_state=initial_state,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=l2norm_in_kernel)

    def ours(q, k, v, beta, log_decay, initial_state, output_final_state):
        if l2norm_in_kernel:
            q, k = qwen3_next.l2norm(q), qwen3_next.l2norm(k)
        return delta_rule_attention(q, k, v, beta, log_decay, initial_state=initial_state,
                                    output_final_state=output_final_state, backend="torch")

    expected = outputs_and_grads(reference_attention, inputs)
    assert_close_in_float64(outputs_and_grads(ours, inputs), expected, 1e-5)  # both float32: measured ≤ 8e-7


def test_ut_solve_matches_autograd_of_a_triangular_solve():
    """The hand-written backward of W = (I + A)⁻¹ R: values and gradients equal those of autograd through
    `torch.linalg.solve_triangular`; A's entries on and above its diagonal are ignored (zero gradient)."""
    gen = torch.Generator().manual_seed(0)
    a = (0.3 * torch.randn(2, 3, 7, 7, generator=gen, dtype=torch.float64)).requires_grad_()
    rhs = torch.randn(2, 3, 7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 3, 7, 5, generator=gen, dtype=torch.float64)
    w = _UnitLowerTriangularSolve.apply(a, rhs)
    eye = torch.eye(7, dtype=torch.float64)
    w_expected = torch.linalg.solve_triangular(eye + a.tril(-1), rhs, upper=False)
    actual = [w, *torch.autograd.grad((w * weight).sum(), [a, rhs])]
    expected = [w_expected, *torch.autograd.grad((w_expected * weight).sum(), [a, rhs])]
    assert_close_in_float64(actual, expected, 1e-12)
    assert not actual[1].triu().any()
    assert torch.autograd.gradcheck(_UnitLowerTriangularSolve.apply, (a, rhs))


def test_chunk_state_loop_gradients():
    """The hand-written backward of the loop over chunks, by finite differences: three sequences of 2, 0 and 1
    chunks (rows R = 2, C = 3, K = 4, V = 2), each from its own initial state."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()

    chunks = [range(0, 2), range(2, 2), range(2, 3)]
    inputs = (leaf(3, 2, 3, 2), leaf(3, 2, 3, 4, scale=0.3), leaf(3, 2, 4, 3, scale=0.3),
              torch.rand(3, 2, 1, 1, generator=gen, dtype=torch.float64).requires_grad_(), leaf(3, 2, 4, 2))
    entering, u, finals = _ChunkStates.apply(*inputs, chunks)
    assert torch.equal(entering[2], inputs[4][2].detach()) and torch.equal(finals[1], inputs[4][1].detach())
    assert torch.autograd.gradcheck(lambda *x: _ChunkStates.apply(*x, chunks), inputs)


def test_defaults_and_optional_state():
    inputs = make_inputs(C + 3, with_state=True)
    o_auto, none = delta_rule_attention(**inputs)
    assert none is None
    o_torch, _ = delta_rule_attention(**inputs, scale=8**-0.5, backend="torch")
    assert torch.equal(o_auto, o_torch)
    no_decay = {**inputs, "log_decay": torch.zeros_like(inputs["log_decay"])}
    o_zero, _ = delta_rule_attention(**no_decay, backend="recurrent")
    o_none, _ = delta_rule_attention(**(inputs | {"log_decay": None}), backend="recurrent")
    torch.testing.assert_close(o_none, o_zero)


def _args(**changes) -> dict:
    gen = torch.Generator().manual_seed(0)
    args = dict(
        q=torch.randn(1, 6, 2, 4, generator=gen),
        k=F.normalize(torch.randn(1, 6, 2, 4, generator=gen), dim=-1),
        v=torch.randn(1, 6, 2, 3, generator=gen),
        beta=torch.rand(1, 6, 2, generator=gen),
        log_decay=-torch.rand(1, 6, 2, generator=gen),
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "kwargs, error, argument",
    [
        (_args(backend="triton-ish"), ValueError, "backend"),
        (_args(q=torch.randn(1, 6, 2)), ValueError, "q must"),
        (_args(q=torch.ones(1, 6, 2, 4, dtype=torch.int64)), ValueError, "q must"),
        (_args(k=torch.randn(1, 6, 2, 5)), ValueError, "k must"),
        (_args(v=torch.randn(1, 5, 2, 3)), ValueError, "v must"),
        (_args(q=torch.randn(1, 0, 2, 4), k=torch.randn(1, 0, 2, 4), v=torch.randn(1, 0, 2, 3),
               beta=torch.rand(1, 0, 2), log_decay=None), ValueError, "T = 0"),
        (_args(q=torch.randn(1, 6, 2, 0), k=torch.randn(1, 6, 2, 0)), ValueError, "q must have B, H, K ≥ 1"),
        (_args(v=torch.randn(1, 6, 2, 0)), ValueError, "v must have V ≥ 1"),
        (_args(scale="0.5"), TypeError, "scale"),
        (_args(scale=True), TypeError, "scale"),
        (_args(scale=float("nan")), ValueError, "scale"),
        (_args(beta=torch.rand(1, 6, 3)), ValueError, "beta"),
        (_args(beta=torch.ones(1, 6, 2, dtype=torch.int64)), ValueError, "beta"),
        (_args(beta=torch.full((1, 6, 2), 1.5)), ValueError, "beta"),
        (_args(beta=torch.full((1, 6, 2), -0.1)), ValueError, "beta"),
        (_args(beta=torch.full((1, 6, 2), float("nan"))), ValueError, "beta"),
        (_args(log_decay=torch.rand(1, 6, 2)), ValueError, "log_decay must be ≤ 0"),
        (_args(log_decay=torch.full((1, 6, 2), float("nan"))), ValueError, "log_decay must not contain nan"),
        (_args(log_decay=-torch.ones(1, 6, 2, dtype=torch.int64)), ValueError, "log_decay must have a floating"),
        (_args(log_decay=-torch.rand(1, 6, 2, 4)), ValueError,
         r"log_decay must be None or a tensor of shape \(1, 6, 2\),"),
        (_args(k=torch.randn(1, 6, 2, 4) * 3), ValueError, "L2-normalised"),
        (_args(initial_state=torch.zeros(1, 2, 3, 4)), ValueError, "initial_state"),
        (_args(initial_state=torch.zeros(1, 2, 4, 3, dtype=torch.int64)), ValueError, "initial_state"),
        (_args(cu_seqlens=torch.tensor([0, 2, 5])), ValueError, "cu_seqlens"),
        (_args(cu_seqlens=torch.tensor([1, 6])), ValueError, "cu_seqlens"),
        (_args(cu_seqlens=torch.tensor([0, 4, 2, 6])), ValueError, "cu_seqlens"),
        (_args(cu_seqlens=torch.tensor([0.0, 6.0])), ValueError, "cu_seqlens"),
        (_args(cu_seqlens=torch.tensor([0, 2, 6]), initial_state=torch.zeros(1, 2, 4, 3)), ValueError,
         "initial_state"),
    ],
)
def test_invalid_arguments_raise(kwargs, error, argument):
    with pytest.raises(error, match=argument):
        delta_rule_attention(**kwargs)


def test_batched_cu_seqlens_raise():
    args = _args()
    args = {n: torch.cat([x, x]) for n, x in args.items()}
    with pytest.raises(ValueError, match="cu_seqlens requires packed inputs with batch size 1"):
        delta_rule_attention(**args, cu_seqlens=torch.tensor([0, 6]))


def test_benchmark_script_runs(tmp_path, benchmark_main):
    # Its main in this process (`benchmark_main`); the timing child still starts. The memory peaks are those of this
    # process's allocator.
    assert benchmark_main("bench_delta_rule.py", "--lengths", "70", "130", "--memory_lengths", "64", "128", "--heads",
                          "1", "--head_dim", "8", "--repeats", "1", "--output_dir", str(tmp_path)) == 0
    rows = json.loads((tmp_path / "delta_rule.json").read_text())["rows"]
    timed = [r for r in rows if r["method"] == "torch" and "fwd_bwd_speedup_vs_recurrent" in r]
    assert [r["T"] for r in timed] == [70, 130]
    assert all(r["fwd_bwd_ms"] > 0 and r["fwd_bwd_peak_mib"] >= 0 for r in rows)
    assert all(r["fwd_bwd_mmap_ms"] > 0 for r in rows if r["part"] == "speed")  # the peak runs' own times


@pytest.mark.parametrize("backend", ["recurrent", "torch"])
@pytest.mark.parametrize("cu_seqlens", [None, [0, 2, 6]])
def test_grouped_values_equal_the_repeated_call(backend, cu_seqlens):
    """v with H_kv heads (H_kv dividing H, repeated inside; q and k stay per query head) gives exactly what the
    repeated v gives."""
    gen = torch.Generator().manual_seed(1)
    states = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    args = _args(q=torch.randn(1, 6, 4, 4, generator=gen),
                 k=F.normalize(torch.randn(1, 6, 4, 4, generator=gen), dim=-1),
                 v=torch.randn(1, 6, 2, 3, generator=gen), beta=torch.rand(1, 6, 4, generator=gen),
                 log_decay=-torch.rand(1, 6, 4, generator=gen),
                 initial_state=torch.randn(states, 4, 4, 3, generator=gen))
    kwargs = dict(output_final_state=True, backend=backend,
                  cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens))
    o, state = delta_rule_attention(**args, **kwargs)
    expected, expected_state = delta_rule_attention(**{**args, "v": args["v"].repeat_interleave(2, dim=2)}, **kwargs)
    assert torch.equal(o, expected) and torch.equal(state, expected_state)
    with pytest.raises(ValueError, match="H_kv dividing H = 4"):
        delta_rule_attention(**{**args, "v": torch.randn(1, 6, 3, 3)}, **kwargs)
