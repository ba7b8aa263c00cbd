"""window_attention(update_rule="delta"): the delta rule behind a sliding window, against a literal token loop in
float64 and against the model's delta-window layer (its construction from window_softmax and delta_rule_attention,
bit for bit), with and without a cache's retained keys, packed documents and every backend."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import VARIANTS, left_pad, prompts, tiny_model

from hf_linear_attn import modeling_linear_attention as modeling
from hf_linear_attn.ops import window_attention

B, H, H_KV, D, K, V = 2, 4, 2, 8, 6, 5


def delta_inputs(length: int, queries: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """float64 inputs: q [B, T_q, H, D], k, v with H_kv heads, unit q̂, k̂, β in (0, 1), log decays at the T positions
    (0 in front of the queries, as a cache passes them)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    log_decay = -torch.rand(B, length, H, generator=gen, dtype=torch.float64)
    log_decay[:, : length - queries] = 0.0
    return dict(
        q=randn(B, queries, H, D), k=randn(B, length, H_KV, D), v=randn(B, length, H_KV, V),
        q_feat=F.normalize(randn(B, queries, H, K), dim=-1), k_feat=F.normalize(randn(B, length, H, K), dim=-1),
        window_gate=randn(H), beta=torch.rand(B, length, H, generator=gen, dtype=torch.float64), log_decay=log_decay,
    )


def token_loop(inputs: dict, *, window_size: int, num_sink_tokens: int, mask: torch.Tensor, initial_state,
               state_output) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule, one query at a time: at query position t (the last T_q of T) the state decays by a_t, then the key
    j = t − W enters by the delta rule if it is real and not a sink; the read-out Sᵀ q̂_t / √K; exact softmax over
    the real keys of the window and the sinks; o_t = softmax_t + λ · output(read_t), 0 at a pad query."""
    q, k, v = inputs["q"], inputs["k"].repeat_interleave(2, dim=2), inputs["v"].repeat_interleave(2, dim=2)
    length, queries = k.shape[1], q.shape[1]
    first = length - queries
    soft = torch.zeros(B, queries, H, V, dtype=torch.float64)
    read = torch.zeros(B, queries, H, V, dtype=torch.float64)
    states = []
    for row in range(B):
        rank = mask[row].long().cumsum(0) - 1
        sink = mask[row] & (rank < num_sink_tokens)
        state = initial_state[row].clone()
        for t in range(first, length):
            state = inputs["log_decay"][row, t].exp()[:, None, None] * state
            j = t - window_size
            if j >= 0 and mask[row, j] and not sink[j]:
                key, strength = inputs["k_feat"][row, j], inputs["beta"][row, j][:, None, None]  # [H, K], [H, 1, 1]
                state = state - strength * key[:, :, None] * (key[:, None, :] @ state)
                state = state + strength * key[:, :, None] * v[row, j][:, None, :]
            if not mask[row, t]:
                continue
            i = t - first
            read[row, i] = (inputs["q_feat"][row, i, :, None, :] @ state)[:, 0] * K**-0.5
            seen = [s for s in range(t + 1) if mask[row, s] and (t - s < window_size or sink[s])]
            scores = torch.einsum("hd,shd->hs", q[row, i], k[row, seen]) * D**-0.5
            soft[row, i] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[row, seen])
        states.append(state)
    o = soft + inputs["window_gate"].view(1, 1, H, 1) * state_output(read)
    o = torch.where(mask[:, first:, None, None], o, 0.0)
    return o, torch.stack(states)


def output_map(read: torch.Tensor) -> torch.Tensor:
    """An output map with 0 ↦ 0, as the layer's norm and gate (so pad queries output 0)."""
    return read * torch.linspace(0.5, 2.0, read.shape[-1], dtype=read.dtype)


@pytest.mark.parametrize("backend", ["recurrent", "torch", "auto"])
@pytest.mark.parametrize("length, queries, window_size, num_sink_tokens",
                         [(9, 9, 3, 0), (13, 13, 4, 2), (70, 70, 5, 2), (11, 4, 5, 2), (7, 1, 5, 1), (4, 4, 9, 1)])
