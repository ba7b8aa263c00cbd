"""window_attention: chunked against the T x T reference (with and without decay), the reference against the
definition, padding, the softmax limit, the carried state, dtypes, validation; grouped-query keys and values, packed
documents and the sparse memory through the one entry point; window_softmax against its T x T reference."""

import pytest
import torch
import torch.nn.functional as F
from helpers import make_window_inputs, triton_test_device, window_initial_state, with_resets

from hf_linear_attn.ops import window_attention, window_softmax
from hf_linear_attn.ops_common import CHUNK_SIZE
from hf_linear_attn.ops_reference import reference_window_softmax
from hf_linear_attn.ops_sparse_memory import MEMORY_BLOCK_SIZE, sparse_window_attention

C = CHUNK_SIZE


def left_padding(length: int, pads: int) -> torch.Tensor:
    """Mask for a batch of two rows: the first unpadded, the second with `pads` pad tokens in front."""
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :pads] = False
    return mask


def padding(length: int, kind: str | None) -> torch.Tensor | None:
    """None, left padding of a third of the second row, or that plus holes (every 7th position from 5 on, and
    position 1 of the first row)."""
    if kind is None:
        return None
    mask = left_padding(length, length // 3)
    if kind == "holes":
        mask[1, 5::7] = False
        mask[0, 1 % length] = False
    return mask


def run_with_grads(inputs: dict, backend: str, **kwargs) -> list[torch.Tensor]:
    """Output, final state and the gradients of a fixed random weighting of both w.r.t. every input."""
    o, state = window_attention(**inputs, backend=backend, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    loss = loss + (state * torch.randn(state.shape, generator=gen, dtype=state.dtype)).sum()
    return [o, state, *torch.autograd.grad(loss, list(inputs.values()))]


@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("mask", [None, "left", "holes"])
@pytest.mark.parametrize(
    "length, window_size, num_sink_tokens",
    [(1, 1, 0), (7, 1, 3), (7, 3, 0), (C - 1, 1, 0), (C + 1, 37, 3), (2 * C + 2, C, 0), (3 * C + 5, 100, 3),
     (3 * C + 5, 5, 3), (40, 200, 3)],
)
def test_chunked_matches_reference(length, window_size, num_sink_tokens, mask, with_state, decay):
    """Outputs, final states and the gradients w.r.t. every input (log_decay included)."""
    inputs = make_window_inputs(length, decay=decay)
    if with_state:
        inputs["initial_state"] = window_initial_state()
    kwargs = {"window_size": window_size, "num_sink_tokens": num_sink_tokens, "key_padding_mask": padding(length, mask)}
    expected = run_with_grads(inputs, "parallel", **kwargs)
    actual = run_with_grads(inputs, "torch", **kwargs)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
@pytest.mark.parametrize("backend", ["parallel", "torch"])
@pytest.mark.parametrize("num_sink_tokens", [0, 3])
def test_left_padded_row_equals_row_alone(backend, num_sink_tokens, decay):
    """Pads change nothing for real tokens (sinks are the first real tokens; a pad's log decay is 0, as the model
    sets it); pad queries output 0."""
    length, pads = 2 * C + 7, 30
    inputs = {name: x.detach() for name, x in make_window_inputs(length, decay=decay).items()}
    if decay is not None:
        inputs["log_decay"][1, :pads] = 0.0
    kwargs = {"window_size": 20, "num_sink_tokens": num_sink_tokens, "backend": backend}
    o, _ = window_attention(**inputs, key_padding_mask=left_padding(length, pads), **kwargs)
    alone = {name: x if name == "window_gate" else x[1:, pads:] for name, x in inputs.items()}
    torch.testing.assert_close(o[1:, pads:], window_attention(**alone, **kwargs)[0])
    torch.testing.assert_close(o[0], window_attention(**inputs, **kwargs)[0][0])
    assert torch.equal(o[1, :pads], torch.zeros_like(o[1, :pads]))


@pytest.mark.parametrize("backend", ["parallel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_whole_sequence_window_is_softmax_attention(backend, dtype):
    length = 2 * C + 3
    inputs = {name: x.detach() for name, x in make_window_inputs(length, dtype=dtype).items()}
    o, _ = window_attention(**inputs, window_size=length, num_sink_tokens=3, backend=backend)
    q, k, v = (inputs[name].transpose(1, 2) for name in ("q", "k", "v"))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(o, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    inputs = {name: x.detach().to(dtype) for name, x in make_window_inputs(2 * C + 3, dtype=torch.float32).items()}
    kwargs = {"window_size": 50, "num_sink_tokens": 3}
    o, _ = window_attention(**inputs, **kwargs, backend="torch")
    assert o.dtype == dtype
    exact = {name: x.float() for name, x in inputs.items()}
    expected, _ = window_attention(**exact, **kwargs, backend="parallel")
    torch.testing.assert_close(o.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
@pytest.mark.parametrize("backend", ["parallel", "torch"])
@pytest.mark.parametrize("split, window_size, num_sink_tokens", [(50, 8, 2), (5, 8, 2), (C + 3, 1, 0), (70, 30, 0)])
def test_continuing_from_the_carried_state_equals_one_shot(backend, split, window_size, num_sink_tokens, decay):
    """What a decode cache does: keep the sinks and the last window_size tokens raw, fold the rest into the
    state, then run the next tokens behind the kept ones from that state (the kept ones with log decay 0: their
    steps have already decayed the state)."""
    length = 2 * C + 9
    inputs = {name: x.detach() for name, x in make_window_inputs(length, decay=decay).items()}
    kwargs = {"window_size": window_size, "num_sink_tokens": num_sink_tokens, "backend": backend}
    full, full_state = window_attention(**inputs, **kwargs, output_final_state=True)

    first = {name: x if name == "window_gate" else x[:, :split] for name, x in inputs.items()}
    _, state = window_attention(**first, **kwargs, output_final_state=True)
    kept = sorted(set(range(min(num_sink_tokens, split))) | set(range(max(0, split - window_size), split)))
    positions = torch.tensor(kept + list(range(split, length)))
    rest = {name: x if name == "window_gate" else x[:, positions] for name, x in inputs.items()}
    if decay is not None:
        rest["log_decay"][:, : len(kept)] = 0.0
    o, rest_state = window_attention(**rest, **kwargs, initial_state=state, output_final_state=True)
    torch.testing.assert_close(o[:, len(kept):], full[:, split:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(rest_state, full_state, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
@pytest.mark.parametrize("backend", ["auto", "parallel", "torch"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("length, queries, window_size, num_sink_tokens", [(9, 1, 4, 2), (40, 3, 8, 0), (12, 12, 5, 1),
                                                                          (5, 2, 8, 2), (C + 9, C - 2, 20, 2)])
def test_queries_behind_keys_are_the_last_rows_of_the_full_computation(length, queries, window_size,
                                                                       num_sink_tokens, with_state, backend, decay):
    """What a decode step runs: only the last T_q queries against all T keys, with every backend (the chunked
    one computes the rows in front and drops them; log_decay covers all T positions, so that shifts no decay).
    Outputs are the full computation's last rows; the final state and the gradients of everything but the
    skipped queries are the same."""
    inputs = make_window_inputs(length, decay=decay)
    mask = left_padding(length, 2)
    state = window_initial_state() if with_state else None
    kwargs = dict(window_size=window_size, num_sink_tokens=num_sink_tokens, key_padding_mask=mask,
                  initial_state=state, output_final_state=True)
    full_o, full_state = window_attention(**inputs, backend="parallel", **kwargs)
    short = {**inputs, "q": inputs["q"][:, -queries:], "q_feat": inputs["q_feat"][:, -queries:]}
    o, final_state = window_attention(**short, backend=backend, **kwargs)
    torch.testing.assert_close(o, full_o[:, -queries:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final_state, full_state, rtol=1e-10, atol=1e-10)

    gen = torch.Generator().manual_seed(5)
    weights = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(
        final_state.shape, generator=gen, dtype=o.dtype)
    leaves = list(inputs.values()) + ([state] if with_state else [])
    full_loss = (full_o[:, -queries:] * weights[0]).sum() + (full_state * weights[1]).sum()
    loss = (o * weights[0]).sum() + (final_state * weights[1]).sum()
    for got, expected in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(full_loss, leaves), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def brute_force_window(inputs: dict, window_size: int, num_sink_tokens: int, mask: torch.Tensor | None,
                       initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The hybrid's definition, one (query, key) pair and one decay factor at a time: o [B, T, H, V] and the final
    state. W_t: real keys j ≤ t with t − j < w or among the first num_sink_tokens real tokens; L_t: the other
    real keys j ≤ t, weighted by (Π_{i=j+w+1}^{t} a_i ⊙ q_feat_t)·k_feat_j; S_0 decayed by Π_{i≤t} a_i."""
    q, k, v, q_feat, k_feat, gate = (inputs[n].detach() for n in ("q", "k", "v", "q_feat", "k_feat", "window_gate"))
    batch, length, heads, head_dim = q.shape
    value_dim, features = v.shape[-1], q_feat.shape[-1]
    log_decay = inputs["log_decay"].detach()
    a = (log_decay if log_decay.dim() == 4 else log_decay[..., None]).exp().expand(-1, -1, -1, features)
    real = torch.ones(batch, length, dtype=torch.bool) if mask is None else mask
    if initial_state is None:
        initial_state = torch.zeros(batch, heads, features, value_dim + 1, dtype=q.dtype)

    def decay(b: int, h: int, first: int, last: int) -> torch.Tensor:  # Π_{i=first}^{last} a_i
        product = torch.ones(features, dtype=q.dtype)
        for i in range(first, last + 1):
            product = product * a[b, i, h]
        return product

    o = torch.zeros(batch, length, heads, value_dim, dtype=q.dtype)
    state = torch.zeros_like(initial_state)
    for b in range(batch):
        sinks = [j for j in range(length) if real[b, j]][:num_sink_tokens]
        for h in range(heads):
            for t in range(length):
                if not real[b, t]:
                    continue
                window = [j for j in range(t + 1) if real[b, j] and (t - j < window_size or j in sinks)]
                older = [j for j in range(t + 1) if real[b, j] and j not in window]
                scores = torch.stack([q[b, t, h] @ k[b, j, h] * head_dim**-0.5 for j in window])
                weights = torch.sigmoid(gate[h]) * (scores - scores.max()).exp()
                weights = [*weights, *((decay(b, h, j + window_size + 1, t) * q_feat[b, t, h]) @ k_feat[b, j, h]
                                       for j in older)]
                total = sum(w * torch.cat([v[b, j, h], v.new_ones(1)]) for w, j in zip(weights, window + older,
                                                                                        strict=True))
                total = total + (decay(b, h, 0, t) * q_feat[b, t, h]) @ initial_state[b, h]
                o[b, t, h] = total[:value_dim] / total[value_dim]
            folded = [j for j in range(length - window_size) if real[b, j] and j not in sinks]
            state[b, h] = decay(b, h, 0, length - 1)[:, None] * initial_state[b, h] + sum(
                (decay(b, h, j + window_size + 1, length - 1) * k_feat[b, j, h])[:, None]
                * torch.cat([v[b, j, h], v.new_ones(1)])[None] for j in folded
            )
    return o, state


@pytest.mark.parametrize("decay", ["scalar", "vector"])
@pytest.mark.parametrize("length, window_size, num_sink_tokens", [(9, 3, 1), (8, 1, 0), (7, 2, 3)])
def test_reference_is_the_definition(length, window_size, num_sink_tokens, decay):
    """The oracle itself, against a loop over (t, j) of the definition, with a mask hole, a reset and a state."""
    inputs = {name: x.detach() for name, x in make_window_inputs(length, decay=decay).items()}
    inputs["log_decay"][0, 4] = -torch.inf
    mask = left_padding(length, 2)
    mask[0, 3] = False
    state = window_initial_state().detach()
    kwargs = {"window_size": window_size, "num_sink_tokens": num_sink_tokens}
    o, final_state = window_attention(**inputs, **kwargs, key_padding_mask=mask, initial_state=state,
                                      output_final_state=True, backend="parallel")
    expected_o, expected_state = brute_force_window(inputs, window_size, num_sink_tokens, mask, state)
    torch.testing.assert_close(o, expected_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final_state, expected_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", ["scalar", "vector"])
@pytest.mark.parametrize("backend", ["parallel", "torch"])
def test_zero_log_decay_is_no_decay(backend, shape):
    """log_decay = 0 gives the undecayed hybrid: bit for bit in the reference with a per-head decay, to rounding
    otherwise (the decayed code paths sum in another order)."""
    length = 2 * C + 5
    inputs = {name: x.detach() for name, x in make_window_inputs(length, decay=shape).items()}
    inputs["log_decay"] = torch.zeros_like(inputs["log_decay"])
    plain = {name: x for name, x in inputs.items() if name != "log_decay"}
    kwargs = {"window_size": 9, "num_sink_tokens": 2, "key_padding_mask": padding(length, "holes"),
              "initial_state": window_initial_state().detach(), "output_final_state": True, "backend": backend}
    decayed, expected = window_attention(**inputs, **kwargs), window_attention(**plain, **kwargs)
    for got, want in zip(decayed, expected, strict=True):
        if backend == "parallel" and shape == "scalar":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("decay", ["scalar", "vector"])
@pytest.mark.parametrize("queries", [C + 9, 3])
def test_resets_match_reference(decay, queries):
    """−inf (and ≤ −1e30) log decays forget every key outside the window and the initial state; finite results
    and gradients (0 for the reset steps) in both forms."""
    length = C + 9
    inputs = make_window_inputs(length, decay=decay)
    inputs["log_decay"] = with_resets(inputs["log_decay"])
    inputs["initial_state"] = window_initial_state()
    inputs["q"], inputs["q_feat"] = (inputs[n].detach()[:, -queries:].requires_grad_() for n in ("q", "q_feat"))
    kwargs = {"window_size": 4, "num_sink_tokens": 1, "key_padding_mask": padding(length, "holes")}
    expected = run_with_grads(inputs, "parallel", **kwargs)
    actual = run_with_grads(inputs, "torch", **kwargs)
    for a, e in zip(actual, expected, strict=True):
        assert torch.isfinite(e).all()
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10)


def _args(**changes) -> dict:
    """Valid arguments for window_attention (B = 1, T = 6, H = 2) with `changes` applied."""
    args = {name: x.detach() for name, x in make_window_inputs(6, batch=1, dtype=torch.float32).items()}
    return {**args, "window_size": 2, **changes}


def _sized(batch: int = 1, heads: int = 2, head_dim: int = 8, value_dim: int = 5, features: int = 6) -> dict:
    """Consistent window_attention arguments of the given sizes (T = 6), any of which may be 0."""
    dims = {"q": head_dim, "k": head_dim, "v": value_dim, "q_feat": features, "k_feat": features}
    tensors = {name: torch.rand(batch, 6, heads, dim) for name, dim in dims.items()}
    return {**tensors, "window_gate": torch.zeros(heads), "window_size": 2}


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (_args(q=torch.randn(6, 2, 8)), "q"),
        (_args(k=torch.randn(1, 6, 2, 7)), "k"),
        (_args(v=torch.randn(1, 5, 2, 5)), "v"),
        (_args(q_feat=torch.randn(1, 6, 3, 6)), "q_feat"),
        (_args(k_feat=torch.randn(1, 6, 2, 4)), "k_feat"),
        (_args(window_gate=torch.randn(3)), "window_gate"),
        (_args(window_size=0), "window_size"),
        (_args(window_size=2.5), "window_size"),
        (_args(num_sink_tokens=-1), "num_sink_tokens"),
        (_args(key_padding_mask=torch.ones(1, 6)), "key_padding_mask"),
        (_args(key_padding_mask=torch.ones(1, 5, dtype=torch.bool)), "key_padding_mask"),
        (_args(backend="reference"), "backend"),
        (_args(backend=None), "backend"),
        (_args(initial_state=torch.zeros(1, 2, 6, 5)), "initial_state"),
        (_args(q=torch.randn(1, 7, 2, 8), q_feat=torch.rand(1, 7, 2, 6)), "T_q ≤ T"),
        (_sized(batch=0), "k must have B, H_kv, D ≥ 1"),
        (_sized(heads=0), "k must have B, H_kv, D ≥ 1"),
        (_sized(head_dim=0), "k must have B, H_kv, D ≥ 1"),
        (_sized(value_dim=0), "v must have V ≥ 1"),
        (_sized(features=0), "q_feat must have F ≥ 1"),
        (_args(scale=0.0), "scale must be a finite number > 0"),
        (_args(scale=-1.0), "scale must be a finite number > 0"),
        (_args(scale=float("nan")), "scale must be a finite number > 0"),
        (_args(q_feat=torch.rand(1, 2, 2, 6)), "q_feat must have B, T_q, H"),
        (_args(log_decay=torch.zeros(1, 5, 2)), "log_decay must be None or a tensor of shape"),
        (_args(log_decay=torch.zeros(1, 6, 2, 8)), "log_decay must be None or a tensor of shape"),
        (_args(log_decay=torch.zeros(1, 6, 2, dtype=torch.long)), "log_decay must have a floating-point dtype"),
        (_args(log_decay=torch.full((1, 6, 2), 0.5)), "log_decay must be ≤ 0"),
        (_args(log_decay=torch.full((1, 6, 2), float("nan"))), "log_decay must not contain nan"),
        (_args(q=torch.randn(1, 2, 2, 8), q_feat=torch.rand(1, 2, 2, 6), log_decay=torch.zeros(1, 2, 2)),
         "log_decay must be None or a tensor of shape"),
    ],
)
def test_invalid_arguments_raise(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        window_attention(**kwargs)


@pytest.mark.parametrize("scale", ["0.5", True, torch.tensor(0.5)])
def test_non_numeric_scale_raises_type_error(scale):
    with pytest.raises(TypeError, match="scale must be a number"):
        window_attention(**_args(scale=scale))


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "torch", "auto"])
def test_every_config_backend_name_runs_the_window(backend):
    """The window op takes the config's backend names; both oracle names run its one reference form."""
    inputs = {name: x.detach() for name, x in make_window_inputs(C + 3).items()}
    kwargs = {"window_size": 9, "num_sink_tokens": 2, "key_padding_mask": left_padding(C + 3, 4)}
    o, _ = window_attention(**inputs, **kwargs, backend=backend)
    expected, _ = window_attention(**inputs, **kwargs, backend="parallel")
    torch.testing.assert_close(o, expected, rtol=1e-10, atol=1e-10)
    if backend == "recurrent":
        assert torch.equal(o, expected)


# ---------------------------------------------------------------------------------------------------------------
# Grouped-query keys and values, packed documents, the sparse memory: one entry point
# ---------------------------------------------------------------------------------------------------------------


def grouped_inputs(length: int, decay: str | None = "scalar", seed: int = 0) -> dict[str, torch.Tensor]:
    """window_attention inputs with H = 4 query heads and k, v of H_kv = 2 KV heads."""
    inputs = {name: x.detach() for name, x in make_window_inputs(length, heads=4, decay=decay, seed=seed).items()}
    inputs["k"], inputs["v"] = inputs["k"][:, :, :2].contiguous(), inputs["v"][:, :, :2].contiguous()
    return inputs


def repeated(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**inputs, "k": inputs["k"].repeat_interleave(2, dim=2), "v": inputs["v"].repeat_interleave(2, dim=2)}


@pytest.mark.parametrize("backend", ["parallel", "torch"])
@pytest.mark.parametrize("queries", [C + 9, 3])
def test_grouped_keys_and_values_equal_the_repeated_call(backend, queries):
    """k, v with H_kv heads give exactly what the same heads repeated per query head give (output and state)."""
    inputs = grouped_inputs(C + 9)
    inputs["q"], inputs["q_feat"] = inputs["q"][:, -queries:], inputs["q_feat"][:, -queries:]
    kwargs = dict(window_size=5, num_sink_tokens=2, key_padding_mask=left_padding(C + 9, 4),
                  initial_state=torch.rand(2, 4, 6, 6, dtype=torch.float64), output_final_state=True, backend=backend)
    o, state = window_attention(**inputs, **kwargs)
    expected, expected_state = window_attention(**repeated(inputs), **kwargs)
    assert torch.equal(o, expected) and torch.equal(state, expected_state)


def test_grouped_heads_must_divide_the_query_heads():
    inputs = grouped_inputs(6)
    inputs["k"], inputs["v"] = (torch.randn(2, 6, 3, dim, dtype=torch.float64) for dim in (8, 5))
    with pytest.raises(ValueError, match="H a multiple of its H_kv"):
        window_attention(**inputs, window_size=2)


def packed(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Row 0 of every per-token input (a batch of one)."""
    return {name: x if name == "window_gate" else x[:1] for name, x in inputs.items()}


def per_document(run, inputs: dict[str, torch.Tensor], bounds: list[int]) -> torch.Tensor:
    """run(inputs of one document) over the documents, outputs concatenated."""
    outputs = []
    for i, j in zip(bounds[:-1], bounds[1:], strict=True):
        if j > i:
            outputs.append(run({name: x if name == "window_gate" else x[:, i:j] for name, x in inputs.items()}))
    return torch.cat(outputs, dim=1)


BOUNDS = [0, 5, 5, C + 3, C + 20]  # an empty document, one across a chunk boundary


@pytest.mark.parametrize("backend", ["parallel", "torch", "auto"])
@pytest.mark.parametrize("decay", [None, "vector"])
def test_packed_documents_equal_one_call_per_document(backend, decay):
    inputs = packed(grouped_inputs(C + 20, decay=decay))
    kwargs = dict(window_size=6, num_sink_tokens=2, backend=backend)
    o, state = window_attention(**inputs, cu_seqlens=torch.tensor(BOUNDS), **kwargs)
    expected = per_document(lambda doc: window_attention(**doc, **kwargs)[0], inputs, BOUNDS)
    assert state is None and torch.equal(o, expected)


def test_packed_documents_with_the_sparse_memory_equal_one_call_per_document():
    inputs = packed(grouped_inputs(C + 20))
    feature_map = sparse_feature_map(inputs)
    kwargs = dict(window_size=6, num_sink_tokens=2, memory_size=3, key_feature_map=feature_map)
    o, state, memory = window_attention(**inputs, cu_seqlens=torch.tensor(BOUNDS), **kwargs)
    expected = per_document(lambda doc: window_attention(**doc, **kwargs)[0], inputs, BOUNDS)
    assert state is None and memory is None and torch.equal(o, expected)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(initial_state=torch.zeros(1, 4, 6, 6, dtype=torch.float64)), "no initial_state"),
        (dict(output_final_state=True), "fill no cache"),
        (dict(cu_seqlens=torch.tensor([0, 3, 6]), batch=2), "batch size 1"),
        (dict(queries=2), "T_q == T"),
    ],
)
def test_packed_documents_refuse_what_a_cache_would_give(changes, message):
    inputs = grouped_inputs(6)
    inputs = inputs if changes.pop("batch", 1) == 2 else packed(inputs)
    queries = changes.pop("queries", 6)
    inputs["q"], inputs["q_feat"] = inputs["q"][:, -queries:], inputs["q_feat"][:, -queries:]
    kwargs = {"cu_seqlens": torch.tensor([0, 3, 6]), **changes}
    with pytest.raises(ValueError, match=message):
        window_attention(**inputs, window_size=2, **kwargs)


def sparse_feature_map(inputs: dict[str, torch.Tensor]):
    """A key feature map k [B, T, H_kv, D] -> [B, T, H, F]: a fixed positive projection per query head."""
    weight = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    return lambda k: torch.einsum("bthd,hdf->bthf", k.repeat_interleave(2, dim=2), weight).sigmoid()


@pytest.mark.parametrize("queries", [2 * MEMORY_BLOCK_SIZE + 7, 9])
def test_sparse_memory_runs_through_window_attention(queries):
    """memory_size > 0 runs sparse_window_attention with the same arguments: the same output, state and memory."""
    inputs = grouped_inputs(2 * MEMORY_BLOCK_SIZE + 7)
    feature_map = sparse_feature_map(inputs)
    inputs["k_feat"] = feature_map(inputs["k"])
    inputs["q"], inputs["q_feat"] = inputs["q"][:, -queries:], inputs["q_feat"][:, -queries:]
    kwargs = dict(window_size=5, num_sink_tokens=2, key_padding_mask=left_padding(2 * MEMORY_BLOCK_SIZE + 7, 3),
                  initial_state=torch.rand(2, 4, 6, 6, dtype=torch.float64), output_final_state=True,
                  start_position=11)
    o, state, memory = window_attention(**inputs, memory_size=3, key_feature_map=feature_map, **kwargs)
    expected, expected_state, expected_memory = sparse_window_attention(
        **inputs, memory_size=3, key_feature_map=feature_map, scale=8**-0.5, **kwargs)
    assert torch.equal(o, expected) and torch.equal(state, expected_state)
    for got, want in zip(memory, expected_memory, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(memory_size=2), "key_feature_map must be a callable"),
        (dict(memory_size=-1), "memory_size must be an int ≥ 0"),
        (dict(start_position=3), "only with memory_size > 0"),
        (dict(update_rule="delta", beta=torch.rand(2, 6, 4), memory_size=2, key_feature_map=abs),
         "sparse memory .* runs with update_rule='additive' only"),
        (dict(update_rule="delta"), "beta must be a floating-point tensor of shape"),
        (dict(update_rule="delta", beta=torch.rand(2, 6, 4), backend="parallel"), "backends of delta_rule_attention"),
        (dict(update_rule="multiplicative"), "update_rule must be"),
        (dict(beta=torch.rand(2, 6, 4)), "belong to update_rule='delta'"),
        (dict(update_rule="delta", beta=torch.rand(2, 6, 4), log_decay=torch.zeros(2, 6, 4, 6)), "log_decay must be"),
        (dict(update_rule="delta", beta=torch.rand(2, 6, 4), initial_state=torch.zeros(2, 4, 6, 6)), "initial_state"),
    ],
)
def test_invalid_state_rule_arguments_raise(changes, message):
    inputs = grouped_inputs(6, decay=None)
    error = TypeError if "callable" in message else ValueError
    with pytest.raises(error, match=message):
        window_attention(**inputs, window_size=2, **changes)


# ---------------------------------------------------------------------------------------------------------------
# window_softmax
# ---------------------------------------------------------------------------------------------------------------


def softmax_inputs(length: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, length, 4, 8, generator=gen)
    k, v = torch.randn(2, length, 2, 8, generator=gen), torch.randn(2, length, 2, 5, generator=gen)
    return {name: x.to(dtype).requires_grad_() for name, x in (("q", q), ("k", k), ("v", v))}


def softmax_with_grads(attention, inputs: dict[str, torch.Tensor], **kwargs) -> list[torch.Tensor]:
    o = attention(**inputs, **kwargs)
    weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(o.dtype)
    return [o, *torch.autograd.grad((o * weights).sum(), list(inputs.values()))]


@pytest.mark.parametrize("backend", ["torch", "parallel", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [None, "left", "right", "holes"])
@pytest.mark.parametrize("length, window_size, num_sink_tokens, queries",
                         [(7, 3, 0, 7), (13, 4, 2, 13), (C + 3, 9, 3, C + 3), (C + 3, 9, 3, 5), (5, 9, 1, 1)])
def test_window_softmax_is_its_reference(length, window_size, num_sink_tokens, queries, mask, dtype, backend):
    """Forward and backward, odd lengths, sinks, pads (pad queries output 0), fp32 and bf16, queries behind keys."""
    inputs = softmax_inputs(length, dtype)
    padding_mask = None
    if mask is not None:
        padding_mask = torch.ones(2, length, dtype=torch.bool)
        if mask == "left":
            padding_mask[1, : length // 3] = False
        elif mask == "right":
            padding_mask[1, length - length // 3 :] = False
        else:
            padding_mask[1, 1::4] = False
    with torch.no_grad():
        inputs["q"] = inputs["q"][:, -queries:].detach().requires_grad_()
    kwargs = dict(window_size=window_size, num_sink_tokens=num_sink_tokens, key_padding_mask=padding_mask)
    actual = softmax_with_grads(window_softmax, inputs, backend=backend, **kwargs)

    def reference(q, k, v, **options):
        return reference_window_softmax(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2), scale=8**-0.5,
                                        **options)

    expected = softmax_with_grads(reference, inputs, **kwargs)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a.float(), e.float(), rtol=tolerance, atol=tolerance)
    if padding_mask is not None:
        assert (actual[0][~padding_mask[:, -queries:]] == 0).all()


def test_packed_window_softmax_equals_one_call_per_document():
    inputs = {name: x.detach()[:1] for name, x in softmax_inputs(C + 20, torch.float32).items()}
    o = window_softmax(**inputs, window_size=6, num_sink_tokens=1, cu_seqlens=torch.tensor(BOUNDS))
    expected = per_document(lambda doc: window_softmax(**doc, window_size=6, num_sink_tokens=1), inputs, BOUNDS)
    assert torch.equal(o, expected)


def test_window_softmax_on_the_triton_kernels_is_its_reference():
    """The fast path on the window kernels (the interpreter without a GPU), queries behind keys, sinks, padding."""
    device = triton_test_device()
    inputs = {name: x.detach().to(device) for name, x in softmax_inputs(C + 5, torch.float32).items()}
    inputs["q"] = inputs["q"][:, -9:]
    mask = torch.ones(2, C + 5, dtype=torch.bool, device=device)
    mask[1, :7] = False
    kwargs = dict(window_size=6, num_sink_tokens=2, key_padding_mask=mask)
    o = window_softmax(**inputs, backend="triton", **kwargs)
    k, v = (inputs[name].repeat_interleave(2, dim=2) for name in ("k", "v"))
    expected = reference_window_softmax(inputs["q"], k, v, scale=8**-0.5, **kwargs)
    torch.testing.assert_close(o, expected, rtol=1e-5, atol=1e-5)
