"""One-token decode steps in torch: the lean fixed-shape twins of the general ops for one query behind a cache, each
updating its state in place. `ops_triton_decode` holds the fused Triton kernels of the first two; the public entry
points `ops.linear_attention_step`, `ops.window_attention_step` and `ops.delta_window_attention_step` choose
between them (`ops_common.pick_backend`).

The steps are pure functions of tensors: the caller (a layer) keeps its cache, writes the new token into the ring
slot of the token leaving the window and hands the step that leaving token, the slots and the state. Every op here
runs once per layer and token, so a step spends no op on what it can skip: no cast of a tensor already in the
state's dtype (`_cast`), products as `bmm` on 3-D views (a 4-D matmul dispatches its broadcasting as several more
ops), grouped-query heads sharing a KV head's slots by views instead of repeats, and no check that reads a value.

- `linear_decode_step`: S ← a ⊙ S + φ(k) [v, 1]ᵀ, o = s φ(q)ᵀ S (divided by its normaliser column): the
  recurrence of `ops_reference.recurrent_linear_attention` for one token.
- `window_decode_step`: the additive window hybrid (`ops.window_attention` for one query behind the retained keys):
  the state decays and takes the leaving token, one row of softmax scores over the slots (and the sparse memory's
  slots) and one read-out of the state share one normaliser.
- `delta_window_decode_step`: the delta rule behind the window (`ops.window_attention` with update_rule="delta"):
  the leaving token enters the delta state, which is read once; one row of exact softmax over the slots with its
  own normaliser.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops_common import NORM_EPS

__all__ = ["delta_window_decode_step", "linear_decode_step", "window_decode_step"]


def _cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in `dtype`, without dispatching a cast when it already is (a decode step's ops are counted)."""
    return x if x.dtype == dtype else x.to(dtype)


def linear_decode_step(
    q_feat: Tensor,
    k_feat: Tensor,
    v: Tensor,
    log_decay: Tensor | None,
    state: Tensor,
    *,
    scale: float,
    normalize: bool,
) -> Tensor:
    """One token of (decayed) linear attention, updating `state` in place: o [B, 1, H, V] in v's dtype.

    q_feat, k_feat [B, 1, H, K], v [B, 1, H, V], log_decay None / [B, 1, H] / [B, 1, H, K], state
    [B, H, K, V (+ 1)] as `linear_attention` defines it. S ← a ⊙ S + φ(k) [v, 1]ᵀ, then one read-out
    o = s φ(q)ᵀ S (divided by its normaliser column): the recurrence of `recurrent_linear_attention` for one
    step, its twin.
    """
    b, _, heads, _ = q_feat.shape
    dtype = state.dtype
    values = v[:, 0].to(dtype)
    if normalize:
        values = F.pad(values, (0, 1), value=1.0)  # [B, H, V + 1]: the normaliser is the last column
    if log_decay is not None:
        state.mul_(log_decay[:, 0].to(dtype).exp().view(b, heads, -1, 1))
    state.add_(k_feat[:, 0].to(dtype)[..., None] * values[..., None, :])
    o = (q_feat.view(b, heads, 1, -1).to(dtype) * scale) @ state  # [B, H, 1, V (+ 1)]
    if normalize:
        o = o[..., :-1] / (o[..., -1:] + NORM_EPS)
    return o.view(b, 1, heads, -1).to(v.dtype)


