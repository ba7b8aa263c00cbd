"""Triton backend: every kernel against the recurrent / reference oracles, outputs, final states and gradients.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), which is
100-400x slower than torch: shapes are tiny. On a GPU the same tests run on CUDA tensors, where float32 dots use
TF32 (hence the looser float32 tolerance there). The oracles run in float64 on the very values the kernels see
(inputs rounded to the tested dtype first), so the tolerances measure the kernels' own arithmetic.
"""

import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    ROOT,
    assert_all_close,
    assert_runs_without_triton,
    make_inputs,
    make_window_inputs,
    run_python,
    triton_modules,
    triton_test_device,
    window_initial_state,
    with_resets,
)

from hf_linear_attn import ops, ops_common, ops_delta_rule, ops_triton_common, ops_triton_linear, ops_triton_window
from hf_linear_attn.ops import linear_attention, window_attention
from hf_linear_attn.ops_common import CHUNK_SIZE
from hf_linear_attn.ops_delta_rule import delta_rule_attention

DEVICE = triton_test_device()

C = CHUNK_SIZE
DECAYS = [None, "fixed", "scalar", "vector"]
# Largest error relative to the oracle's largest magnitude. Measured under the interpreter: float32 1.4e-6,
# float16 4.7e-4, bfloat16 6e-3; a GPU adds TF32 (float32, float16) and bf16 rounding of dot operands.
TOLERANCE = {
    torch.float32: 1e-2 if DEVICE == "cuda" else 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}


def outputs_and_grads(attention, inputs: dict, **kwargs) -> list[torch.Tensor]:
    """Output, final state and the gradients of a fixed random weighting of both w.r.t. every input tensor."""
    o, state = attention(**inputs, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(123)
    loss = sum((x.double() * torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)).sum()
               for x in (o, state))
    return [o, state, *torch.autograd.grad(loss, [x for x in inputs.values() if x is not None and x.requires_grad])]


def compare_with_oracle(attention, inputs: dict, oracle: str, dtype: torch.dtype, low: tuple[str, ...], *,
                        tol: float | None = None, frozen: tuple[str, ...] = (), **kwargs):
    """Run `attention` with backend "triton" on DEVICE, with the tensors named in `low` in `dtype` and the others
    in float32, against `oracle` in float64 on CPU on the same (rounded) values; check dtypes and closeness (to
    `tol`, by default TOLERANCE[dtype]). The tensors named in `frozen` need no gradient. Tensors in kwargs (masks,
    cu_seqlens) are given on CPU."""
    rounded = {
        name: None if x is None else x.detach().to(dtype if name in low else torch.float32)
        for name, x in inputs.items()
    }
    exact = {name: None if x is None else x.double().requires_grad_(name not in frozen) for name, x in rounded.items()}
    expected = outputs_and_grads(attention, exact, backend=oracle, **kwargs)
    tested = {name: None if x is None else x.to(DEVICE).requires_grad_(name not in frozen)
              for name, x in rounded.items()}
    on_device = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}
    actual = outputs_and_grads(attention, tested, backend="triton", **on_device)

    o, state, *grads = actual
    assert o.dtype == dtype and state.dtype == torch.float32
    assert [g.dtype for g in grads] == [x.dtype for x in tested.values() if x is not None and x.requires_grad]
    assert_all_close([x.detach().double().cpu() for x in actual], expected, TOLERANCE[dtype] if tol is None else tol)


# ---------------------------------------------------------------------------------------------------------------
# linear_attention
# ---------------------------------------------------------------------------------------------------------------

LINEAR_LOW = ("q", "k", "v")  # the tensors given in the tested dtype; log_decay and the state stay float32


@pytest.mark.parametrize("length, key_dim, value_dim", [(1, 5, 3), (C + 7, 20, 7)])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", DECAYS)
def test_linear_matches_recurrent(decay, normalize, length, key_dim, value_dim):
    inputs = make_inputs(decay, normalize, length, key_dim, value_dim, with_state=True)
    compare_with_oracle(linear_attention, inputs, "recurrent", torch.float32, LINEAR_LOW, normalize=normalize)


