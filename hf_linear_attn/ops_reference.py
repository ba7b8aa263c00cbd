"""Slow, obviously-correct forms of the attention math: the oracles every fast path is tested against.

Linear attention, per batch row and head, with the decay a_t = exp(log_decay_t) scaling the K rows of the
state S (K x V):

    S_t = a_t ⊙ S_{t-1} + k_t v_tᵀ        o_t = (scale · q_t)ᵀ S_t
    z_t = a_t ⊙ z_{t-1} + k_t             o_t = (scale · q_t)ᵀ S_t / ((scale · q_t)ᵀ z_t + NORM_EPS)

(the second line only with normalize=True). `recurrent_linear_attention` runs this loop token by token;
`parallel_linear_attention` evaluates the same sums as one masked T x T product.
`reference_window_attention` is the LoLCATs sliding-window softmax + linear hybrid (its linear part
optionally decayed) built from the full T x T score matrix.

Backends receive inputs already validated by `ops.linear_attention` / `ops.window_attention`: `scale` is a
number and `log_decay` is None or [B, T, H, 1 | K]. They compute in float32 (float64 for float64 inputs),
whatever the input dtype, and return outputs in the dtype of `v`.

State layout: [B, H, K, V] in the accumulation dtype; with normalize=True [B, H, K, V + 1], whose last
column is z (z is the state of an extra all-ones value column).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops_common import (
    NORM_EPS,
    accumulation_dtype,
    divide_at_real_queries,
    normalized,
    splits_packed_sequences,
    window_token_masks,
)


@splits_packed_sequences
def recurrent_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None,
    *,
    scale: float,
    normalize: bool = False,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The recurrence, literally: one token at a time, with S and z kept apart.

    q, k: [B, T, H, K]; v: [B, T, H, V]; log_decay: None or [B, T, H, 1 | K] (≤ 0).
    initial_state: None or [B, H, K, V (+ 1)] (see the module docstring); with cu_seqlens ([N + 1], B == 1)
    every sequence starts from its own initial_state[n] and the states are [N, H, K, V (+ 1)].
    Returns o [B, T, H, V] in v's dtype and the final state (None unless output_final_state).
    """
    batch, length, heads, key_dim = q.shape
    value_dim, out_dtype = v.shape[-1], v.dtype
    dtype = accumulation_dtype(q, k, v)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    q = q * scale
    if log_decay is None:
        decay = q.new_ones(batch, length, heads, 1)
    else:
        decay = log_decay.to(dtype).exp()  # [B, T, H, 1 | K]
    if initial_state is None:
        initial_state = q.new_zeros(batch, heads, key_dim, value_dim + int(normalize))
    state = initial_state.to(dtype)
    S = state[..., :value_dim]  # [B, H, K, V]
    z = state[..., value_dim] if normalize else None  # [B, H, K]

    outputs = []
    for t in range(length):
        q_t, k_t, v_t, a_t = q[:, t], k[:, t], v[:, t], decay[:, t]  # [B, H, ·]
        S = a_t[..., None] * S + k_t[..., None] * v_t[..., None, :]
        o_t = (q_t[..., None] * S).sum(-2)  # [B, H, V]
        if normalize:
            z = a_t * z + k_t
            o_t = o_t / ((q_t * z).sum(-1, keepdim=True) + NORM_EPS)
        outputs.append(o_t)
    o = torch.stack(outputs, dim=1).to(out_dtype)  # [B, T, H, V]
    final_state = torch.cat([S, z[..., None]], dim=-1) if normalize else S
    return o, final_state if output_final_state else None