def window_decode_step(
    q: Tensor,
    q_feat: Tensor,
    log_decay: Tensor | None,
    state: Tensor,
    window_keys: Tensor,
    window_values: Tensor,
    window_mask: Tensor,
    leaving_feat: Tensor | None,
    leaving_values: Tensor | None,
    leaving_real: Tensor | None,
    window_gate: Tensor,
    real: Tensor | None,
    *,
    scale: float,
    memory_keys: Tensor | None = None,
    memory_values: Tensor | None = None,
    memory_mask: Tensor | None = None,
) -> Tensor:
    """One token of the additive window hybrid, updating `state` in place: o [B, 1, H, V] in window_values' dtype.

    The arguments of `ops_triton_decode.triton_window_decode_step`, plus an optional sparse memory:
    q [B, 1, H, D]; q_feat [B, 1, H, F]; log_decay None / [B, 1, H] / [B, 1, H, F] (0 at a pad); state
    [B, H, F, V + 1] (fp32); window_keys, window_values [B, R, H_kv, D | V] and window_mask bool [B, R]: the sink
    and ring slots, the new token's among them (with a sparse memory, the ring slots that left the window before
    the current block masked by the caller); leaving_feat [B, 1, H, F] (φ of its cached key), leaving_values
    [B, 1, H_kv, V], leaving_real bool [B, 1]: the token leaving the window, folded into the state where
    leaving_real, or all three None (nothing folds: a sparse memory's ring keeps the leaving tokens until the block
    ends); window_gate [H]; real bool [B, 1], or None when every row's token is real (then no pad handling runs);
    scale: of the softmax scores. memory_keys, memory_values [B, H_kv, m, D | V], memory_mask bool [B, H_kv, m]:
    the sparse memory's slots, under the same softmax row (all None without one).

    S ← a ⊙ S (+ φ(k_leaving) [v_leaving, 1]ᵀ); scores s_r = scale q·k_r over the unmasked slots, grouped by KV
    head (no repeat), c their max, w_r = γ e^{s_r − c} with γ = sigmoid(window_gate);
    o = (Σ_r w_r v_r + φ(q)ᵀ S[:, :V]) / (Σ_r w_r + φ(q)ᵀ S[:, V]), 0 at a pad query. The numerator's sum and add
    run in one `baddbmm`.
    """
    b, _, heads, head_dim = q.shape
    kv_heads, value_dim = window_keys.shape[2], window_values.shape[-1]
    dtype = state.dtype
    if log_decay is not None:
        state.mul_(_cast(log_decay[:, 0], dtype).exp().view(b, heads, -1, 1))
    if leaving_feat is not None:  # S += φ(k) [v, 1]ᵀ, the query heads of a KV head [B, H_kv, G, F, V + 1] share its v
        fold_k = _cast(leaving_feat, dtype).view(b, kv_heads, -1, state.shape[2], 1)  # φ(k_j)
        fold_k = fold_k * leaving_real.view(b, 1, 1, 1, 1)  # [B, H_kv, G, F, 1]: 0 unless it folds
        fold_v = F.pad(_cast(leaving_values, dtype), (0, 1), value=1.0).view(b, kv_heads, 1, 1, -1)  # [.., V + 1]
        state.view(b, kv_heads, -1, *state.shape[2:]).addcmul_(fold_k, fold_v)
    # Softmax part: [B, H_kv, G, D] against the slots [B, H_kv, D, R] (and the memory's [B, H_kv, D, m]).
    keys, values = window_keys.permute(0, 2, 3, 1), window_values.transpose(1, 2)
    mask = window_mask.view(b, 1, 1, -1)
    linear = torch.bmm(_cast(q_feat, dtype).view(b * heads, 1, -1), state.view(b * heads, *state.shape[2:]))
    if memory_keys is not None:
        keys = torch.cat([keys, memory_keys.transpose(-1, -2)], dim=-1)
        values = torch.cat([values, memory_values], dim=-2)
        mask = torch.cat([mask.expand(-1, kv_heads, -1, -1), memory_mask[:, :, None]], dim=-1)
    query = _cast(q, dtype).view(b * kv_heads, heads // kv_heads, head_dim)
    scores = torch.bmm(query, _cast(keys, dtype).reshape(b * kv_heads, head_dim, -1))
    scores = scores.view(b, kv_heads, -1, keys.shape[-1])
    scores = torch.where(mask, scores * scale, -torch.inf)  # [B, H_kv, G, R (+ m)]
    top = scores.amax(-1, keepdim=True)
    if real is not None:
        top = top.clamp(min=torch.finfo(dtype).min)  # a pad's empty window: no nan
    gamma = torch.sigmoid(_cast(window_gate, dtype)).view(kv_heads, -1, 1)
    weights = (scores - top).exp_().mul_(gamma)  # [B, H_kv, G, R (+ m)]
    linear = linear.view(b * kv_heads, -1, value_dim + 1)  # [B·H_kv, G, V + 1]
    numerator = torch.baddbmm(linear[..., :value_dim], weights.view(b * kv_heads, *weights.shape[2:]),
                              _cast(values, dtype).reshape(b * kv_heads, *values.shape[2:]))  # [B·H_kv, G, V]
    denominator = linear[..., value_dim:] + weights.sum(-1).view(b * kv_heads, -1, 1)
    o = (numerator / denominator).view(b, 1, heads, value_dim)
    if real is not None:
        o = o.masked_fill(~real.view(b, 1, 1, 1), 0.0)  # pad queries output 0
    return _cast(o, window_values.dtype)


def delta_window_decode_step(
    q: Tensor,
    q_hat: Tensor,
    log_decay: Tensor | None,
    state: Tensor,
    window_keys: Tensor,
    window_values: Tensor,
    window_mask: Tensor,
    leaving_key: Tensor,
    leaving_values: Tensor,
    leaving_beta: Tensor,
    leaving_real: Tensor,
    window_gate: Tensor,
    real: Tensor | None,
    *,
    scale: float,
    state_output: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """One token of the delta rule behind the window, updating `state` in place: o [B, 1, H, V] in window_values'
    dtype.

    q [B, 1, H, D] (after RoPE); q_hat [B, 1, H, K] (the L2-normalised query features); log_decay None / [B, 1, H]
    (0 at a pad); state [B, H, K, V] (fp32); window_keys, window_values [B, R, H_kv, D | V] and window_mask bool
    [B, R]: the sink and ring slots, the new token's among them; leaving_key [B, 1, H, K] (k̂ of the leaving token's
    cached key), leaving_values [B, 1, H_kv, V], leaving_beta [B, 1, H] (its stored β) and leaving_real bool [B, 1]
    (real and not a sink: it enters the state); window_gate [H], the weight λ of the state part; real bool [B, 1],
    or None when every row's token is real; scale: of the softmax scores; state_output: applied to the state's
    read-out [B, 1, H, V] before λ weighs it (the layer's output norm and gate; None: as it is).

    In `recurrent_delta_rule`'s order, S ← a (S − β k̂ (k̂ᵀ S)) + β k̂ vᵀ with β = 0 unless the leaving token enters;
    the read-out Sᵀ (K^-½ q̂); one row of exact softmax over the unmasked slots with its own normaliser (grouped by
    KV head: no repeat); o = softmax + λ · state_output(read), 0 at a pad query.
    """
    b, _, heads, head_dim = q.shape
    kv_heads, key_dim = window_keys.shape[2], q_hat.shape[-1]
    dtype = state.dtype
    key = _cast(leaving_key, dtype).view(b * heads, 1, -1)  # k̂_j [B·H, 1, K]
    strength = _cast(leaving_beta * leaving_real[..., None], dtype).view(b * heads, 1, 1)  # β_j, 0 unless it enters
    write = strength * key.transpose(-1, -2)  # β_j k̂_j [B·H, K, 1]
    flat_state = state.view(b * heads, *state.shape[2:])  # [B·H, K, V]
    flat_state.addcmul_(write, torch.bmm(key, flat_state), value=-1.0)  # erase what S stores under k̂_j
    if log_decay is not None:
        state.mul_(_cast(log_decay, dtype).exp().view(b, heads, 1, 1))
    # + β_j k̂_j v_jᵀ: the query heads of a KV head [B, H_kv, G, K, V] share its v_j (no repeat)
    state.view(b, kv_heads, -1, *state.shape[2:]).addcmul_(
        write.view(b, kv_heads, -1, state.shape[2], 1), _cast(leaving_values, dtype).view(b, kv_heads, 1, 1, -1))
    read = torch.bmm(_cast(q_hat, dtype).view(b * heads, 1, -1) * key_dim**-0.5, flat_state)  # [B·H, 1, V]
    read = _cast(read.view(b, 1, heads, -1), window_values.dtype)
    if state_output is not None:
        read = state_output(read)
    # Softmax part: [B·H_kv, G, D] against the slots [B·H_kv, D, R].
    keys, values = window_keys.permute(0, 2, 3, 1), window_values.transpose(1, 2)
    query = _cast(q, dtype).view(b * kv_heads, heads // kv_heads, head_dim)
    scores = torch.bmm(query, _cast(keys, dtype).reshape(b * kv_heads, head_dim, -1)) * scale
    scores = scores.view(b, kv_heads, -1, keys.shape[-1])
    weights = torch.where(window_mask.view(b, 1, 1, -1), scores, -torch.inf).softmax(-1)
    o = torch.bmm(weights.view(b * kv_heads, *weights.shape[2:]),
                  _cast(values, dtype).reshape(b * kv_heads, *values.shape[2:]))  # [B·H_kv, G, V]
    o = _cast(o.view(b, 1, heads, -1), window_values.dtype)  # [B, 1, H, V]
    o = o + window_gate.to(o.dtype).view(1, 1, -1, 1) * read
    if real is not None:  # pad queries output 0 (a pad's window may be empty: its softmax row is nan)
        o = torch.where(real.view(b, 1, 1, 1), o, 0.0)
    return o
