"""Fused Triton decode steps: one token of a linear or window-hybrid layer, its state updated in place.

A decode step of a cached layer is a handful of small products per head: decay the state, add one outer product,
read the state out once (and, for the window hybrid, one row of softmax scores over the retained slots). In torch
each is its own launch; here the step is one kernel, one program per (batch row, head), each program reading and
writing its own [K, V (+ 1)] state exactly once, in float32, and reading q, k, v in their dtype. The kernels run
on CUDA tensors, or on CPU under the Triton interpreter (TRITON_INTERPRET=1 before import).

- `triton_linear_decode_step` is `ops_decode.linear_decode_step` (same arguments, same results):

      S ← a ⊙ S + φ(k) [v, 1]ᵀ,        o = s φ(q)ᵀ S   (divided by the normaliser column, the last, if normalize)

- `triton_window_decode_step` is the additive window hybrid's step without a sparse memory
  (`ops_decode.window_decode_step`, run by the layer after its cache's `push`), for query head h of KV head g:

      S ← a ⊙ S + [leaving real] φ(k_leaving) [v_leaving, 1]ᵀ
      w_r = γ_h e^{s_r − c},  s_r = scale q·k_r over the held ring and sink slots r of KV head g, c = max_r s_r
      o = (Σ_r w_r v_r + φ(q)ᵀ S[:, :V]) / (Σ_r w_r + φ(q)ᵀ S[:, V]),   γ_h = sigmoid(window_gate[h])

  and 0 at a pad row. The ring write of the new token (which hands back the leaving one) stays in torch: several
  query heads read the slots of one KV head, so a program writing a slot would race with its neighbours reading it.

Layout: the programs address the contiguous buffers with the pointer arithmetic of `ops_triton_common` (its tile
helpers; every load masked and zero-filled, so block sizes are powers of two whatever the dims). On a GPU no tensor
value is read on the host (the input checks that read values run on CPU only, see `ops_common.checks_values`): a
step can be captured in a CUDA graph.
"""

import torch
from torch import Tensor

from . import ops_triton_common
from .ops_common import NORM_EPS, check_4d_floating, check_log_decay, checked_scale
from .ops_triton_common import (
    DECAY_NONE,
    DECAY_SCALAR,
    DECAY_VECTOR,
    HAS_TRITON,
    MAX_WINDOW_HEAD_DIM,
    block_size,
    load_tile,
    store_tile,
    tl,
    triton,
)

__all__ = ["HAS_TRITON", "triton_linear_decode_step", "triton_window_decode_step"]

# Elements of the largest fp32 tile a program holds (state rows × value columns, slots × head dim): 32 registers a
# thread with 4 warps.
TILE_ELEMENTS = 4096
NORMALIZER_EPS = tl.constexpr(NORM_EPS)  # the kernels may read only constexpr globals


# ---------------------------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _column(x, rows, num_rows):
    """x[rows] of a vector as a fp32 [len(rows), 1] column, 0 where rows ≥ num_rows."""
    return load_tile(x, rows, num_rows, 1, tl.arange(0, 1), 1).to(tl.float32)


@triton.jit
def _row(x, cols, num_cols):
    """x[cols] of a vector as a fp32 [1, len(cols)] row, 0 where cols ≥ num_cols."""
    return load_tile(x, tl.arange(0, 1), 1, 0, cols, num_cols).to(tl.float32)