@splits_packed_sequences
def parallel_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None,
    *,
    scale: float,
    normalize: bool = False,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The same sums in closed form: a masked T x T attention matrix with an explicit [T, T, K] decay.

    With G_ti = Σ_{i<s≤t} log_decay_s (the log decay from key i to query t) and B_t = Σ_{s≤t} log_decay_s:
        o_t = Σ_{i≤t} (q_t ⊙ exp(G_ti))ᵀ k_i v_iᵀ + (q_t ⊙ exp(B_t))ᵀ S_0
        S_T = exp(B_T) ⊙ S_0 + Σ_i exp(G_Ti) ⊙ k_i v_iᵀ
    G is summed directly, never taken as B_t − B_i: a log decay of −inf (a full reset) would make that
    difference −inf − (−inf) = nan. Normalisation appends an all-ones column to v and divides by its output.
    Arguments, shapes and returns are those of `recurrent_linear_attention`. Memory O(T² K): tiny inputs only.
    """
    batch, length, heads, key_dim = q.shape
    value_dim, out_dtype = v.shape[-1], v.dtype
    dtype = accumulation_dtype(q, k, v)
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    q = q * scale
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    if log_decay is None:
        log_decay = q.new_zeros(batch, length, heads, 1)
    steps = log_decay.to(dtype).transpose(1, 2)  # [B, H, T, 1 | K]
    b = steps.cumsum(dim=2)  # B_t

    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()  # [t, i]: i ≤ t
    # up_to[t, s] = log_decay_s for s ≤ t (else 0); G_ti is the sum of row t over s > i: a suffix sum along s,
    # shifted by one. −inf entries only ever meet finite ones (all values are ≤ 0), so no nan.
    up_to = torch.where(causal[..., None], steps[:, :, None], 0.0)  # [B, H, T, T, 1 | K]
    suffix = up_to.flip(3).cumsum(3).flip(3)
    gap = torch.cat([suffix[:, :, :, 1:], torch.zeros_like(suffix[:, :, :, :1])], dim=3)  # G_ti
    # exp(G_ti) only where i ≤ t; masking the exponent, not the result, keeps exp and its gradient finite
    gap = torch.where(causal[..., None], gap, -torch.inf)
    scores = torch.einsum("bhtk,bhik,bhtik->bhti", q, k, gap.exp().expand(-1, -1, -1, -1, key_dim))
    o = scores @ v
    state = (k * gap[:, :, -1].exp()).transpose(-1, -2) @ v  # [B, H, K, V (+ 1)]
    if initial_state is not None:
        initial_state = initial_state.to(dtype)
        o = o + (q * b.exp()) @ initial_state
        state = state + b[:, :, -1:].transpose(-1, -2).exp() * initial_state
    if normalize:
        o = normalized(o, value_dim)
    return o.transpose(1, 2).to(out_dtype), state if output_final_state else None


def _window_decay_exponents(
    log_decay: Tensor, first_query: int, window_size: int, in_linear: Tensor
) -> tuple[Tensor, Tensor]:
    """The log decays of the window hybrid's linear part, summed directly from their definition.

    log_decay: [B, T, H, 1 | F] (≤ 0, −inf allowed), in the accumulation dtype; queries at positions
    first_query .. T − 1; in_linear: bool [B, T_q, T], the linear set L_t of each query. Returns
        key_exponents [B, H, T_q, T, 1 | F]: Σ_{i = j + window_size + 1}^{t} log_decay_i for j ∈ L_t, −inf elsewhere;
        state_exponents [B, H, T_q, 1, 1 | F]: Σ_{i = 0}^{t} log_decay_i, the decay of the initial state.
    Every sum is accumulated from the query backwards over log decays only (a suffix sum of the masked row),
    never as a difference of prefix sums: a −inf (reset) meets only finite values and −inf, never −inf − (−inf).
    """
    length = log_decay.shape[1]
    steps = log_decay.transpose(1, 2)  # [B, H, T, 1 | F]
    pos = torch.arange(length, device=log_decay.device)
    up_to = pos[None, :] <= pos[first_query:, None]  # [T_q, T]: step i happened by query t
    row = torch.where(up_to[..., None], steps[:, :, None], 0.0)  # [B, H, T_q, T, 1 | F]
    suffix = row.flip(3).cumsum(3).flip(3)  # suffix[t, p] = Σ_{p ≤ i ≤ t} log_decay_i
    # Key j's sum starts at p = j + window_size + 1; beyond T − 1 (and beyond t) the sum is empty: 0.
    shifted = F.pad(suffix, (0, 0, 0, window_size + 1))[:, :, :, window_size + 1 :]  # [B, H, T_q, T, 1 | F]
    # −inf outside L_t masks the exponent, not the result, so exp and its gradient stay finite
    key_exponents = torch.where(in_linear[:, None, ..., None], shifted, -torch.inf)
    return key_exponents, suffix[:, :, :, :1]


def reference_window_attention(
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
    scale: float,
    key_padding_mask: Tensor | None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Sliding-window softmax + linear attention (LoLCATs) from the full [B, H, T_q, T] score matrix.

    q, k: [B, T_q, H, D] and [B, T, H, D] (softmax part), the queries at the last T_q ≤ T positions;
    v: [B, T, H, V]; q_feat, k_feat: [B, T_q, H, F] and [B, T, H, F] (feature-mapped, linear part);
    window_gate: [H] logits of γ = sigmoid(window_gate); log_decay: None or [B, T, H, 1 | F] (≤ 0) at all T
    positions; key_padding_mask: None or bool [B, T], True for real tokens. For query t the softmax set W_t
    holds the real keys i ≤ t with t − i < window_size plus the sinks i ≤ t; the linear set L_t holds the
    other real keys i ≤ t. With s_ti = scale · q_t·k_i, c_t = max_{i∈W_t} s_ti and the decay of key j at
    query t, d_tj = Π_{i = j + window_size + 1}^{t} a_i (a_i = exp(log_decay_i); 1 without decay):

        o_t = (Σ_{W_t} γ e^{s_ti − c_t} v_i + Σ_{L_t} (d_tj ⊙ q_feat_t)·k_feat_j v_j)
              / (Σ_{W_t} γ e^{s_ti − c_t} + Σ_{L_t} (d_tj ⊙ q_feat_t)·k_feat_j)

    initial_state (None or [B, H, F, V + 1]) adds (Π_{i ≤ t} a_i ⊙ q_feat_t)ᵀ S_0 to every numerator and
    denominator; the final state is Π_{i < T} a_i ⊙ S_0 + Σ d_{T−1, j} ⊙ φ(k_j) [v_j, 1]ᵀ over the real
    non-sink keys j ≤ T − 1 − window_size (L of the last query). The decays form an explicit
    [B, H, T_q, T, 1 | F] tensor: tiny inputs (or a single query) only.

    Returns o [B, T_q, H, V] in v's dtype (pad queries get zeros) and the final state or None.
    """
    batch, length = k.shape[:2]
    first_query = length - q.shape[1]
    dtype = accumulation_dtype(q, k, v, q_feat, k_feat)
    real, sink = window_token_masks(key_padding_mask, batch, length, num_sink_tokens, q.device)
    pos = torch.arange(length, device=q.device)
    distance = pos[first_query:, None] - pos[None, :]  # query index − key index, [T_q, T]
    causal = (distance >= 0) & real[:, None, :]  # [B, T_q, T]: real keys not in the future
    in_window = causal & ((distance < window_size) | sink[:, None, :])
    in_linear = causal & ~in_window

    scores = torch.einsum("bthd,bihd->bhti", q.to(dtype), k.to(dtype)) * scale
    scores = scores.masked_fill(~in_window[:, None], -torch.inf)
    c = scores.amax(-1, keepdim=True)
    c = torch.where(c.isfinite(), c, 0.0)  # a pad query has an empty window: keep exp(−inf − c) = 0, not nan
    gamma = torch.sigmoid(window_gate.to(dtype))[:, None, None]  # [H, 1, 1]
    q_feat, k_feat = q_feat.to(dtype), k_feat.to(dtype)
    if log_decay is None:
        linear_scores = torch.einsum("bthf,bihf->bhti", q_feat, k_feat) * in_linear[:, None]
    else:
        key_exponents, state_exponents = _window_decay_exponents(log_decay.to(dtype), first_query, window_size,
                                                                 in_linear)
        decay = key_exponents.exp()  # d_tj, [B, H, T_q, T, 1 | F]
        if decay.shape[-1] == 1:
            linear_scores = torch.einsum("bthf,bihf->bhti", q_feat, k_feat) * decay[..., 0]
        else:
            linear_scores = torch.einsum("bthf,bihf,bhtif->bhti", q_feat, k_feat, decay)
    weights = gamma * (scores - c).exp() + linear_scores  # [B, H, T_q, T]
    v_ones = torch.cat([v.to(dtype), torch.ones_like(v[..., :1], dtype=dtype)], dim=-1)  # [B, T, H, V + 1]
    total = weights @ v_ones.transpose(1, 2)  # [B, H, T_q, V + 1]: numerator and denominator
    if initial_state is not None:
        initial_state = initial_state.to(dtype)
        q_state = q_feat.transpose(1, 2)  # [B, H, T_q, F]
        if log_decay is not None:
            q_state = q_state * state_exponents[..., 0, :].exp()
        total = total + q_state @ initial_state
    value_dim = v.shape[-1]
    o = divide_at_real_queries(total[..., :value_dim], total[..., value_dim:], real[:, None, first_query:, None])
    final_state = None
    if output_final_state:
        # The keys that fold are L of the last query (index T − 1): real, non-sink, j ≤ T − 1 − window_size.
        folded = in_linear[:, -1, :, None, None].to(dtype)  # [B, T, 1, 1]
        if log_decay is None:
            k_folded = k_feat * folded
        else:
            k_folded = k_feat * key_exponents[:, :, -1].exp().transpose(1, 2)  # 0 outside L, by the −inf
        final_state = torch.einsum("bthf,bthv->bhfv", k_folded, v_ones)
        if initial_state is not None:
            if log_decay is not None:
                initial_state = state_exponents[:, :, -1, 0, :, None].exp() * initial_state  # Π_{i<T} a_i ⊙ S_0
            final_state = final_state + initial_state
    return o.transpose(1, 2).to(v.dtype), final_state


