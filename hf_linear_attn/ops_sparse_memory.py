"""The sparse exact memory of the window hybrid (`sparse_cache_size` = m > 0): a few keys that have left the
window stay under softmax, chosen by how badly the linear state recalls them (LoLA-style, training-free).

The rule, per batch row and KV head g (W = window_size, h runs over the G query heads of group g):

- A real, non-sink token s leaves the window at step s + W (query s + W is the first one it is not in the
  window of).
- Its recall error, fixed when it leaves:
      r_s = mean_h ‖v_s − N_h(s) / (D_h(s) + NORM_EPS)‖²,
      [N_h(s), D_h(s)] = φ_h(k_s)ᵀ A_h(s + W − 1),
  where A_h(t) = Π_{i ≤ t} a_i ⊙ S_0 + Σ_j d_tj ⊙ φ_h(k_j) [v_j, 1]ᵀ over the real non-sink keys j ≤ t − W (those
  that have left by query t; S_0 the initial state) is the *all-folded* linear state, as if no token were ever
  kept, at the last step s is still in the window; d_tj = Π_{i = j + W + 1}^{t} a_i. An empty state reads 0.
- M_e, the memory once the tokens up to e have left: the m real non-sink tokens s ≤ e with the largest r_s,
  ties to the earlier position (so a token pushed out never returns).
- Query t attends with softmax (scores scale · q_t·k_i, weight γ = sigmoid(window_gate), one max c_t over the
  whole softmax set, no decay) to sinks ∪ window_t ∪ M_{t − W}; every other key that has left the window is in
  the linear part with the decay d_tj it has without the memory. So the linear part is the all-folded one minus
  the memory tokens' decayed terms:

      o_t = (γ Σ_{sinks ∪ window_t ∪ M_{t−W}} e^{s_ti − c_t} [v_i, 1]
             + (q_feat_t ⊙ Π_{i≤t} a_i)ᵀ S_0 + Σ_{j ≤ t−W, j ∉ M_{t−W}} (d_tj ⊙ q_feat_t)·φ(k_j) [v_j, 1])  → num / den

  Pads contribute nothing and are never kept; pad queries output 0.

Scoring against the all-folded state rather than the state without the memory tokens (LoLA's choice) makes every
score a read-out of one causal linear attention, computed for all tokens in parallel and independent of which
tokens were kept; the memory then follows from the scores alone.

`reference_sparse_window_attention` builds each query's sets literally from this rule (the oracle);
`sparse_window_attention` is the fast path for a whole sequence or for a chunk behind a cache's retained tokens;
`recall_error` scores one leaving token against a cache's all-folded state (the decode step).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops import linear_attention
from .ops_common import (
    CHUNK_SIZE,
    NORM_EPS,
    accumulation_dtype,
    divide_at_real_queries,
    log_decay_floor,
    window_linear_inputs,
    window_token_masks,
)


class SparseMemory(NamedTuple):
    """The m memory slots of every batch row and KV head (empty slots have mask False).

    keys [B, H_kv, m, D], values [B, H_kv, m, V] (the raw keys after RoPE and values); key_features [B, H, m, F]
    (φ_h(k) for the G query heads of each KV head); scores [B, H_kv, m] (r, fp32); positions [B, H_kv, m] (long;
    only their order matters); log_decay None (no decay) or [B, H, m, 1 | F]: log of the decay accumulated
    since the token left the window (fp32); mask [B, H_kv, m] bool.
    """

    keys: Tensor
    values: Tensor
    key_features: Tensor
    scores: Tensor
    positions: Tensor
    log_decay: Tensor | None
    mask: Tensor


def recall_error(state: Tensor, key_features: Tensor, values: Tensor) -> Tensor:
    """r of tokens read against all-folded states: mean over the G heads of a group of ‖v − N / (D + NORM_EPS)‖².

    state [B, H, F, V + 1] (the last column the normaliser z); key_features [B, H, F]; values [B, H_kv, V].
    Returns [B, H_kv] in the state's dtype.
    """
    batch, kv_heads, value_dim = values.shape
    read = (key_features[:, :, None, :].to(state.dtype) @ state)[:, :, 0]  # [B, H, V + 1]
    predicted = read[..., :value_dim] / (read[..., value_dim:] + NORM_EPS)
    error = (values.to(state.dtype).repeat_interleave(state.shape[1] // kv_heads, dim=1) - predicted).square()
    return error.sum(-1).view(batch, kv_heads, -1).mean(-1)


def reference_sparse_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_feat: Tensor,
    k_feat: Tensor,
    window_gate: Tensor,
    log_decay: Tensor | None = None,
    *,
    window_size: int,
    num_sink_tokens: int,
    memory_size: int,
    scale: float,
    key_padding_mask: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The rule, literally: per row, KV head and query the explicit sets, every sum a Python loop. Tiny inputs only.

    q [B, T, H, D]; k [B, T, H_kv, D]; v [B, T, H_kv, V]; q_feat, k_feat [B, T, H, F]; window_gate [H];
    log_decay None, [B, T, H] or [B, T, H, F]; key_padding_mask None or bool [B, T]; initial_state None or the
    all-folded state [B, H, F, V + 1] before the sequence. Returns o [B, T, H, V] (in v's dtype) and the
    positions held in memory after the last query's evictions, M_{T−1−W}: [B, H_kv, m] ascending, −1 in empty
    slots.
    """
    batch, length, heads, _ = q.shape
    kv_heads, value_dim = k.shape[2], v.shape[-1]
    groups, window = heads // kv_heads, window_size
    dtype, out_dtype = accumulation_dtype(q, k, v, q_feat, k_feat), v.dtype
    q, k, v, q_feat, k_feat = (x.detach().to(dtype) for x in (q, k, v, q_feat, k_feat))
    real, sink = window_token_masks(key_padding_mask, batch, length, num_sink_tokens, q.device)
    steps = torch.zeros(batch, length, heads, 1, dtype=dtype) if log_decay is None else log_decay.detach().to(dtype)
    steps = steps if steps.dim() == 4 else steps[..., None]  # [B, T, H, 1 | F]
    gamma = torch.sigmoid(window_gate.detach().to(dtype))
    ones = torch.ones(1, dtype=dtype)

    def decay(b: int, h: int, t: int, first: int) -> Tensor:
        return steps[b, first : t + 1, h].sum(0).exp()  # Π_{i = first}^{t} a_i, [1 | F] (1 for an empty product)

    def linear_sum(b: int, h: int, t: int, features: Tensor, keys: list[int]) -> Tensor:
        """Σ over `keys` of (d_tj ⊙ features)·φ(k_j) [v_j, 1] plus the initial state's read-out, [V + 1]."""
        total = torch.zeros(value_dim + 1, dtype=dtype)
        for j in keys:
            weight = (decay(b, h, t, j + window + 1) * features * k_feat[b, j, h]).sum()
            total = total + weight * torch.cat([v[b, j, h // groups], ones])
        if initial_state is not None:
            total = total + (decay(b, h, t, 0) * features) @ initial_state[b, h].to(dtype)
        return total

    outputs = torch.zeros(batch, length, heads, value_dim, dtype=dtype)
    final = torch.full((batch, kv_heads, memory_size), -1, dtype=torch.long)
    for b in range(batch):
        candidates = [j for j in range(length) if real[b, j] and not sink[b, j]]
        for g in range(kv_heads):
            group = range(g * groups, (g + 1) * groups)
            score = {}
            for s in candidates:
                if s + window - 1 >= length:
                    continue  # leaves after the sequence: never needed
                t = s + window - 1
                errors = []
                for h in group:
                    read = linear_sum(b, h, t, k_feat[b, s, h], [j for j in candidates if j <= t - window])
                    errors.append((v[b, s, g] - read[:value_dim] / (read[value_dim] + NORM_EPS)).square().sum())
                score[s] = torch.stack(errors).mean()

            ranked = sorted(score, key=lambda j: (-float(score[j]), j))  # best first, ties to the earlier

            def memory(e: int, ranked: list[int] = ranked) -> list[int]:
                return [j for j in ranked if j <= e][:memory_size]  # M_e: the best m of the tokens s ≤ e

            kept = sorted(memory(length - 1 - window))
            final[b, g, : len(kept)] = torch.tensor(kept, dtype=torch.long)
            for t in range(length):
                if not real[b, t]:
                    continue
                kept = memory(t - window)
                window_keys = [i for i in range(t + 1) if real[b, i] and (sink[b, i] or t - i < window)]
                softmax_keys = window_keys + kept
                linear_keys = [j for j in candidates if j <= t - window and j not in kept]
                for h in group:
                    scores = torch.stack([scale * q[b, t, h] @ k[b, i, g] for i in softmax_keys])
                    weights = gamma[h] * (scores - scores.max()).exp()
                    values = torch.stack([torch.cat([v[b, i, g], ones]) for i in softmax_keys])
                    total = weights @ values + linear_sum(b, h, t, q_feat[b, t, h], linear_keys)
                    outputs[b, t, h] = total[:value_dim] / total[value_dim]
    return outputs.to(out_dtype), final


def empty_memory(
    batch: int, kv_heads: int, heads: int, size: int, key_dim: int, value_dim: int, feature_dim: int,
    decay_dim: int | None, dtype: torch.dtype, device: torch.device,
) -> SparseMemory:
    """A memory with `size` empty slots per row and KV head (decay_dim None: no decay, else 1 or F)."""
    return SparseMemory(
        keys=torch.zeros(batch, kv_heads, size, key_dim, dtype=dtype, device=device),
        values=torch.zeros(batch, kv_heads, size, value_dim, dtype=dtype, device=device),
        key_features=torch.zeros(batch, heads, size, feature_dim, dtype=dtype, device=device),
        scores=torch.zeros(batch, kv_heads, size, dtype=torch.float32, device=device),
        positions=torch.zeros(batch, kv_heads, size, dtype=torch.long, device=device),
        log_decay=None if decay_dim is None else torch.zeros(batch, heads, size, decay_dim, device=device),
        mask=torch.zeros(batch, kv_heads, size, dtype=torch.bool, device=device),
    )


def _take(x: Tensor, index: Tensor) -> Tensor:
    """x [B, N, C, ...] gathered along dim 2 by index [B, N', C'] (N = N' or a multiple: groups of heads)."""
    index = index.repeat_interleave(x.shape[1] // index.shape[1], dim=1)
    return x.gather(2, index.view(*index.shape, *[1] * (x.dim() - 3)).expand(*index.shape, *x.shape[3:]))


def sparse_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_feat: Tensor,
    k_feat: Tensor,
    window_gate: Tensor,
    *,
    window_size: int,
    num_sink_tokens: int,
    memory_size: int,
    scale: float,
    log_decay: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    initial_state: Tensor | None = None,
    memory: SparseMemory | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None, SparseMemory | None]:
    """The window hybrid with a sparse exact memory of `memory_size` tokens per KV head (the module's rule).

    q [B, T_q, H, D] (queries at the last T_q ≤ T positions); k [B, T, H_kv, D]; v [B, T, H_kv, V]; q_feat
    [B, T_q, H, F]; k_feat [B, T, H, F]; window_gate [H]; log_decay None, [B, T, H] or [B, T, H, F] (0 at the
    positions in front of the queries); key_padding_mask None or bool [B, T]. The tokens in front of the queries
    are a cache's retained ones (sinks, then the last window_size positions): everything older is in
    initial_state, the all-folded state [B, H, F, V + 1] (the state the hybrid without memory carries), and in
    `memory`, whose positions must lie before every in-front token's index (they may be negative).

    Runs two chunked linear attentions over the delayed keys (`linear_attention`, the given backend): the
    all-folded linear part at the queries, and every score (queries φ(k) delayed by W − 1, normalised, without
    gradient). Then blocks of CHUNK_SIZE queries, in order: the candidates of a block are the m slots of the
    memory it starts with and the C tokens that leave during it; one stable sort by score per block ranks them,
    and a cumulative count of those already left at each query gives the members of M_{t−W}. Each query's
    softmax runs over sinks, its window range and its members (one max); the members' decayed linear terms are
    subtracted from the all-folded linear part. Work O(T · (W + S + m + C)) per head (vector decay: times F).

    Returns o [B, T_q, H, V] in v's dtype; if output_final_state, the all-folded state after the input and the
    memory M_{T−1−W} (positions in this call's index space), else None, None.
    """
    if isinstance(memory_size, bool) or not isinstance(memory_size, int) or memory_size < 1:
        raise ValueError(f"memory_size must be an int ≥ 1, got {memory_size!r}")
    batch, queries, heads, head_dim = q.shape
    length, kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[-1]
    if heads % kv_heads or v.shape[:3] != k.shape[:3] or k_feat.shape[:3] != (batch, length, heads):
        raise ValueError(f"sparse_window_attention takes k, v [B, T, H_kv, ·] with H_kv dividing the H of q and "
                         f"k_feat [B, T, H, F]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"k_feat {tuple(k_feat.shape)}")
    size, window, first_query = memory_size, window_size, length - queries
    groups = heads // kv_heads
    dtype = accumulation_dtype(q, k, v, q_feat, k_feat)
    device = q.device
    real, sink = window_token_masks(key_padding_mask, batch, length, num_sink_tokens, device)

    v_ones = torch.cat([v.to(dtype), torch.ones_like(v[..., :1], dtype=dtype)], dim=-1)  # [B, T, H_kv, V + 1]
    v_wide = v_ones.repeat_interleave(groups, dim=2)  # [B, T, H, V + 1]
    k_older, v_older = window_linear_inputs(k_feat.to(dtype), v_wide, real, sink, window)
    linear, state = linear_attention(
        F.pad(q_feat, (0, 0, 0, 0, first_query, 0)), k_older, v_older, log_decay, scale=1.0,
        initial_state=initial_state, output_final_state=output_final_state, backend=backend,
    )  # the all-folded linear part, [B, T, H, V + 1]

    # r of token s: the normalised read of the all-folded state at index s + W − 1 with φ(k_s).
    scores = torch.full((batch, length, kv_heads), -torch.inf, dtype=dtype, device=device)
    scored = length - window + 1  # tokens s ≤ T − W leave by the next query: their scores are known now
    if scored > 0:
        with torch.no_grad():
            probe = F.pad(k_feat.to(dtype), (0, 0, 0, 0, window - 1, 0))[:, :length]
            read, _ = linear_attention(
                probe, k_older, v_older[..., :value_dim], log_decay, scale=1.0, normalize=True,
                initial_state=initial_state, backend=backend,
            )
            error = (v_wide[:, :scored, :, :value_dim] - read[:, window - 1 :]).square().sum(-1)  # [B, T', H]
            scores[:, :scored] = error.view(batch, scored, kv_heads, groups).mean(-1)
    index = torch.arange(length, device=device)
    candidate = real & ~sink & (index >= first_query - window) & (index < scored)  # [B, T]

    # Prefix sums of the log decay (float64: a difference of two is the decay between them, exact enough at any
    # length); the decay of slot j at query t is exp(prefix_t − offset_j).
    prefix = None
    if log_decay is not None:
        steps = log_decay if log_decay.dim() == 4 else log_decay[..., None]
        prefix = steps.clamp(min=log_decay_floor(dtype)).double().cumsum(1).transpose(1, 2)  # [B, H, T, 1 | F]

    if memory is None:
        memory = empty_memory(batch, kv_heads, heads, size, head_dim, value_dim, k_feat.shape[-1],
                              None if prefix is None else prefix.shape[-1], dtype, device)
    # Slots in position order, empty ones last: ties in the sort below then go to the earlier column.
    order = torch.where(memory.mask, memory.positions, torch.iinfo(torch.long).max).argsort(dim=-1, stable=True)
    slot_keys, slot_values, slot_features = (_take(x.to(dtype), order) for x in memory[:3])
    slot_values = F.pad(slot_values, (0, 1), value=1.0)
    slot_scores, slot_positions, slot_mask = (_take(x, order) for x in (memory.scores, memory.positions,
                                                                         memory.mask))
    slot_scores = slot_scores.to(dtype)
    slot_offsets = None if prefix is None else -_take(memory.log_decay.double(), order)  # [B, H, m, 1 | F]

    num_sinks = min(num_sink_tokens, length)
    sink_pos = torch.argsort(sink.to(torch.int8), dim=-1, descending=True, stable=True)[:, :num_sinks]  # [B, S]
    sink_ok = sink.gather(1, sink_pos)
    k_sink = k.to(dtype).gather(1, sink_pos[:, :, None, None].expand(-1, -1, kv_heads, head_dim))
    v_sink = v_ones.gather(1, sink_pos[:, :, None, None].expand(-1, -1, kv_heads, value_dim + 1))
    gamma = torch.sigmoid(window_gate.to(dtype)).view(kv_heads, groups, 1, 1)
    in_window = real & ~sink

    blocks = []
    for start in range(first_query, length, CHUNK_SIZE):
        end = min(start + CHUNK_SIZE, length)
        rows = end - start
        t = torch.arange(start, end, device=device)[:, None]  # [C, 1]

        # The candidates: the memory slots, then the tokens leaving at these queries (token t − W at query t).
        leaving = (t[:, 0] - window).clamp(min=0)  # [C]
        joins = candidate[:, leaving] & (t[:, 0] >= window)  # [B, C]
        col_scores = torch.cat([slot_scores, scores[:, leaving].transpose(1, 2)], dim=-1)  # [B, H_kv, m + C]
        col_ok = torch.cat([slot_mask, joins[:, None].expand(-1, kv_heads, -1)], dim=-1)
        left = torch.cat([torch.ones(rows, size, dtype=torch.bool, device=device),
                          torch.ones(rows, rows, dtype=torch.bool, device=device).tril()], dim=-1)  # [C, m + C]
        available = col_ok[:, :, None, :] & left  # [B, H_kv, C, m + C]: left by query t
        ranking = torch.where(col_ok, col_scores, -torch.inf).sort(dim=-1, descending=True, stable=True).indices
        ranked = available.gather(-1, ranking[:, :, None, :].expand_as(available))
        member = torch.empty_like(available).scatter_(
            -1, ranking[:, :, None, :].expand_as(available), ranked & (ranked.cumsum(-1) <= size))

        col_keys = torch.cat([slot_keys, k[:, leaving].to(dtype).transpose(1, 2)], dim=2)  # [B, H_kv, m + C, D]
        col_values = torch.cat([slot_values, v_ones[:, leaving].transpose(1, 2)], dim=2)  # [B, H_kv, m + C, V + 1]
        col_features = torch.cat([slot_features, k_feat[:, leaving].to(dtype).transpose(1, 2)], dim=2)
        col_positions = torch.cat([slot_positions, leaving.expand(batch, kv_heads, -1)], dim=-1)

        # Softmax over sinks, the window range and the members, one max.
        first = max(0, start - window + 1)
        i = torch.arange(first, end, device=device)
        in_range = in_window[:, None, first:end] & (i <= t) & (t - i < window)  # [B, C, L]
        sink_allowed = sink_ok[:, None, :] & (sink_pos[:, None, :] <= t)  # [B, C, S]
        allowed = torch.cat([torch.cat([sink_allowed, in_range], dim=-1)[:, None].expand(-1, kv_heads, -1, -1),
                             member], dim=-1)  # [B, H_kv, C, S + L + m + C]
        keys = torch.cat([k_sink.transpose(1, 2), k[:, first:end].to(dtype).transpose(1, 2), col_keys], dim=2)
        values = torch.cat([v_sink.transpose(1, 2), v_ones[:, first:end].transpose(1, 2), col_values], dim=2)
        query = q[:, start - first_query : end - first_query].to(dtype).view(batch, rows, kv_heads, groups, -1)
        query = query.permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, groups * rows, -1)  # [B, H_kv, G·C, D]
        logits = (query @ keys.transpose(-1, -2)).view(batch, kv_heads, groups, rows, -1)  # [B, H_kv, G, C, K]
        logits = (logits * scale).masked_fill(~allowed[:, :, None], -torch.inf)
        top = logits.amax(-1, keepdim=True)
        top = torch.where(top.isfinite(), top, 0.0)  # a pad query has an empty set: exp(−inf − 0) = 0
        weights = (logits - top).exp().view(batch, kv_heads, groups * rows, -1)
        softmax = gamma * (weights @ values).view(batch, kv_heads, groups, rows, -1)  # [B, H_kv, G, C, V + 1]

        # The members' terms in the all-folded linear part, decayed since they left.
        member_wide = member.repeat_interleave(groups, dim=1)  # [B, H, C, m + C]
        features = q_feat[:, start - first_query : end - first_query].to(dtype).transpose(1, 2)  # [B, H, C, F]
        col_offsets = None
        if prefix is None:
            weights = features @ col_features.transpose(-1, -2)  # [B, H, C, m + C]
        else:
            col_offsets = torch.cat([slot_offsets, prefix[:, :, (leaving + window).clamp(max=length - 1)]], dim=2)
            exponent = (prefix[:, :, start:end, None] - col_offsets[:, :, None]).to(dtype)  # [B, H, C, m + C, 1 | F]
            decay = torch.where(member_wide[..., None], exponent, -torch.inf).exp()
            if decay.shape[-1] == 1:
                weights = features @ col_features.transpose(-1, -2) * decay[..., 0]
            else:
                weights = torch.einsum("bhtf,bhcf,bhtcf->bhtc", features, col_features, decay)
        removed = (weights * member_wide) @ col_values.repeat_interleave(groups, dim=1)  # [B, H, C, V + 1]
        total = softmax.reshape(batch, heads, rows, -1) + linear[:, start:end].transpose(1, 2) - removed
        blocks.append(divide_at_real_queries(total[..., :value_dim], total[..., value_dim:],
                                             real[:, None, start:end, None]))

        # The memory after this block's last query: its members, in position order.
        last = member[:, :, -1]  # [B, H_kv, m + C]
        keep = last.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :size]  # [B, H_kv, m]
        slot_mask = last.gather(-1, keep)
        slot_scores, slot_positions = col_scores.gather(-1, keep), col_positions.gather(-1, keep)
        slot_keys, slot_values, slot_features = (_take(x, keep) for x in (col_keys, col_values, col_features))
        if col_offsets is not None:
            slot_offsets = _take(col_offsets, keep)
    o = torch.cat(blocks, dim=2).transpose(1, 2).to(v.dtype)  # [B, T_q, H, V]
    if not output_final_state:
        return o, None, None
    final = SparseMemory(
        keys=slot_keys.to(k.dtype), values=slot_values[..., :value_dim].to(v.dtype),
        key_features=slot_features.to(k_feat.dtype), scores=slot_scores.float(), positions=slot_positions,
        log_decay=None if prefix is None else (prefix[:, :, -1:] - slot_offsets).float(), mask=slot_mask,
    )
    return o, state, final


__all__ = ["SparseMemory", "empty_memory", "recall_error", "reference_sparse_window_attention",
           "sparse_window_attention"]
