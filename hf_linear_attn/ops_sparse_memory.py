"""The sparse exact memory of the window hybrid (`sparse_cache_size` = m > 0): a few keys that have left the
window stay under softmax, re-chosen at the end of every block by how badly the current linear state recalls
them (LoLA's self-recall error, training-free).

The rule, per batch row and KV head g (W = window_size, R = block_size, MEMORY_BLOCK_SIZE = 64 by default; h runs
over the G query heads of group g; positions are absolute, counted from the first token the cache has seen):

- Absolute blocks of R positions: block b covers positions [bR, (b + 1)R). Let t0 be the start of query t's block.
  A real, non-sink token j leaves the window at step j + W; sinks never leave.
- Query t attends with softmax (scores scale · q_t·k_i, weight γ = sigmoid(window_gate), one max and one
  normaliser shared with the linear part, no decay on the softmax part) to sinks ∪ every real token in
  [t0 − W, t] (the window, extended back to the block start's window: tokens that left the window during the
  current block stay exact until the block ends) ∪ M_b (the memory, ≤ m tokens, fixed during the block). Its
  linear part reads only the linear state at the block start, decayed to t:
      (Π_{i=t0}^{t} a_i ⊙ φ(q_t))ᵀ S(t0),
  S(t0) the state after query t0 − 1, holding every real non-sink key j < t0 − W not in M_b with the decay
  d_{t0−1, j} = Π_{i=j+W+1}^{t0−1} a_i (the decay clock of a key starts when it leaves the window, as in
  `window_attention`), so every key j of the linear part reaches query t with d_tj = Π_{i=j+W+1}^{t} a_i.
- At the end of each block (after query e = t0 + R − 1) the candidates are M_b ∪ the real non-sink tokens that
  left the window during the block (j ∈ [t0 − W, t0 + R − W)). Each candidate's recall error is
      r_j = mean_h ‖v_j − N_h / (D_h + NORM_EPS)‖²,   [N_h, D_h] = φ_h(k_j)ᵀ S_h,
  S = Π_{i=t0}^{e} a_i ⊙ S(t0), the linear state at that moment without any candidate (an empty state reads 0).
  The m candidates with the largest r stay (ties to the earlier position) as M_{b+1}; every other candidate is
  folded into S with the decay it would have had if folded when it left the window, d_ej. Each KV head picks
  its own m.
- Pads contribute nothing and are never kept; pad queries output 0.

So at every query the softmax set and the linear part partition the real keys up to t, and the rule is
deterministic in absolute positions: a full forward, a chunked prefill with any chunk size and token-by-token
decode give the same outputs and the same memory.

A memory slot holds the raw key, not its features: wherever the rule needs φ_h(k_j) of a memory token (its recall
error, its fold), the layer's key feature map recomputes them from the stored key (`key_feature_map`), so a slot
costs 2·D + a few scalars per KV head instead of adding H·F/H_kv features.

`reference_sparse_window_attention` builds each query's sets literally from this rule (the oracle);
`sparse_window_attention` is the fast path for a whole sequence or for a chunk behind a cache's retained tokens
(a loop over blocks: within a block the linear part is one read of S(t0)); `recall_error` and `select_memory`
are the block end both it and the decode step run.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .ops_common import NORM_EPS, accumulation_dtype, divide_at_real_queries, log_decay_floor, window_token_masks

# R: the memory is re-chosen at the end of every block of this many absolute positions.
MEMORY_BLOCK_SIZE = 64

# The layer's key feature map on raw keys: k [B, T, H_kv, D] -> φ [B, T, H, F] (φ_h for every query head h).
KeyFeatureMap = Callable[[Tensor], Tensor]


class SparseMemory(NamedTuple):
    """The m memory slots of every batch row and KV head, in position order, empty slots (mask False) last.

    keys [B, H_kv, m, D], values [B, H_kv, m, V] (the raw keys after RoPE and values; the keys' features are
    recomputed from them when needed, never stored); scores [B, H_kv, m] (r at the last block end, fp32);
    positions [B, H_kv, m] (absolute, long); log_decay None (no decay) or [B, H, m, 1 | F]: log of the decay
    accumulated since the token left the window (fp32); mask [B, H_kv, m] bool.
    """

    keys: Tensor
    values: Tensor
    scores: Tensor
    positions: Tensor
    log_decay: Tensor | None
    mask: Tensor


def recall_error(state: Tensor, key_features: Tensor, values: Tensor) -> Tensor:
    """r of C candidates read against the linear state: mean over the G heads of a group of ‖v − N/(D + NORM_EPS)‖².

    state [B, H, F, V + 1] (the last column the normaliser); key_features [B, H, C, F]; values [B, H_kv, C, V].
    Returns [B, H_kv, C] in the state's dtype.
    """
    batch, kv_heads, count, value_dim = values.shape
    read = key_features.to(state.dtype) @ state  # [B, H, C, V + 1]
    predicted = read[..., :value_dim] / (read[..., value_dim:] + NORM_EPS)
    error = (values.to(state.dtype).repeat_interleave(state.shape[1] // kv_heads, dim=1) - predicted).square()
    return error.sum(-1).view(batch, kv_heads, -1, count).mean(2)


def select_memory(scores: Tensor, positions: Tensor, valid: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The block end's choice: of C candidates (scores, positions, valid [B, H_kv, C]) the `size` valid ones with
    the largest score, ties to the earlier position. Returns keep [B, H_kv, size] (candidate indices, in position
    order, empty slots last), its mask [B, H_kv, size] and fold [B, H_kv, C] (the valid candidates not kept)."""
    last = torch.iinfo(torch.long).max
    order = torch.where(valid, positions, last).argsort(dim=-1, stable=True)  # position order, invalid last
    ranked = torch.where(valid, scores, -torch.inf).gather(-1, order).sort(dim=-1, descending=True, stable=True)
    top = order.gather(-1, ranked.indices[..., :size])
    keep_mask = valid.gather(-1, top)
    keep = top.gather(-1, torch.where(keep_mask, positions.gather(-1, top), last).argsort(dim=-1, stable=True))
    keep_mask = valid.gather(-1, keep)
    fold = valid & ~torch.zeros_like(valid).scatter(-1, keep, keep_mask)
    return keep, keep_mask, fold


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
    block_size: int = MEMORY_BLOCK_SIZE,
    start_position: int = 0,
    key_padding_mask: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The rule, literally: per row, KV head and query the explicit sets, every sum a Python loop. Tiny inputs only.

    q [B, T, H, D]; k [B, T, H_kv, D]; v [B, T, H_kv, V]; q_feat, k_feat [B, T, H, F]; window_gate [H];
    log_decay None, [B, T, H] or [B, T, H, F]; key_padding_mask None or bool [B, T]; input index i is absolute
    position i + start_position; initial_state None or a linear state [B, H, F, V + 1] before the sequence (keys
    that left before it, decayed to index −1; the memory starts empty). Returns o [B, T, H, V] (in v's dtype)
    and the positions (input indices) held in memory after the last block end: [B, H_kv, m] ascending, −1 in
    empty slots.
    """
    batch, length, heads, _ = q.shape
    kv_heads, value_dim = k.shape[2], v.shape[-1]
    groups, window, size = heads // kv_heads, window_size, memory_size
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
    final = torch.full((batch, kv_heads, size), -1, dtype=torch.long)
    for b in range(batch):
        leaves = [j for j in range(length) if real[b, j] and not sink[b, j]]  # the tokens that can leave
        for g in range(kv_heads):
            group = range(g * groups, (g + 1) * groups)
            memory: list[int] = []
            for t in range(length):
                t0 = t - (t + start_position) % block_size  # the block start, as an input index
                folded = [j for j in leaves if j < t0 - window and j not in memory]
                if real[b, t]:
                    softmax_keys = [i for i in range(t + 1) if real[b, i] and (sink[b, i] or i >= t0 - window)]
                    softmax_keys += memory
                    for h in group:
                        scores = torch.stack([scale * q[b, t, h] @ k[b, i, g] for i in softmax_keys])
                        weights = gamma[h] * (scores - scores.max()).exp()
                        values = torch.stack([torch.cat([v[b, i, g], ones]) for i in softmax_keys])
                        total = weights @ values + linear_sum(b, h, t, q_feat[b, t, h], folded)
                        outputs[b, t, h] = total[:value_dim] / total[value_dim]
                if (t + start_position + 1) % block_size == 0:  # the block ends: re-score, keep the best m
                    candidates = memory + [j for j in leaves if t0 - window <= j < t0 + block_size - window]
                    score = {}
                    for j in candidates:
                        errors = []
                        for h in group:
                            read = linear_sum(b, h, t, k_feat[b, j, h], folded)
                            errors.append((v[b, j, g] - read[:value_dim] / (read[value_dim] + NORM_EPS)).square().sum())
                        score[j] = float(torch.stack(errors).mean())
                    memory = sorted(sorted(candidates, key=lambda j: (-score[j], j))[:size])
            final[b, g, : len(memory)] = torch.tensor(memory, dtype=torch.long)
    return outputs.to(out_dtype), final


def empty_memory(
    batch: int, kv_heads: int, heads: int, size: int, key_dim: int, value_dim: int, decay_dim: int | None,
    dtype: torch.dtype, device: torch.device,
) -> SparseMemory:
    """A memory with `size` empty slots per row and KV head (decay_dim None: no decay, else 1 or F)."""
    return SparseMemory(
        keys=torch.zeros(batch, kv_heads, size, key_dim, dtype=dtype, device=device),
        values=torch.zeros(batch, kv_heads, size, value_dim, dtype=dtype, device=device),
        scores=torch.zeros(batch, kv_heads, size, dtype=torch.float32, device=device),
        positions=torch.zeros(batch, kv_heads, size, dtype=torch.long, device=device),
        log_decay=None if decay_dim is None else torch.zeros(batch, heads, size, decay_dim, device=device),
        mask=torch.zeros(batch, kv_heads, size, dtype=torch.bool, device=device),
    )


def take(x: Tensor, index: Tensor) -> Tensor:
    """x [B, N, C, ...] gathered along dim 2 by index [B, N', C'] (N = N' or a multiple: groups of heads)."""
    index = index.repeat_interleave(x.shape[1] // index.shape[1], dim=1)
    return x.gather(2, index.view(*index.shape, *[1] * (x.dim() - 3)).expand(*index.shape, *x.shape[3:]))


def block_end(
    state: Tensor, memory: SparseMemory, keys: Tensor, values: Tensor, key_features: Tensor, positions: Tensor,
    log_decay: Tensor | None, valid: Tensor, key_feature_map: KeyFeatureMap,
) -> tuple[Tensor, SparseMemory]:
    """The end of a block: the candidates are the memory's m slots and C tokens that left the window during the
    block (keys [B, H_kv, C, D], values [B, H_kv, C, V + 1] (a ones column last), key_features [B, H, C, F],
    positions [B, H_kv, C], log_decay None or [B, H, C, 1 | F] since they left, valid [B, H_kv, C]); the memory's
    values carry the ones column too, and its keys' features are `key_feature_map` of its keys (k [B, m, H_kv, D]
    -> φ [B, m, H, F], the map the candidates' features came from). All are scored against `state` [B, H, F,
    V + 1] (the state without them, decayed to the block end); the best m stay, the others are folded into the
    state with their decay. Returns the new state and memory (its values with the ones column, its scores in the
    state's dtype)."""
    cat = torch.cat
    memory_features = key_feature_map(memory.keys.transpose(1, 2)).transpose(1, 2)  # [B, H, m, F]
    features = cat([memory_features.to(state.dtype), key_features.to(state.dtype)], 2)  # [B, H, m + C, F]
    col = SparseMemory(
        keys=cat([memory.keys, keys], 2), values=cat([memory.values, values], 2), scores=None,
        positions=cat([memory.positions, positions], 2),
        log_decay=None if log_decay is None else cat([memory.log_decay, log_decay], 2),
        mask=cat([memory.mask, valid], 2),
    )
    value_dim = values.shape[-1] - 1
    with torch.no_grad():
        scores = recall_error(state, features, col.values[..., :value_dim])  # [B, H_kv, m + C]
    keep, keep_mask, fold = select_memory(scores, col.positions, col.mask, memory.mask.shape[-1])
    groups = state.shape[1] // keys.shape[1]
    weights = features * fold.repeat_interleave(groups, dim=1)[..., None]
    if col.log_decay is not None:
        weights = weights * col.log_decay.to(state.dtype).exp()
    state = state + weights.transpose(-1, -2) @ col.values.to(state.dtype).repeat_interleave(groups, dim=1)
    memory = SparseMemory(
        keys=take(col.keys, keep), values=take(col.values, keep), scores=scores.gather(-1, keep),
        positions=col.positions.gather(-1, keep),
        log_decay=None if col.log_decay is None else take(col.log_decay, keep), mask=keep_mask,
    )
    return state, memory


def sparse_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_feat: Tensor,
    k_feat: Tensor,
    window_gate: Tensor,
    *,
    key_feature_map: KeyFeatureMap,
    window_size: int,
    num_sink_tokens: int,
    memory_size: int,
    scale: float,
    block_size: int = MEMORY_BLOCK_SIZE,
    start_position: int = 0,
    log_decay: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    initial_state: Tensor | None = None,
    memory: SparseMemory | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None, SparseMemory | None]:
    """The window hybrid with a sparse exact memory of `memory_size` tokens per KV head (the module's rule).

    q [B, T_q, H, D] (queries at the last T_q ≤ T inputs); k [B, T, H_kv, D]; v [B, T, H_kv, V]; q_feat
    [B, T_q, H, F]; k_feat [B, T, H, F] = key_feature_map(k) (the map, k [B, ·, H_kv, D] -> φ [B, ·, H, F],
    also gives the memory's features from its keys); window_gate [H]; log_decay None, [B, T, H] or [B, T, H, F];
    key_padding_mask None or bool [B, T]; input index i is absolute position i + start_position. The inputs in
    front of the queries are a cache's retained ones (sinks, then the last W + R positions, their real log
    decays: they decay the folds of the tokens that left during the current block); `initial_state` [B, H, F,
    V + 1] is the linear state decayed to the last of them, and `memory` the memory of the current block (its
    log decay accumulated to the same step). Retained tokens that left the window before the current block are
    already in one of the two and are ignored.

    A loop over the blocks (cut at absolute multiples of R): per block one softmax over sinks, the block's
    extended window and the memory, one read of the state decayed within the block, and at a block end the
    re-scoring (`block_end`). Work O(T · (S + W + R + m)) per head.

    Returns o [B, T_q, H, V] in v's dtype; if output_final_state, the linear state decayed to the last input
    and the memory, else None, None.
    """
    if isinstance(memory_size, bool) or not isinstance(memory_size, int) or memory_size < 1:
        raise ValueError(f"memory_size must be an int ≥ 1, got {memory_size!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int ≥ 1, got {block_size!r}")
    if not callable(key_feature_map):
        raise TypeError(f"key_feature_map must be a callable k [B, T, H_kv, D] -> φ [B, T, H, F], got "
                        f"{type(key_feature_map).__name__}")
    batch, queries, heads, head_dim = q.shape
    length, kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[-1]
    if heads % kv_heads or v.shape[:3] != k.shape[:3] or k_feat.shape[:3] != (batch, length, heads):
        raise ValueError(f"sparse_window_attention takes k, v [B, T, H_kv, ·] with H_kv dividing the H of q and "
                         f"k_feat [B, T, H, F]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"k_feat {tuple(k_feat.shape)}")
    window, first_query, block = window_size, length - queries, block_size
    groups, feature_dim = heads // kv_heads, k_feat.shape[-1]
    dtype = accumulation_dtype(q, k, v, q_feat, k_feat)
    device = q.device
    real, sink = window_token_masks(key_padding_mask, batch, length, num_sink_tokens, device)
    leaves = real & ~sink

    v_ones = with_ones(v.to(dtype))  # [B, T, H_kv, V + 1]
    steps = None  # [B, H, T, 1 | F], raised to the floor: sums of it stay finite
    if log_decay is not None:
        steps = log_decay if log_decay.dim() == 4 else log_decay[..., None]
        steps = steps.to(dtype).clamp(min=log_decay_floor(dtype)).transpose(1, 2)
    if initial_state is None:
        state = torch.zeros(batch, heads, feature_dim, value_dim + 1, dtype=dtype, device=device)
    else:
        state = initial_state.to(dtype)
    if memory is None:
        memory = empty_memory(batch, kv_heads, heads, memory_size, head_dim, value_dim,
                              None if steps is None else steps.shape[-1], k.dtype, device)
    # The memory's keys stay in k's dtype: their features are recomputed from them as k_feat was from k.
    memory = memory._replace(keys=memory.keys.to(k.dtype), values=with_ones(memory.values.to(dtype)))

    num_sinks = min(num_sink_tokens, length)
    sink_pos = torch.argsort(sink.to(torch.int8), dim=-1, descending=True, stable=True)[:, :num_sinks]  # [B, S]
    sink_ok = sink.gather(1, sink_pos)
    k_sink = k.to(dtype).gather(1, sink_pos[:, :, None, None].expand(-1, -1, kv_heads, head_dim))
    v_sink = v_ones.gather(1, sink_pos[:, :, None, None].expand(-1, -1, kv_heads, value_dim + 1))
    gamma = torch.sigmoid(window_gate.to(dtype)).view(kv_heads, groups, 1, 1)

    blocks = []
    start = first_query
    while start < length:
        block_start = start - (start + start_position) % block  # input index of the block start (may be < 0)
        end = min(block_start + block, length)
        rows = end - start
        t = torch.arange(start, end, device=device)[:, None]  # [C, 1]

        # Softmax over sinks, the extended window [block_start − W, t] and the memory, one max.
        first = max(0, block_start - window)
        i = torch.arange(first, end, device=device)
        in_range = leaves[:, None, first:end] & (i <= t)  # [B, C, L]
        sink_allowed = sink_ok[:, None, :] & (sink_pos[:, None, :] <= t)  # [B, C, S]
        allowed = torch.cat([torch.cat([sink_allowed, in_range], dim=-1)[:, None].expand(-1, kv_heads, -1, -1),
                             memory.mask[:, :, None, :].expand(-1, -1, rows, -1)], dim=-1)  # [B, H_kv, C, K]
        keys = torch.cat([k_sink.transpose(1, 2), k[:, first:end].to(dtype).transpose(1, 2),
                          memory.keys.to(dtype)], dim=2)
        values = torch.cat([v_sink.transpose(1, 2), v_ones[:, first:end].transpose(1, 2), memory.values], dim=2)
        query = q[:, start - first_query : end - first_query].to(dtype).view(batch, rows, kv_heads, groups, -1)
        query = query.permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, groups * rows, -1)  # [B, H_kv, G·C, D]
        logits = (query @ keys.transpose(-1, -2)).view(batch, kv_heads, groups, rows, -1)  # [B, H_kv, G, C, K]
        logits = (logits * scale).masked_fill(~allowed[:, :, None], -torch.inf)
        top = logits.amax(-1, keepdim=True)
        top = torch.where(top.isfinite(), top, 0.0)  # a pad query has an empty set: exp(−inf − 0) = 0
        weights = (logits - top).exp().view(batch, kv_heads, groups * rows, -1)
        softmax = gamma * (weights @ values).view(batch, kv_heads, groups, rows, -1)  # [B, H_kv, G, C, V + 1]

        # Linear part: one read of the state, decayed within the block to each query.
        features = q_feat[:, start - first_query : end - first_query].to(dtype).transpose(1, 2)  # [B, H, C, F]
        if steps is not None:
            decayed = steps[:, :, start:end].cumsum(2)  # [B, H, C, 1 | F]: log Π_{i=start}^{t} a_i
            features = features * decayed.exp()
        total = softmax.reshape(batch, heads, rows, -1) + features @ state  # [B, H, C, V + 1]
        if steps is not None:  # the state and the memory's decay clocks move on to end − 1
            state = state * decayed[:, :, -1, :, None].exp()
            memory = memory._replace(log_decay=memory.log_decay + decayed[:, :, -1:])
        blocks.append(divide_at_real_queries(total[..., :value_dim], total[..., value_dim:],
                                             real[:, None, start:end, None]))

        if end == block_start + block:  # the block ends here: tokens [block_start − W, end − W) left during it
            low, high = max(0, block_start - window), max(0, end - window)
            since = None  # log of the decay since leaving, Σ_{i=j+W+1}^{end−1}: suffix sums over the block
            if steps is not None:
                tail = torch.nn.functional.pad(steps[:, :, low + window + 1 : end], (0, 0, 0, 1))
                since = tail.flip(2).cumsum(2).flip(2)[:, :, : high - low]
            positions = torch.arange(low, high, device=device) + start_position
            state, memory = block_end(
                state, memory, k[:, low:high].transpose(1, 2), v_ones[:, low:high].transpose(1, 2),
                k_feat[:, low:high].to(dtype).transpose(1, 2), positions.expand(batch, kv_heads, -1), since,
                leaves[:, None, low:high].expand(-1, kv_heads, -1), key_feature_map,
            )
        start = end
    o = torch.cat(blocks, dim=2).transpose(1, 2).to(v.dtype)  # [B, T_q, H, V]
    if not output_final_state:
        return o, None, None
    final = SparseMemory(
        keys=memory.keys, values=memory.values[..., :value_dim].to(v.dtype), scores=memory.scores.float(),
        positions=memory.positions, log_decay=None if memory.log_decay is None else memory.log_decay.float(),
        mask=memory.mask,
    )
    return o, state, final


def with_ones(values: Tensor) -> Tensor:
    """values [..., V] with a ones column appended: [..., V + 1]."""
    return torch.cat([values, torch.ones_like(values[..., :1])], dim=-1)


__all__ = ["MEMORY_BLOCK_SIZE", "KeyFeatureMap", "SparseMemory", "block_end", "empty_memory", "recall_error",
           "reference_sparse_window_attention", "select_memory", "sparse_window_attention"]
