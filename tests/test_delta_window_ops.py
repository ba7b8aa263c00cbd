"""window_attention(update_rule="delta"): the delta rule behind a sliding window, against a literal token loop in
float64, with and without a cache's retained keys, packed documents and every backend. (The model's delta-window layer
calls it: tests/test_previous_revision.py holds the layer against the revision that built it in the model.)"""


import pytest
import torch
import torch.nn.functional as F

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


def test_packed_documents_equal_one_call_per_document():
    """cu_seqlens (a batch of one, an empty document included): each document as if alone, the window and the state
    restarting at every boundary."""
    inputs = {name: x[:1] for name, x in delta_inputs(20, 20).items() if name != "window_gate"}
    inputs["window_gate"] = delta_inputs(20, 20)["window_gate"]
    kwargs = dict(window_size=4, num_sink_tokens=1, update_rule="delta", state_output=output_map)
    o, _ = window_attention(**inputs, cu_seqlens=torch.tensor([0, 6, 6, 20]), **kwargs)
    per_document = [window_attention(**{name: x if name == "window_gate" else x[:, i:j]
                                        for name, x in inputs.items()}, **kwargs)[0]
                    for i, j in ((0, 6), (6, 20))]
    torch.testing.assert_close(o, torch.cat(per_document, dim=1), rtol=1e-12, atol=1e-12)