@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
def test_linear_head_dims_beyond_one_block(decay):
    """K, V > 64: several K and V blocks per kernel, and partial last blocks; three chunks, the last partial."""
    inputs = make_inputs(decay, False, 2 * C + 3, 70, 67, batch=1, heads=1, with_state=True)
    compare_with_oracle(linear_attention, inputs, "recurrent", torch.float32, LINEAR_LOW)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_linear_half_precision(decay, dtype, normalize):
    inputs = make_inputs(decay, normalize, C + 7, 20, 7, with_state=True)
    compare_with_oracle(linear_attention, inputs, "recurrent", dtype, LINEAR_LOW, normalize=normalize)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
def test_linear_packed_sequences(decay, normalize):
    """cu_seqlens: each sequence from its own initial state, a zero-length one included (it keeps its state)."""
    lengths = [5, 0, C + 6, 1, C]
    inputs = make_inputs(decay, normalize, sum(lengths), 16, 8, batch=1)
    state = make_inputs(decay, normalize, 1, 16, 8, batch=len(lengths), with_state=True, seed=2)["initial_state"]
    inputs["initial_state"] = state
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    compare_with_oracle(
        linear_attention, inputs, "recurrent", torch.float32, LINEAR_LOW, normalize=normalize, cu_seqlens=cu_seqlens
    )


@pytest.fixture
def launches(monkeypatch):
    """Records every launch of a Triton kernel: (kernel name, {argument name: value}), then runs it."""
    seen = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                function = self.kernel
                while hasattr(function, "fn"):  # unwrap @triton.autotune and @triton.jit
                    function = function.fn
                names = list(inspect.signature(function).parameters)
                seen.append((self.name, {**dict(zip(names, args, strict=False)), **kwargs}))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for module in triton_modules():
        for name in dir(module):
            if name.endswith("_kernel"):
                monkeypatch.setattr(module, name, Spy(name, getattr(module, name)))
    return seen