@triton.jit
def _decay_column(log_decay, row_head, rows, K: tl.constexpr, DECAY: tl.constexpr):
    """The decay a = e^{log a} of state rows `rows` of (batch row, head) `row_head`, a fp32 [len(rows), 1] column:
    one per key dim (DECAY_VECTOR, log_decay [B · H, K]), one per head (DECAY_SCALAR, [B · H]) or 1 (DECAY_NONE)."""
    if DECAY == DECAY_VECTOR:
        log_a = _column(log_decay + row_head.to(tl.int64) * K, rows, K)
    elif DECAY == DECAY_SCALAR:
        log_a = tl.zeros([rows.shape[0], 1], dtype=tl.float32) + tl.load(log_decay + row_head).to(tl.float32)
    else:
        log_a = tl.zeros([rows.shape[0], 1], dtype=tl.float32)
    return tl.exp(log_a)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _linear_decode_kernel(
    q_feat, k_feat, values, log_decay, state, out, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DECAY: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One token of (decayed) linear attention for one batch row and head, the state updated in place:

        S ← a ⊙ S + φ(k) [v, 1]ᵀ,   o = (scale φ(q))ᵀ S[:, :V]  (/ ((scale φ(q))ᵀ S[:, V] + eps) if NORMALIZE)

    q_feat, k_feat: [B · H, K]; values, out: [B · H, V]; log_decay: fp32-convertible [B · H] (DECAY_SCALAR),
    [B · H, K] (DECAY_VECTOR) or unused; state: fp32 [B · H, K, V + NORMALIZE]. The normaliser column goes first
    (the division needs it), then the value columns by blocks of BLOCK_V, each block's state rows by BLOCK_K.
    Grid: (B · H,).
    """
    tl.static_assert((NORMALIZE == 0) or (NORMALIZE == 1))  # also the state's extra column count
    tl.static_assert((DECAY == DECAY_NONE) or (DECAY == DECAY_SCALAR) or (DECAY == DECAY_VECTOR))
    row_head = tl.program_id(0)  # n · H + h
    head_state = state + row_head.to(tl.int64) * (K * (V + NORMALIZE))
    query_base, key_base = q_feat + row_head.to(tl.int64) * K, k_feat + row_head.to(tl.int64) * K
    denominator = tl.full([1, 1], 1.0, dtype=tl.float32)
    if NORMALIZE:
        normalizer = tl.zeros([1, 1], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rows = k0 + tl.arange(0, BLOCK_K)
            column = load_tile(head_state + V, rows, K, V + 1, tl.arange(0, 1), 1)
            column = column * _decay_column(log_decay, row_head, rows, K, DECAY) + _column(key_base, rows, K)
            store_tile(head_state + V, column, rows, K, V + 1, tl.arange(0, 1), 1)
            normalizer += tl.sum(_column(query_base, rows, K) * scale * column, axis=0)[None, :]
        denominator = normalizer + NORMALIZER_EPS
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        value_row = _row(values + row_head.to(tl.int64) * V, cols, V)
        numerator = tl.zeros([1, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rows = k0 + tl.arange(0, BLOCK_K)
            tile = load_tile(head_state, rows, K, V + NORMALIZE, cols, V)
            tile = tile * _decay_column(log_decay, row_head, rows, K, DECAY) + _column(key_base, rows, K) * value_row
            store_tile(head_state, tile, rows, K, V + NORMALIZE, cols, V)
            numerator += tl.sum(_column(query_base, rows, K) * scale * tile, axis=0)[None, :]
        store_tile(out + row_head.to(tl.int64) * V, numerator / denominator, tl.arange(0, 1), 1, V, cols, V)


@triton.jit
def _window_decode_kernel(
    q, q_feat, log_decay, state, window_keys, window_values, window_mask, leaving_feat, leaving_values,
    leaving_real, window_gate, real, out, scale, num_slots,
    H: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, F: tl.constexpr, V: tl.constexpr, DECAY: tl.constexpr,
    HAS_PADS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One token of the additive window hybrid for one batch row n and query head h (KV head g = h // (H / H_KV)),
    the state updated in place:

        S ← a ⊙ S + [leaving real] φ(k_leaving) [v_leaving, 1]ᵀ          (the linear part, read once: φ(q)ᵀ S)
        o = (γ_h Σ_r e^{s_r − c} v_r + φ(q)ᵀ S[:, :V]) / (γ_h Σ_r e^{s_r − c} + φ(q)ᵀ S[:, V])

    with s_r = scale q·k_r over the held slots r (window_mask) of KV head g, by online softmax over blocks of
    BLOCK_SLOTS slots (c = 0 and empty sums when no slot is held), γ_h = sigmoid(window_gate[h]), and o = 0 where
    HAS_PADS and real[n] is False.
    q: [B · H, D]; q_feat, leaving_feat: [B · H, F]; log_decay: [B · H] (DECAY_SCALAR), [B · H, F] (DECAY_VECTOR) or
    unused; state: fp32 [B · H, F, V + 1]; window_keys, window_values: [B, num_slots, H_KV, D | V]; window_mask:
    bool [B, num_slots]; leaving_values: [B · H_KV, V]; leaving_real, real: bool [B]; window_gate: [H]; out:
    [B · H, V]. Grid: (B · H,).
    """
    tl.static_assert(H % H_KV == 0)
    tl.static_assert(BLOCK_V >= V)  # one value row per tile: the softmax and linear sums meet in it
    tl.static_assert(BLOCK_D >= D)
    tl.static_assert((DECAY == DECAY_NONE) or (DECAY == DECAY_SCALAR) or (DECAY == DECAY_VECTOR))
    row_head = tl.program_id(0)  # n · H + h
    n, h = row_head // H, row_head % H
    kv_head = h // (H // H_KV)  # g
    cols = tl.arange(0, BLOCK_V)

    # Linear part: decay, fold the leaving token in, read out; the value columns and the normaliser column.
    head_state = state + row_head.to(tl.int64) * (F * (V + 1))
    feature_base = row_head.to(tl.int64) * F
    leaving_value = _row(leaving_values + (n.to(tl.int64) * H_KV + kv_head) * V, cols, V)
    folds = tl.load(leaving_real + n).to(tl.float32)  # 1 if the leaving token is real and not a sink, else 0
    linear_numerator = tl.zeros([1, BLOCK_V], dtype=tl.float32)
    linear_denominator = tl.zeros([1, 1], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        rows = f0 + tl.arange(0, BLOCK_F)
        decay = _decay_column(log_decay, row_head, rows, F, DECAY)
        leaving_key = _column(leaving_feat + feature_base, rows, F) * folds
        query = _column(q_feat + feature_base, rows, F)
        tile = load_tile(head_state, rows, F, V + 1, cols, V) * decay + leaving_key * leaving_value
        store_tile(head_state, tile, rows, F, V + 1, cols, V)
        linear_numerator += tl.sum(query * tile, axis=0)[None, :]
        column = load_tile(head_state + V, rows, F, V + 1, tl.arange(0, 1), 1) * decay + leaving_key
        store_tile(head_state + V, column, rows, F, V + 1, tl.arange(0, 1), 1)
        linear_denominator += tl.sum(query * column, axis=0)[None, :]

    # Softmax part: one row of scores against the slots of KV head g.
    dims = tl.arange(0, BLOCK_D)
    query_row = _row(q + row_head.to(tl.int64) * D, dims, D)  # [1, BLOCK_D]
    slot0 = n.to(tl.int64) * num_slots  # the row's first slot
    key_base = window_keys + (slot0 * H_KV + kv_head) * D
    value_base = window_values + (slot0 * H_KV + kv_head) * V
    running_max = tl.full([1, 1], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([1, 1], dtype=tl.float32)
    softmax_numerator = tl.zeros([1, BLOCK_V], dtype=tl.float32)
    for s0 in range(0, num_slots, BLOCK_SLOTS):
        slots = s0 + tl.arange(0, BLOCK_SLOTS)
        held = tl.load(window_mask + slot0 + slots, mask=slots < num_slots, other=0) != 0
        keys = load_tile(key_base, slots, num_slots, H_KV * D, dims, D).to(tl.float32)
        scores = tl.sum(keys * query_row, axis=1)[:, None] * scale  # [BLOCK_SLOTS, 1]
        scores = tl.where(held[:, None], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0)[None, :])
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing held yet: every weight stays 0, not nan
        weights = tl.exp(scores - shift)
        rescale = tl.exp(running_max - shift)
        values_tile = load_tile(value_base, slots, num_slots, H_KV * V, cols, V).to(tl.float32)
        running_sum = running_sum * rescale + tl.sum(weights, axis=0)[None, :]
        softmax_numerator = softmax_numerator * rescale + tl.sum(weights * values_tile, axis=0)[None, :]
        running_max = new_max

    gamma = tl.sigmoid(tl.load(window_gate + h).to(tl.float32))
    o = (gamma * softmax_numerator + linear_numerator) / (gamma * running_sum + linear_denominator)
    if HAS_PADS:
        o = tl.where(tl.load(real + n) != 0, o, 0.0)  # a pad query outputs 0
    store_tile(out + row_head.to(tl.int64) * V, o, tl.arange(0, 1), 1, V, cols, V)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


def _tile_rows(cols: int, dim: int) -> int:
    """Rows of a fp32 tile of `cols` columns over a dim of size `dim`: a power of two in [16, TILE_ELEMENTS / cols],
    no more than `dim` needs."""
    return min(block_size(dim, 128), max(16, TILE_ELEMENTS // cols))


def _token_decay_mode(log_decay: Tensor | None) -> int:
    """The kernels' DECAY for log_decay None, [B, 1, H] or [B, 1, H, K]."""
    if log_decay is None:
        return DECAY_NONE.value
    return DECAY_SCALAR.value if log_decay.dim() == 3 else DECAY_VECTOR.value


def _check_decode_inputs(tensors: dict[str, Tensor | None], state: Tensor, state_shape: tuple[int, ...],
                         window_head_dims: tuple[int, int] | None = None) -> None:
    """The device and dtype checks of the triton backend, then the state: a contiguous fp32 tensor of state_shape
    (the kernel updates it in place, so it cannot work on a copy)."""
    present = {n: x for n, x in tensors.items() if x is not None}
    problem = ops_triton_common.unsupported_inputs(present, window_head_dims)
    if problem is not None:
        raise ValueError(problem)
    if not isinstance(state, Tensor) or tuple(state.shape) != state_shape or state.dtype != torch.float32:
        raise ValueError(
            f"state must be a float32 tensor of shape {state_shape}, got {getattr(state, 'shape', state)!r} of type "
            f"{getattr(state, 'dtype', type(state).__name__)}"
        )
    if not state.is_contiguous():
        raise ValueError("state must be contiguous: the decode kernel updates it in place (a cache's state is)")


def _check_shape(name: str, x: Tensor, dims: str, shape: tuple[int | None, ...]) -> None:
    """x: a 4-D floating-point tensor of `shape` (None: any size); dims names its layout in the message."""
    check_4d_floating(name, x, dims)
    if any(want is not None and got != want for got, want in zip(x.shape, shape, strict=True)):
        expected = ", ".join("any" if want is None else str(want) for want in shape)
        raise ValueError(f"{name} must be {dims} = ({expected}), got {tuple(x.shape)}")


def _check_mask(name: str, mask: Tensor, shape: tuple[int, ...]) -> None:
    """mask: a bool tensor of `shape`."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != shape:
        raise ValueError(f"{name} must be a bool tensor of shape {shape}, got {getattr(mask, 'shape', mask)!r} of "
                         f"type {getattr(mask, 'dtype', type(mask).__name__)}")


def triton_linear_decode_step(
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

    Arguments and result as `modeling_linear_attention.linear_decode_step`: q_feat, k_feat [B, 1, H, K], v
    [B, 1, H, V], log_decay None / [B, 1, H] / [B, 1, H, K] (≤ 0), state fp32 [B, H, K, V (+ 1 if normalize)],
    contiguous. S ← a ⊙ S + φ(k) [v, 1]ᵀ, then o = scale φ(q)ᵀ S (divided by its normaliser column).
    """
    _check_shape("q_feat", q_feat, "[B, 1, H, K]", (None, 1, None, None))
    batch, _, heads, key_dim = q_feat.shape
    _check_shape("k_feat", k_feat, "[B, 1, H, K]", tuple(q_feat.shape))
    _check_shape("v", v, "[B, 1, H, V]", (batch, 1, heads, None))
    if log_decay is not None:
        check_log_decay(log_decay, (batch, 1, heads), (batch, 1, heads, key_dim))
    scale = checked_scale(scale, key_dim**-0.5)
    value_dim = v.shape[-1]
    _check_decode_inputs({"q_feat": q_feat, "k_feat": k_feat, "v": v, "log_decay": log_decay}, state,
                         (batch, heads, key_dim, value_dim + int(normalize)))
    out = v.new_empty(batch, 1, heads, value_dim)
    q_feat, k_feat, v = q_feat.contiguous(), k_feat.contiguous(), v.contiguous()
    _linear_decode_kernel[(batch * heads,)](
        q_feat, k_feat, v, state if log_decay is None else log_decay.contiguous(), state, out, scale,
        H=heads, K=key_dim, V=value_dim, DECAY=_token_decay_mode(log_decay), NORMALIZE=int(bool(normalize)),
        BLOCK_K=block_size(key_dim), BLOCK_V=block_size(value_dim),
    )
    return out


def triton_window_decode_step(
    q: Tensor,
    q_feat: Tensor,
    log_decay: Tensor | None,
    state: Tensor,
    window_keys: Tensor,
    window_values: Tensor,
    window_mask: Tensor,
    leaving_feat: Tensor,
    leaving_values: Tensor,
    leaving_real: Tensor,
    window_gate: Tensor,
    real: Tensor | None,
    *,
    scale: float,
) -> Tensor:
    """One token of the additive window hybrid (no sparse memory), updating `state` in place: o [B, 1, H, V] in
    window_values' dtype.

    The part of `LinearAttention.window_decode_step` after the ring write: call it with the cache's buffers once
    `LinearStateLayer.push_window_token` has written the new token into its slot and returned the leaving one.

    q [B, 1, H, D]; q_feat [B, 1, H, F]; log_decay None / [B, 1, H] / [B, 1, H, F] (0 at a pad); state fp32
    [B, H, F, V + 1], contiguous; window_keys, window_values [B, R, H_kv, D | V] and window_mask bool [B, R]: the
    sink and ring slots, the new token's among them; leaving_feat [B, 1, H, F], leaving_values [B, 1, H_kv, V],
    leaving_real bool [B, 1]: the token leaving the window (it folds into the state where leaving_real);
    window_gate [H]; real bool [B, 1], or None when every row's token is real; scale: of the softmax scores
    (head_dim ** -0.5 in the model). H must be a multiple of H_kv; D, V ≤ MAX_WINDOW_HEAD_DIM.
    """
    _check_shape("q", q, "[B, 1, H, D]", (None, 1, None, None))
    batch, _, heads, head_dim = q.shape
    _check_shape("q_feat", q_feat, "[B, 1, H, F]", (batch, 1, heads, None))
    feature_dim = q_feat.shape[-1]
    _check_shape("window_keys", window_keys, "[B, R, H_kv, D]", (batch, None, None, head_dim))
    num_slots, kv_heads = window_keys.shape[1:3]
    if num_slots == 0 or heads % kv_heads:
        raise ValueError(f"window_keys [B, R, H_kv, D] must hold R ≥ 1 slots of H_kv KV heads dividing H = {heads}, "
                         f"got {tuple(window_keys.shape)}")
    _check_shape("window_values", window_values, "[B, R, H_kv, V]", (batch, num_slots, kv_heads, None))
    value_dim = window_values.shape[-1]
    _check_shape("leaving_feat", leaving_feat, "[B, 1, H, F]", tuple(q_feat.shape))
    _check_shape("leaving_values", leaving_values, "[B, 1, H_kv, V]", (batch, 1, kv_heads, value_dim))
    _check_mask("window_mask", window_mask, (batch, num_slots))
    _check_mask("leaving_real", leaving_real, (batch, 1))
    if real is not None:
        _check_mask("real", real, (batch, 1))
    if not isinstance(window_gate, Tensor) or tuple(window_gate.shape) != (heads,):
        raise ValueError(f"window_gate must be a tensor of shape ({heads},) (one gate per query head), got "
                         f"{getattr(window_gate, 'shape', window_gate)!r}")
    if log_decay is not None:
        check_log_decay(log_decay, (batch, 1, heads), (batch, 1, heads, feature_dim))
    scale = checked_scale(scale, head_dim**-0.5)
    inputs = {"q": q, "q_feat": q_feat, "log_decay": log_decay, "window_keys": window_keys,
              "window_values": window_values, "leaving_feat": leaving_feat, "leaving_values": leaving_values,
              "window_gate": window_gate}
    _check_decode_inputs(inputs, state, (batch, heads, feature_dim, value_dim + 1), (head_dim, value_dim))
    out = window_values.new_empty(batch, 1, heads, value_dim)
    block_v, block_d = block_size(value_dim, MAX_WINDOW_HEAD_DIM), block_size(head_dim, MAX_WINDOW_HEAD_DIM)
    _window_decode_kernel[(batch * heads,)](
        *(x.contiguous() for x in (q, q_feat)), state if log_decay is None else log_decay.contiguous(), state,
        *(x.contiguous() for x in (window_keys, window_values, window_mask, leaving_feat, leaving_values,
                                   leaving_real, window_gate)),
        state if real is None else real.contiguous(), out, scale, num_slots,
        H=heads, H_KV=kv_heads, D=head_dim, F=feature_dim, V=value_dim, DECAY=_token_decay_mode(log_decay),
        HAS_PADS=real is not None, BLOCK_SLOTS=_tile_rows(max(block_d, block_v), num_slots), BLOCK_D=block_d,
        BLOCK_F=_tile_rows(block_v, feature_dim), BLOCK_V=block_v,
    )
    return out