def reference_window_softmax(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window_size: int,
    num_sink_tokens: int,
    scale: float,
    key_padding_mask: Tensor | None,
) -> Tensor:
    """Exact softmax of each query over its window and sinks alone, as one masked [B, H, T_q, T] softmax: the oracle
    of `ops.window_softmax`.

    q: [B, T_q, H, D] at the last T_q ≤ T positions; k, v: [B, T, H, D | V]; key_padding_mask: None or bool [B, T].
    Query t sees the real keys i ≤ t with t − i < window_size and the first num_sink_tokens real tokens i ≤ t:
    o_t = softmax_i(scale · q_t·k_i) v over them. A pad query outputs 0. Returns [B, T_q, H, V] in v's dtype.
    """
    batch, length = k.shape[:2]
    first_query = length - q.shape[1]
    dtype = accumulation_dtype(q, k, v)
    real, sink = window_token_masks(key_padding_mask, batch, length, num_sink_tokens, q.device)
    pos = torch.arange(length, device=q.device)
    distance = pos[first_query:, None] - pos[None, :]  # query index − key index, [T_q, T]
    seen = (distance >= 0) & real[:, None, :] & ((distance < window_size) | sink[:, None, :])  # [B, T_q, T]
    seen = seen | ~seen.any(-1, keepdim=True)  # a pad query may see no key: any finite row (its output is zeroed)
    scores = torch.einsum("bthd,bihd->bhti", q.to(dtype), k.to(dtype)) * scale
    weights = scores.masked_fill(~seen[:, None], -torch.inf).softmax(-1)
    o = weights @ v.to(dtype).transpose(1, 2)  # [B, H, T_q, V]
    o = o * real[:, None, first_query:, None]  # pad queries output 0
    return o.transpose(1, 2).to(v.dtype)