@pytest.mark.parametrize("decay_needs_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_decay_gradient_in_the_kernels_only_when_needed(launches, decay, dtype, decay_needs_grad):
    """The decay gradient comes from the dq / dk kernels (no torch pass), and is not computed for a decay that needs
    none (fixed, or not requiring grad); dq and dk are stored by the kernels in the inputs' dtype."""
    inputs = make_inputs(decay, False, 2 * C + 5, 20, 7, with_state=True)
    frozen = () if decay_needs_grad else ("log_decay",)
    compare_with_oracle(linear_attention, inputs, "recurrent", dtype, LINEAR_LOW, frozen=frozen)
    grad_kernels = [kwargs for name, kwargs in launches if name in ("_chunk_dqk_kernel", "_vector_grads_kernel")]
    assert grad_kernels and all(kwargs["DECAY_GRAD"] == decay_needs_grad for kwargs in grad_kernels)
    final = grad_kernels[-1]  # the kernel that stores dq and dk
    assert final["dq"].dtype == dtype and final["dk"].dtype == dtype
    if decay_needs_grad:
        d_log_decay = final["d_log_decay"]
        assert d_log_decay.dtype == torch.float32 and d_log_decay.numel() == inputs["log_decay"].numel()
    # no reverse cumulative sum of a decay gradient outside the kernels above
    assert not any(name == "_chunk_cumsum_kernel" and kwargs["REVERSE"] for name, kwargs in launches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_gpu_launch_keeps_an_autotune_config(monkeypatch, dtype):
    """With the GPU's configs (not the interpreter's single one) each pruner leaves the autotuner a config at every
    head dim 1-256 (an H200 run found the dq / dk pruner leaving none for 16-bit inputs at V ≤ 32), and only the
    warps that ran there: 8 where a head dim reaches 64, 4 below (8 faulted at K = 20, V = 7)."""
    for module in (ops_triton_common, ops_triton_linear):
        monkeypatch.setattr(module, "INTERPRET", False)
    general, dqk = ops_triton_common.autotune_configs(), ops_triton_linear._dqk_configs()
    assert {config.kwargs["BLOCK_V"] for config in dqk} == set(ops_triton_linear.DQK_VALUE_WIDTHS)
    q = torch.empty(1, dtype=dtype)
    for dim in range(1, 257):
        warps = 8 if dim >= 64 else 4
        for name in ("K", "D", "V"):
            kept = ops_triton_common.usable_configs(general, {}, **{name: dim})
            assert kept and {config.num_warps for config in kept} == {warps}, (name, dim)
        for key_dim, value_dim in ((dim, dim), (dim, 8), (8, dim)):
            kept = ops_triton_linear._dqk_value_blocks(dqk, {"q": q}, K=key_dim, V=value_dim)
            assert len(kept) == 1 and kept[0].num_warps == warps, (key_dim, value_dim)


@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
def test_bfloat16_inputs_store_bfloat16_chunk_states(launches, decay):
    """bfloat16 inputs: the forward pass stores its chunk-boundary states in bfloat16 (the final state in float32),
    within the bfloat16 tolerance over several chunks carried from an initial state."""
    inputs = make_inputs(decay, False, 4 * C + 3, 32, 16, batch=1, with_state=True)
    compare_with_oracle(linear_attention, inputs, "recurrent", torch.bfloat16, LINEAR_LOW)
    passes = [kwargs for name, kwargs in launches if name == "_state_pass_kernel"]
    forward, reverse = [p for p in passes if not p["REVERSE"]], [p for p in passes if p["REVERSE"]]
    assert forward and all(p["states"].dtype == torch.bfloat16 and p["last"].dtype == torch.float32 for p in forward)
    assert reverse and all(p["states"].dtype == torch.float32 for p in reverse)


@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
def test_normalizer_is_carried_beside_the_values(launches, decay):
    """normalize=True keeps V: every kernel with a V runs at the values' width, the normaliser's state is a V = 1
    state pass (forward and reverse), its output and its gradients come from the output and dq/dk kernels (NORM);
    outputs, final state (normaliser last) and gradients match the oracle."""
    value_dim = 8
    inputs = make_inputs(decay, True, 2 * C + 5, 16, value_dim, with_state=True)
    compare_with_oracle(linear_attention, inputs, "recurrent", torch.float32, LINEAR_LOW, normalize=True)
    widths = {(name, kwargs["V"]) for name, kwargs in launches if "V" in kwargs}
    assert widths == {("_state_pass_kernel", value_dim), ("_state_pass_kernel", 1), ("_chunk_output_kernel", value_dim),
                      ("_chunk_dqk_kernel", value_dim)}
    norm_passes = {kwargs["REVERSE"] for name, kwargs in launches if name == "_state_pass_kernel" and kwargs["V"] == 1}
    assert norm_passes == {0, 1}
    assert [kwargs["NORM"] for name, kwargs in launches if name == "_chunk_output_kernel"] == [True, False]  # o, dv
    assert [kwargs["NORM"] for name, kwargs in launches if name == "_chunk_dqk_kernel"] == [True]


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_backward_reuses_the_forward_decay_sums_and_scores(launches, decay):
    """log_decay (resets included) reaches the kernels raw: the forward cumulative sum raises it to the floor, and
    backward reuses that sum and, for a per-key-dim decay, the scores, with no torch op on log_decay in between."""
    inputs = make_inputs(decay, False, 2 * C + 5, 16, 8, with_state=True)
    inputs["log_decay"] = with_resets(inputs["log_decay"])
    compare_with_oracle(linear_attention, inputs, "recurrent", torch.float32, LINEAR_LOW,
                        tol=max(1e-4, TOLERANCE[torch.float32]))
    names = [name for name, _ in launches]
    sums = [kwargs for name, kwargs in launches if name == "_chunk_cumsum_kernel"]
    assert len(sums) == 1 and sums[0]["CLAMP"] and sums[0]["terms"].isneginf().any()
    assert names.count("_vector_scores_kernel") == (decay == "vector")


@pytest.mark.parametrize("used", ["output", "final_state"])
@pytest.mark.parametrize("decay", [None, "vector"])
def test_gradient_of_one_output_only(decay, used):
    """A loss on the output alone, or on the final state alone: the unused one's gradient stays None in backward
    (no zeros materialised), and the gradients match the oracle's."""
    inputs = make_inputs(decay, False, C + 9, 16, 8, with_state=True)
    results = {}
    for backend in ("recurrent", "triton"):
        tensors = {name: None if x is None else x.detach().float().to("cpu" if backend == "recurrent" else DEVICE)
                   .requires_grad_() for name, x in inputs.items()}
        o, state = linear_attention(**tensors, output_final_state=True, backend=backend)
        loss = (o.square().sum() if used == "output" else state.square().sum())
        leaves = [x for x in tensors.values() if x is not None]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)  # q: none from the final state
        results[backend] = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]
    assert_all_close([g.double().cpu() for g in results["triton"]], [g.double() for g in results["recurrent"]],
                     max(1e-4, TOLERANCE[torch.float32]))


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_packed_calls_read_no_values_on_the_host(monkeypatch):
    """After a first call has built the chunk tables of a cu_seqlens tensor, forward and backward read no tensor
    value on the host (on a GPU each read is a sync): every such read from hf_linear_attn raises; results are
    unchanged. Modifying cu_seqlens in place rebuilds the tables."""
    lengths = [5, C + 6, 0, 3]
    inputs = make_inputs("vector", True, sum(lengths), 16, 8, batch=1, dtype=torch.float32)
    inputs = {name: x.detach().to(DEVICE).requires_grad_() for name, x in inputs.items() if x is not None}
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)  # a CPU copy, also for CUDA inputs
    monkeypatch.setattr(ops_common, "checks_values", lambda x: False)  # as on a GPU: no value checks
    kwargs = dict(normalize=True, cu_seqlens=cu_seqlens, backend="triton")
    first = outputs_and_grads(linear_attention, inputs, **kwargs)

    def forbidden(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = inspect.currentframe().f_back.f_globals.get("__name__", "")
            if caller.startswith("hf_linear_attn"):
                raise AssertionError(f"Tensor.{name} called from {caller}: a host sync")
            return original(self, *args, **kwargs)
        return read

    with monkeypatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, forbidden(name))
        second = outputs_and_grads(linear_attention, inputs, **kwargs)
    assert_all_close([x.detach().double().cpu() for x in second], [x.detach().double().cpu() for x in first], 0.0)

    cu_seqlens[1:] = torch.tensor([C + 6, C + 6, C + 11, sum(lengths)])  # other bounds, same tensor
    moved = ops_triton_common.packed_chunks(cu_seqlens, DEVICE)
    assert moved.seq_info[:, :2].tolist() == [[0, C + 6], [C + 6, C + 6], [C + 6, C + 11], [C + 11, sum(lengths)]]