@pytest.mark.parametrize("pads", [False, True])
def test_delta_window_is_the_token_loop(length, queries, window_size, num_sink_tokens, pads, backend):
    inputs = delta_inputs(length, queries)
    mask = torch.ones(B, length, dtype=torch.bool)
    if pads:
        mask[1, : length // 3] = False
        mask[0, length // 2] = False
    state = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    o, final = window_attention(**inputs, window_size=window_size, num_sink_tokens=num_sink_tokens,
                                key_padding_mask=mask, initial_state=state, output_final_state=True,
                                update_rule="delta", state_output=output_map, backend=backend)
    expected, expected_state = token_loop(inputs, window_size=window_size, num_sink_tokens=num_sink_tokens, mask=mask,
                                          initial_state=state, state_output=output_map)
    torch.testing.assert_close(o, expected, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(final, expected_state, rtol=1e-9, atol=1e-10)


def test_decays_in_front_of_the_queries_decay_the_initial_state():
    """log_decay covers all T positions, as with the additive rule: those in front of the queries decay the state."""
    inputs = delta_inputs(11, 4)
    inputs["log_decay"][:, :7] = -0.25
    state = torch.randn(B, H, K, V, dtype=torch.float64)
    kwargs = dict(window_size=5, num_sink_tokens=2, output_final_state=True, update_rule="delta")
    o, final = window_attention(**inputs, initial_state=state, **kwargs)
    front = inputs["log_decay"][:, :7].sum(1)  # [B, H]
    inputs["log_decay"][:, :7] = 0.0
    expected, expected_state = window_attention(**inputs, initial_state=state * front.exp()[..., None, None], **kwargs)
    torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, expected_state, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# The model's delta-window layer, bit for bit
# ---------------------------------------------------------------------------------------------------------------


def layer_and_inputs(length: int, seed: int = 0):
    model = tiny_model(**VARIANTS["gated-delta-window-sinks"])
    attn = model.model.layers[1].self_attn
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, length, model.config.hidden_size, generator=gen)
    return model, attn, x


def project(model, attn, x, positions):
    return attn.project(x, model.model.rotary_emb.rotation(x, positions))


def op_call(attn, x, q, k, v, mask, *, retained=None, state=None, cu_seqlens=None):
    """What the layer computes, on the op: q̂, β, log a and k̂ from the layer, everything else in window_attention.
    retained: the cache's retained keys, values, mask and β in front of the new tokens."""
    q_hat, beta, log_decay = attn.delta_rule_inputs(x, q, mask)
    key_mask = mask
    if retained is not None:
        retained_k, retained_v, retained_mask, retained_beta = retained
        real = mask if mask is not None else torch.ones(x.shape[:2], dtype=torch.bool)
        k, v, beta = torch.cat([retained_k, k], 1), torch.cat([retained_v, v], 1), torch.cat([retained_beta, beta], 1)
        key_mask = torch.cat([retained_mask, real], 1)
        if log_decay is not None:
            log_decay = torch.cat([log_decay.new_zeros(x.shape[0], retained_k.shape[1], H), log_decay], 1)
    return window_attention(
        q, k, v, q_hat, attn.delta_keys(k), attn.window_gate, window_size=attn.window_size,
        num_sink_tokens=attn.num_sink_tokens, log_decay=log_decay, key_padding_mask=key_mask, initial_state=state,
        output_final_state=state is not None, cu_seqlens=cu_seqlens, update_rule="delta", beta=beta,
        state_output=lambda read: attn.normed_and_gated(read, x), backend=attn.config.linear_attention_backend)


@pytest.mark.parametrize("pads", [False, True])
def test_delta_window_op_is_the_layers_construction(pads):
    model, attn, x = layer_and_inputs(13)
    mask = None
    if pads:
        mask = torch.ones(B, 13, dtype=torch.bool)
        mask[1, :3] = False
    positions = torch.arange(13).expand(B, -1) if mask is None else (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        q, k, v = project(model, attn, x, positions)
        expected = attn.delta_window_forward(x, q, k, v, mask, None, None)
        o, _ = op_call(attn, x, q, k, v, mask)
    assert torch.equal(o, expected)


@pytest.mark.parametrize("pads", [False, True])
def test_delta_window_op_behind_a_cache_is_the_layers_construction(pads):
    """A chunk behind a cache's retained sinks and window: the same output and final state as the layer's."""
    model = tiny_model(**VARIANTS["gated-delta-window-sinks"])
    ids, mask = left_pad(prompts([9, 6] if pads else [9, 9]))
    with torch.no_grad():
        cache = getattr(model(ids, attention_mask=mask, use_cache=True), modeling.OUTPUT_CACHE_FIELD)
    attn, theirs = model.model.layers[1].self_attn, cache.layers[1]
    ours = copy.deepcopy(theirs)
    x = torch.randn(B, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    new_mask = None
    if pads:
        new_mask = torch.ones(B, 5, dtype=torch.bool)
        new_mask[0, 2] = False
    positions = torch.arange(9, 14).expand(B, -1)
    with torch.no_grad():
        q, k, v = project(model, attn, x, positions)
        expected = attn.delta_window_forward(x, q, k, v, new_mask, theirs, None)
        window = attn.window_size
        retained = (*ours.retained_window(window), ours.retained_beta(window))
        o, state = op_call(attn, x, q, k, v, new_mask, retained=retained, state=ours.state)
    assert torch.equal(o, expected) and torch.equal(state, theirs.state)


def test_packed_delta_window_is_the_layers_per_document_loop():
    model, attn, x = layer_and_inputs(20)
    x = x[:1]
    cu_seqlens = torch.tensor([0, 6, 6, 20])
    positions = torch.cat([torch.arange(6), torch.arange(14)])[None]
    with torch.no_grad():
        q, k, v = project(model, attn, x, positions)
        expected = attn.delta_window_forward(x, q, k, v, None, None, cu_seqlens)
        o, _ = op_call(attn, x, q, k, v, None, cu_seqlens=cu_seqlens)
    assert torch.equal(o, expected)