@pytest.mark.parametrize("log_decay_value, tol", [(-30.0, 5e-4), (-1e4, 1e-1)])
@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_strong_decay_stays_finite(decay, log_decay_value, tol):
    """Decays far past exp underflow: no inf / nan anywhere; error as the torch path's (prefix sums in float32), and
    on a GPU within the TF32 dots' float32 tolerance (an H200 measured more than 5e-4 there)."""
    inputs = make_inputs(decay, False, 2 * C + 5, 16, 8, batch=1, with_state=True)
    log_decay = inputs["log_decay"].detach()
    strong = torch.rand(log_decay.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    inputs["log_decay"] = torch.where(strong, log_decay_value, log_decay).requires_grad_()
    tested = {name: x.detach().float().to(DEVICE).requires_grad_() for name, x in inputs.items()}
    expected = outputs_and_grads(linear_attention, inputs, backend="recurrent")
    actual = outputs_and_grads(linear_attention, tested, backend="triton")
    assert_all_close([x.detach().double().cpu() for x in actual], expected, max(tol, TOLERANCE[torch.float32]))


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_reset_decays_match_the_token_loop(decay, normalize):
    """log_decay = −inf (a full reset) and ≤ −1e30: what the token loop gives, no inf / nan anywhere (the kernels
    take decays as differences of prefix sums: float32 error as the torch path's, see test_ops)."""
    inputs = make_inputs(decay, normalize, C + 7, 16, 8, batch=1, with_state=True)
    inputs["log_decay"] = with_resets(inputs["log_decay"])
    compare_with_oracle(linear_attention, inputs, "recurrent", torch.float32, LINEAR_LOW, normalize=normalize,
                        tol=max(1e-4, TOLERANCE[torch.float32]))


def test_non_contiguous_inputs_and_final_state_on_request():
    inputs = make_inputs("vector", True, 9, 5, 3, dtype=torch.float32)
    inputs = {name: x.detach().to(DEVICE) for name, x in inputs.items() if x is not None}
    o, state = linear_attention(**inputs, normalize=True, backend="triton")
    assert state is None
    # [B, H, T, D] tensors seen as [B, T, H, D]: strided views
    strided = {name: x.transpose(1, 2).contiguous().transpose(1, 2) for name, x in inputs.items()}
    assert not strided["q"].is_contiguous()
    torch.testing.assert_close(linear_attention(**strided, normalize=True, backend="triton")[0], o)


def test_auto_picks_triton_for_cuda_tensors_it_takes():
    """What triton takes decides "auto" on a GPU: float64 goes to torch, as do window head dims over 256."""
    def problem(dtype, head_dim=64):
        tensor = torch.empty(1, dtype=dtype, device=DEVICE)
        return ops_triton_common.unsupported_inputs({"q": tensor}, window_head_dims=(head_dim, head_dim))

    def pick(found):
        return ops.pick_backend("auto", torch.device("cuda", 0), single_query=False, triton_problem=lambda: found)

    assert pick(problem(torch.float32)) == "triton" and pick(problem(torch.bfloat16)) == "triton"
    assert pick(problem(torch.float64)) == "torch"
    assert pick(problem(torch.float32, head_dim=512)) == "torch"


@pytest.mark.parametrize("head_dims, picked", [((20, 7), "torch"), ((63, 63), "torch"), ((20, 64), "triton"),
                                               ((128, 128), "triton"), ((), "triton")])
def test_auto_leaves_small_head_dims_to_torch(head_dims, picked):
    """"auto" takes Triton on a GPU only where some head dim reaches AUTO_TRITON_MIN_HEAD_DIM (the first GPU run's
    kernel faults were all below it); an explicit backend="triton" still runs the kernels there."""
    def pick(backend):
        return ops.pick_backend(backend, torch.device("cuda", 0), single_query=False, triton_problem=lambda: None,
                                head_dims=head_dims)

    assert ops_common.AUTO_TRITON_MIN_HEAD_DIM == 64
    assert pick("auto") == picked and pick("triton") == "triton"


def test_chunked_ops_tell_auto_their_head_dims(monkeypatch):
    """Each chunked op gives pick_backend the dims its kernels tile: K and V; the window's D, V and feature size."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("head_dims"))
        return "torch"

    monkeypatch.setattr(ops, "pick_backend", spy)
    monkeypatch.setattr(ops_delta_rule, "pick_backend", spy)
    q, v = torch.randn(1, 5, 2, 20), torch.randn(1, 5, 2, 7)
    linear_attention(q, q, v)
    feat = torch.randn(1, 5, 2, 12)
    window_attention(q, q, v, feat, feat, torch.zeros(2), window_size=2)
    delta_rule_attention(F.normalize(q, dim=-1), F.normalize(q, dim=-1), v, torch.rand(1, 5, 2))
    assert seen == [(20, 7), (20, 7, 12), (20, 7)]


# ---------------------------------------------------------------------------------------------------------------
# window_attention
# ---------------------------------------------------------------------------------------------------------------

WINDOW_LOW = ("q", "k", "v", "q_feat", "k_feat", "window_gate")


def padding_mask(length: int, side: str | None) -> torch.Tensor | None:
    """Two rows, the second with a third of its tokens padded on `side` ("left" or "right"); None: no mask."""
    if side is None:
        return None
    mask = torch.ones(2, length, dtype=torch.bool)
    pads = length // 3
    if side == "left":
        mask[1, :pads] = False
    else:
        mask[1, length - pads :] = False
    return mask


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize(
    "length, window_size, num_sink_tokens, with_state",
    [(1, 1, 0, False), (7, 1, 3, True), (C + 1, 37, 3, False), (2 * C + 2, C, 0, True), (2 * C + 5, 5, 3, True),
     (40, 200, 3, False)],
)
def test_window_matches_reference(length, window_size, num_sink_tokens, with_state, padding):
    inputs = make_window_inputs(length)
    if with_state:
        inputs["initial_state"] = window_initial_state()
    compare_with_oracle(
        window_attention, inputs, "parallel", torch.float32, WINDOW_LOW, window_size=window_size,
        num_sink_tokens=num_sink_tokens, key_padding_mask=padding_mask(length, padding),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_half_precision(dtype):
    inputs = make_window_inputs(2 * C + 3)
    inputs["initial_state"] = window_initial_state()
    compare_with_oracle(window_attention, inputs, "parallel", dtype, WINDOW_LOW, window_size=50, num_sink_tokens=3)


@pytest.mark.parametrize("queries", [1, 5])
def test_window_queries_behind_keys(queries):
    """A decode step behind a cache's retained keys: fewer queries than keys, the rows in front dropped."""
    length = 23
    inputs = make_window_inputs(length)
    inputs["initial_state"] = window_initial_state()
    inputs["q"], inputs["q_feat"] = (inputs[name].detach()[:, -queries:].requires_grad_() for name in ("q", "q_feat"))
    compare_with_oracle(
        window_attention, inputs, "parallel", torch.float32, WINDOW_LOW, window_size=6, num_sink_tokens=2,
        key_padding_mask=padding_mask(length, "left"),
    )


@pytest.mark.parametrize("decay", ["scalar", "vector"])
@pytest.mark.parametrize(
    "length, window_size, num_sink_tokens, padding, queries",
    [(7, 1, 3, "left", 7), (2 * C + 5, 5, 3, "right", 2 * C + 5), (C + 9, 20, 0, None, C + 9),
     (23, 6, 2, "left", 5), (23, 6, 2, None, 1)],
)
def test_window_decay_matches_reference(length, window_size, num_sink_tokens, padding, queries, decay):
    """The decayed linear part (log_decay in float32 like the state), with a carried state, odd T and fewer
    queries than keys: outputs, final states and every gradient, log_decay's included."""
    inputs = make_window_inputs(length, decay=decay)
    inputs["initial_state"] = window_initial_state()
    inputs["q"], inputs["q_feat"] = (inputs[n].detach()[:, -queries:].requires_grad_() for n in ("q", "q_feat"))
    compare_with_oracle(
        window_attention, inputs, "parallel", torch.float32, WINDOW_LOW, window_size=window_size,
        num_sink_tokens=num_sink_tokens, key_padding_mask=padding_mask(length, padding),
    )


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_window_decay_resets(decay):
    """−inf and ≤ −1e30 log decays: the reset forgets the folded keys and the state, finite everywhere (float32
    error of decays taken as differences of prefix sums, as in test_reset_decays_match_the_token_loop)."""
    inputs = make_window_inputs(C + 9, decay=decay)
    inputs["log_decay"] = with_resets(inputs["log_decay"])
    inputs["initial_state"] = window_initial_state()
    compare_with_oracle(window_attention, inputs, "parallel", torch.float32, WINDOW_LOW, window_size=4,
                        num_sink_tokens=1, tol=max(1e-4, TOLERANCE[torch.float32]))


class SinkSliceLaunches:
    """Wraps `_window_sink_dkdv_kernel`, recording each launch's number of query slices (grid axis 0)."""

    def __init__(self, kernel):
        self.kernel, self.slices = kernel, []

    def __getitem__(self, grid):
        self.slices.append(grid[0])
        return self.kernel[grid]


@pytest.fixture
def sink_slices(monkeypatch):
    """Slices of as many query blocks as a dk/dv program visits (no minimum), so short rows have several; the
    recorder of the sink kernel's launches."""
    monkeypatch.setattr(ops_triton_window, "SINK_SLICE_MIN_BLOCKS", 1)
    launches = SinkSliceLaunches(ops_triton_window._window_sink_dkdv_kernel)
    monkeypatch.setattr(ops_triton_window, "_window_sink_dkdv_kernel", launches)
    return launches


@pytest.mark.parametrize(
    "length, window_size, num_sink_tokens, padding, dtype",
    [(301, 5, 3, None, torch.float32), (301, 5, 3, "left", torch.float32), (300, 40, 2, "right", torch.float32),
     (233, 1, 70, "left", torch.float32), (301, 50, 4, (120, 150), torch.float32), (301, 5, 3, None, torch.bfloat16),
     (250, 7, 4, "left", torch.float16)],
)
def test_window_sink_gradients_in_query_slices(sink_slices, length, window_size, num_sink_tokens, padding, dtype):
    """The sinks' dk/dv from the queries past a key block's window reach, summed over several query slices of
    `_window_sink_dkdv_kernel`: every gradient against the oracle, with pads on either side (rows starting past a
    key block boundary, rows ending before the last slice; padding (lo, hi): the second row's real tokens, fewer
    than the window), odd T, more sinks than a key block (70 > 64), and each dtype."""
    if isinstance(padding, tuple):
        mask = torch.ones(2, length, dtype=torch.bool)
        mask[1, : padding[0]] = mask[1, padding[1] :] = False
    else:
        mask = padding_mask(length, padding)
    compare_with_oracle(
        window_attention, make_window_inputs(length), "parallel", dtype, WINDOW_LOW, window_size=window_size,
        num_sink_tokens=num_sink_tokens, key_padding_mask=mask,
    )
    assert len(sink_slices.slices) == 1 and sink_slices.slices[0] >= 2


@pytest.mark.parametrize("length, num_sink_tokens", [(301, 0), (60, 3)])
def test_window_sink_kernel_launched_only_when_needed(sink_slices, length, num_sink_tokens):
    """No sinks, or every query within the first key block's window reach: no sink kernel, gradients still exact."""
    compare_with_oracle(
        window_attention, make_window_inputs(length), "parallel", torch.float32, WINDOW_LOW, window_size=5,
        num_sink_tokens=num_sink_tokens, key_padding_mask=padding_mask(length, "left"),
    )
    assert sink_slices.slices == []


def test_window_backward_is_deterministic(sink_slices):
    """Two backward passes through the sliced sink gradients give the same bits."""
    length = 301
    inputs = {name: x.detach().float().to(DEVICE).requires_grad_() for name, x in make_window_inputs(length).items()}
    kwargs = dict(window_size=5, num_sink_tokens=3, key_padding_mask=padding_mask(length, "left"), backend="triton")
    runs = [outputs_and_grads(window_attention, inputs, **kwargs) for _ in range(2)]
    assert sink_slices.slices == [sink_slices.slices[0]] * 2 and sink_slices.slices[0] >= 2
    assert all(torch.equal(first, second) for first, second in zip(*runs, strict=True))


def test_whole_sequence_window_is_softmax_attention():
    length = C + 3
    inputs = {name: x.detach().float().to(DEVICE) for name, x in make_window_inputs(length).items()}
    o, _ = window_attention(**inputs, window_size=length, num_sink_tokens=3, backend="triton")
    q, k, v = (inputs[name].transpose(1, 2) for name in ("q", "k", "v"))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(o, expected, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------------------------
# Wrong inputs: a clear error before any kernel runs
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if any kernel is launched."""

    class Forbidden:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched before the inputs were rejected")

    for module in triton_modules():
        for name in dir(module):
            if name.endswith("_kernel"):
                monkeypatch.setattr(module, name, Forbidden())


def linear_args(**changes) -> dict:
    """Valid linear_attention arguments for the triton backend (B = 1, T = 6, H = 2, K = 4, V = 3)."""
    args = {
        "q": torch.randn(1, 6, 2, 4, device=DEVICE),
        "k": torch.randn(1, 6, 2, 4, device=DEVICE),
        "v": torch.randn(1, 6, 2, 3, device=DEVICE),
        "log_decay": -torch.rand(1, 6, 2, device=DEVICE),
        "backend": "triton",
    }
    return {**args, **changes}


def window_args(**changes) -> dict:
    """Valid window_attention arguments for the triton backend (B = 2, T = 6, H = 2)."""
    args = {name: x.detach().float().to(DEVICE) for name, x in make_window_inputs(6).items()}
    return {**args, "window_size": 2, "backend": "triton", **changes}


@pytest.mark.parametrize(
    "attention, kwargs, match",
    [
        (linear_attention, linear_args(q=torch.randn(1, 6, 2, 4, dtype=torch.float64, device=DEVICE)), "float64"),
        (linear_attention, linear_args(initial_state=torch.zeros(1, 2, 4, 3, device="meta")), "one device"),
        (linear_attention, linear_args(k=torch.randn(1, 6, 2, 5, device=DEVICE)), "k must have the shape"),
        (linear_attention, linear_args(log_decay=torch.full((1, 6, 2), 0.1, device=DEVICE)), "log_decay must be ≤ 0"),
        (linear_attention, linear_args(cu_seqlens=torch.tensor([0, 5])), "end at T"),
        (linear_attention, linear_args(**{name: torch.randn(2, 3, 2, 4, device=DEVICE) for name in "qk"},
                                       v=torch.randn(2, 3, 2, 3, device=DEVICE), log_decay=None,
                                       cu_seqlens=torch.tensor([0, 1, 3])), "batch size 1"),
        (window_attention, window_args(v=torch.randn(2, 6, 2, 300, device=DEVICE)), "up to 256"),
        (window_attention, window_args(key_padding_mask=torch.tensor([[1, 0, 1, 1, 1, 1]] * 2, dtype=torch.bool,
                                                                     device=DEVICE)), "key_padding_mask.*contiguous"),
        (linear_attention, linear_args(log_decay=torch.tensor([[[-0.1, float("nan")]] * 6], device=DEVICE)), "nan"),
        (window_attention, window_args(window_gate=torch.zeros(2, dtype=torch.float64, device=DEVICE)), "float64"),
        (window_attention, window_args(log_decay=torch.zeros(2, 6, 2, dtype=torch.float64, device=DEVICE)),
         "log_decay in torch.float64"),
        (window_attention, window_args(log_decay=torch.full((2, 6, 2), 0.1, device=DEVICE)), "log_decay must be ≤ 0"),
    ],
)
def test_invalid_inputs_raise_before_any_launch(no_launch, monkeypatch, attention, kwargs, match):
    monkeypatch.setenv(ops_common.CHECK_VALUES_ENV, "1")  # on a GPU, the checks that read values run only when asked
    with pytest.raises(ValueError, match=match):
        attention(**kwargs)


@pytest.mark.parametrize("attention, kwargs", [(linear_attention, linear_args()), (window_attention, window_args())])
def test_cpu_tensors_without_the_interpreter_raise(no_launch, monkeypatch, attention, kwargs):
    monkeypatch.setattr(ops_triton_common, "INTERPRET", False)
    cpu = {name: x.cpu() if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}
    with pytest.raises(ValueError, match="CUDA tensors"):
        attention(**cpu)


def test_module_imports_without_triton():
    """Remote code must load where triton is missing: every Triton module imports, there is no triton backend, and
    'auto' stays on torch."""
    modules = [module.__name__ for module in triton_modules()]
    code = f"""
        import importlib
        import torch
        from hf_linear_attn import ops, ops_triton_common
        for name in {modules!r}:
            importlib.import_module(name)
        assert not ops_triton_common.HAS_TRITON
        problem = ops_triton_common.unsupported_inputs({{"q": torch.empty(1, device="meta")}})
        assert "needs the triton package" in problem
        picked = ops.pick_backend("auto", torch.device("cuda"), single_query=False, triton_problem=lambda: problem)
        assert picked == "torch"
        q = torch.randn(1, 5, 2, 4)
        ops.linear_attention(q, q, q)
        """
    assert_runs_without_triton(code, 'ops.linear_attention(q, q, q, backend="triton")')


def test_kernels_compile_for_a_hopper_gpu():
    """What runs in the interpreter must also compile for a GPU: every kernel, built for sm_90 without one. --cover:
    each kernel's every constexpr value, block size and argument type once (about 2/3 of the builds, ~25 s fewer
    here); `python -m benchmarks.gpu_compile_check` builds every specialization."""
    result = run_python("-m", "benchmarks.gpu_compile_check", "--cover", timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "0 failed" in result.stdout
    compiled = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")}
    # Every kernel defined in a Triton module, read from the sources: a kernel or module the compile check misses
    # is found here.
    sources = sorted((ROOT / "hf_linear_attn").glob("ops_triton_*.py"))
    kernels = {name for path in sources for name in re.findall(r"^def (\w+_kernel)\(", path.read_text(), re.M)}
    assert len(sources) >= 5 and kernels, (sources, kernels)
    assert kernels <= compiled, kernels - compiled
