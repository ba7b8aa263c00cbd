"""Triton kernels of `window_attention` (backend "triton"): the sliding-window hybrid, forward and backward.

Same arguments and results as the torch chunked backend (`ops_chunked.chunk_window_attention`). Inputs may be
float16, bfloat16 or float32, the softmax part's head dims D and V up to MAX_WINDOW_HEAD_DIM (`ops_triton_common`,
whose memory layout, tile helpers and interpreter guard the kernels use); every sum is float32.

Window hybrid
-------------
`window_attention`'s linear part is the linear kernels (`ops_triton_linear.linear_sums`) on keys and values
delayed by window_size; its softmax part is a flash-attention style kernel over the sink keys and the window keys
(`_window_fwd_kernel`, backward `_window_dq_kernel` and `_window_dkdv_kernel`), which returns the unnormalised sums
against the exact window maximum c_t; torch combines the two parts and divides. A dk/dv program visits the queries
within the window of its keys only; the sinks' gradients from every later query come from
`_window_sink_dkdv_kernel`, which cuts those queries into slices of about a window each (partial sums, added in a
fixed order): no program runs through a whole row.
"""

import torch
from torch import Tensor

from .ops_common import divide_at_real_queries, window_linear_inputs, window_token_masks
from .ops_triton_common import (
    INTERPRET,
    autotune_configs,
    batch_chunks,
    block_size,
    dot,
    load_tile,
    real_token_bounds,
    store_tile,
    tile_offsets,
    tl,
    triton,
    usable_configs,
)
from .ops_triton_linear import linear_sums

__all__ = ["triton_window_attention"]

WINDOW_BLOCK = 64  # queries (and keys) per block of the window softmax kernels, see `_window_blocks`
SINK_BLOCK = 16  # sink keys per program of `_window_sink_dkdv_kernel` (the smallest tl.dot tile)
SINK_SLICE_MIN_BLOCKS = 4  # query blocks per program of `_window_sink_dkdv_kernel` at least, see `_sink_slice_blocks`



# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _window_mask(t, i, lo, hi, sink_end, window):
    """[len(t), len(i)]: key i is in query t's softmax set: a real key (lo ≤ i ≤ t < hi) that is a sink
    (i < sink_end) or at most window − 1 tokens back. Pad queries get an empty set."""
    real_causal = (i[None, :] <= t[:, None]) & (i[None, :] >= lo) & (t[:, None] < hi)
    return real_causal & ((i[None, :] < sink_end) | (t[:, None] - i[None, :] < window))


@triton.jit
def _window_key_blocks(q_first, q_end, lo, hi, sink_end, window, BLOCK_N: tl.constexpr):
    """The key blocks that queries [q_first, q_end) visit: first the sinks [lo, sink_end), then the window range
    from the oldest key of the first query's window on. Returns (sink blocks, window range start, all blocks)."""
    sink_blocks = tl.cdiv(tl.maximum(tl.minimum(sink_end, q_end) - lo, 0), BLOCK_N)
    window_start = tl.maximum(q_first - window + 1, sink_end)
    window_blocks = tl.cdiv(tl.maximum(tl.minimum(q_end, hi) - window_start, 0), BLOCK_N)
    return sink_blocks, window_start, sink_blocks + window_blocks


@triton.jit
def _window_block_scores(
    q_tile, k, t, block, sink_blocks, window_start, lo, hi, sink_end, window, scale, row_stride,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BF16_DOT: tl.constexpr,
):
    """Scores s_ti = scale·q_t·k_i of key block `block` (see `_window_key_blocks`), −inf outside the softmax set.

    The sink blocks count only sink keys, the window blocks only the others, so no pair is counted twice.
    Returns (scores [BLOCK_M, BLOCK_N], the keys' positions i, the mask, the key tile).
    """
    in_sinks = block < sink_blocks
    first = tl.where(in_sinks, lo + block * BLOCK_N, window_start + (block - sink_blocks) * BLOCK_N)
    i = first + tl.arange(0, BLOCK_N)
    k_tile = load_tile(k, i, hi, row_stride, tl.arange(0, BLOCK_D), D)
    allowed = _window_mask(t, i, lo, hi, sink_end, window) & ((i < sink_end) == in_sinks)[None, :]
    scores = tl.where(allowed, dot(q_tile, tl.trans(k_tile), BF16_DOT) * scale, float("-inf"))
    return scores, i, allowed, k_tile


@triton.jit
def _window_setup(bounds, sinks, H: tl.constexpr):
    """Program ids of the first two axes of a (block, batch row · head[, ...]) grid → (block, row, head, lo, hi,
    sink_end)."""
    pid, bh = tl.program_id(0), tl.program_id(1)
    row, h = bh // H, bh % H
    lo, hi = tl.load(bounds + 2 * row), tl.load(bounds + 2 * row + 1)
    return pid, row, h, lo, hi, tl.minimum(lo + sinks, hi)


@triton.autotune(configs=autotune_configs(), key=["D", "V"], prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _window_fwd_kernel(
    q, k, v, num, den, row_max, row_argmax, bounds, scale, T, window, sinks,
    H: tl.constexpr, D: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, BF16_DOT: tl.constexpr,
):
    """Softmax part of the window hybrid, by online softmax over the sink keys, then the window keys:

        num_t = Σ_{i ∈ W_t} e^{s_ti − c_t} v_i,   den_t = Σ_{i ∈ W_t} e^{s_ti − c_t},   c_t = max_{i ∈ W_t} s_ti

    (c_t = 0 and sums 0 for an empty W_t). Also stores c_t and argmax_t, the first key attaining it (c_t's gradient
    goes there). q, k: [B, T, H, D]; v, num: [B, T, H, V]; den, row_max, row_argmax (int32): [B, T, H]; bounds: int32
    [B, 2], the real tokens [lo, hi) of each row. Grid: (T / BLOCK_M, B · H).
    """
    pid, row, h, lo, hi, sink_end = _window_setup(bounds, sinks, H)
    t = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    token0 = row.to(tl.int64) * T  # the row's first token
    q_tile = load_tile(q + (token0 * H + h) * D, t, T, H * D, tl.arange(0, BLOCK_D), D)
    k_base, v_base = k + (token0 * H + h) * D, v + (token0 * H + h) * V
    vv = tl.arange(0, BLOCK_V)
    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    argmax = tl.zeros([BLOCK_M], dtype=tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    sink_blocks, window_start, blocks = _window_key_blocks(pid * BLOCK_M, pid * BLOCK_M + BLOCK_M, lo, hi, sink_end,
                                                           window, BLOCK_N)
    for block in range(blocks):
        scores, i, _, _ = _window_block_scores(
            q_tile, k_base, t, block, sink_blocks, window_start, lo, hi, sink_end, window, scale, H * D, D, BLOCK_N,
            BLOCK_D, BF16_DOT,
        )
        block_max = tl.max(scores, axis=1)
        new_max = tl.maximum(running_max, block_max)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key yet: keeps every exp at 0, not nan
        p = tl.exp(scores - shift[:, None])
        rescale = tl.exp(running_max - shift)
        running_sum = running_sum * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + dot(p, load_tile(v_base, i, hi, H * V, vv, V), BF16_DOT)
        argmax = tl.where(block_max > running_max, tl.min(i, axis=0) + tl.argmax(scores, axis=1), argmax)
        running_max = new_max
    stats = (token0 + t) * H + h  # offsets into the [B, T, H] buffers
    store_tile(num + h * V, acc, token0 + t, token0 + T, H * V, vv, V)
    tl.store(den + stats, running_sum, mask=t < T)
    tl.store(row_max + stats, tl.where(running_max == float("-inf"), 0.0, running_max), mask=t < T)
    tl.store(row_argmax + stats, argmax, mask=t < T)


@triton.jit
def _window_score_grads(scores, allowed, i, row_max, argmax, d_max, dnum_tile, dden, v_tile, BF16_DOT: tl.constexpr):
    """p_ti = e^{s_ti − c_t} and ds_ti = p_ti·(dnum_t·v_i + dden_t) + dc_t·[i = argmax_t] for a [queries, keys] tile."""
    p = tl.exp(scores - row_max[:, None])
    ds = p * (dot(dnum_tile, tl.trans(v_tile), BF16_DOT) + dden[:, None])
    return p, ds + tl.where(allowed & (i[None, :] == argmax[:, None]), d_max[:, None], 0.0)


@triton.jit
def _window_load_row_grads(dnum, dden, row_max, row_argmax, d_max, token0, t, T, h, H: tl.constexpr,
                           V: tl.constexpr, BLOCK_V: tl.constexpr):
    """dnum [len(t), BLOCK_V] and the per-query dden, c, argmax and dc of queries t of one row and head."""
    stats = (token0 + t) * H + h
    dnum_tile = load_tile(dnum + h * V, token0 + t, token0 + T, H * V, tl.arange(0, BLOCK_V), V)
    return (dnum_tile, tl.load(dden + stats, mask=t < T, other=0.0), tl.load(row_max + stats, mask=t < T, other=0.0),
            tl.load(row_argmax + stats, mask=t < T, other=0), tl.load(d_max + stats, mask=t < T, other=0.0))


@triton.autotune(configs=autotune_configs(), key=["D", "V"], prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _window_dq_kernel(
    q, k, v, dnum, dden, row_max, row_argmax, d_max, dq, bounds, scale, T, window, sinks,
    H: tl.constexpr, D: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, BF16_DOT: tl.constexpr,
):
    """dq_t = scale · Σ_i ds_ti k_i for a block of queries, visiting the keys as `_window_fwd_kernel` does.

    ds_ti = p_ti (dnum_t·v_i + dden_t) + dc_t [i = argmax_t] with p_ti = e^{s_ti − c_t}; d_max holds dc_t, the gradient
    w.r.t. c_t. Shapes as in `_window_fwd_kernel`; dq: [B, T, H, D]. Grid: (T / BLOCK_M, B · H).
    """
    pid, row, h, lo, hi, sink_end = _window_setup(bounds, sinks, H)
    t = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    token0 = row.to(tl.int64) * T
    dd = tl.arange(0, BLOCK_D)
    q_tile = load_tile(q + (token0 * H + h) * D, t, T, H * D, dd, D)
    k_base, v_base = k + (token0 * H + h) * D, v + (token0 * H + h) * V
    dnum_tile, dden_rows, max_rows, argmax_rows, d_max_rows = _window_load_row_grads(
        dnum, dden, row_max, row_argmax, d_max, token0, t, T, h, H, V, BLOCK_V
    )
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    sink_blocks, window_start, blocks = _window_key_blocks(pid * BLOCK_M, pid * BLOCK_M + BLOCK_M, lo, hi, sink_end,
                                                           window, BLOCK_N)
    for block in range(blocks):
        scores, i, allowed, k_tile = _window_block_scores(
            q_tile, k_base, t, block, sink_blocks, window_start, lo, hi, sink_end, window, scale, H * D, D, BLOCK_N,
            BLOCK_D, BF16_DOT,
        )
        v_tile = load_tile(v_base, i, hi, H * V, tl.arange(0, BLOCK_V), V)
        _, ds = _window_score_grads(scores, allowed, i, max_rows, argmax_rows, d_max_rows, dnum_tile, dden_rows,
                                    v_tile, BF16_DOT)
        acc += dot(ds, k_tile, BF16_DOT)
    store_tile(dq + (token0 * H + h) * D, acc * scale, t, T, H * D, dd, D)


@triton.jit
def _window_key_block_grads(q, dnum, dden, row_max, row_argmax, d_max, token0, t, i, allowed, k_tile, v_tile, scale,
                            T, h, H: tl.constexpr, D: tl.constexpr, V: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_V: tl.constexpr, BF16_DOT: tl.constexpr):
    """The contributions of queries t to dv_i (Σ_t p_ti dnum_t, [len(i), BLOCK_V]) and to dk_i / scale (Σ_t ds_ti q_t,
    [len(i), BLOCK_D]) of keys i (tiles k_tile, v_tile), counting the pairs in `allowed` [len(t), len(i)]."""
    q_tile = load_tile(q + (token0 * H + h) * D, t, T, H * D, tl.arange(0, BLOCK_D), D)
    dnum_tile, dden_rows, max_rows, argmax_rows, d_max_rows = _window_load_row_grads(
        dnum, dden, row_max, row_argmax, d_max, token0, t, T, h, H, V, BLOCK_V
    )
    scores = tl.where(allowed, dot(q_tile, tl.trans(k_tile), BF16_DOT) * scale, float("-inf"))
    p, ds = _window_score_grads(scores, allowed, i, max_rows, argmax_rows, d_max_rows, dnum_tile, dden_rows, v_tile,
                                BF16_DOT)
    return dot(tl.trans(p), dnum_tile, BF16_DOT), dot(tl.trans(ds), q_tile, BF16_DOT)


@triton.jit
def _window_reach(i, window, BLOCK_N: tl.constexpr):
    """The first query past the window reach of key i's block of BLOCK_N keys (blocks from token 0): the queries of
    `_window_dkdv_kernel`'s program for that block stop there."""
    return (i // BLOCK_N) * BLOCK_N + BLOCK_N - 1 + window


@triton.autotune(configs=autotune_configs(), key=["D", "V"], prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _window_dkdv_kernel(
    q, k, v, dnum, dden, row_max, row_argmax, d_max, sink_dk, sink_dv, dk, dv, bounds, scale, T, window, sinks,
    H: tl.constexpr, D: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, SINK_GRADS: tl.constexpr, BF16_DOT: tl.constexpr,
):
    """dk_i = scale · Σ_t ds_ti q_t and dv_i = Σ_t p_ti dnum_t for a block of keys (ds, p as in `_window_dq_kernel`).

    The queries visited: from the block's first key to the window's reach past its last key (`_window_reach`), sink
    keys included; the queries past the reach that attend to the sinks are `_window_sink_dkdv_kernel`'s, whose sums
    sink_dk [B, sinks, H, D] (without the scale) and sink_dv [B, sinks, H, V] (fp32, sink j of a row at token lo + j)
    are added here if SINK_GRADS. Shapes as in `_window_fwd_kernel`; dk: [B, T, H, D], dv: [B, T, H, V].
    Grid: (T / BLOCK_N, B · H).
    """
    pid, row, h, lo, hi, sink_end = _window_setup(bounds, sinks, H)
    first = pid * BLOCK_N
    i = first + tl.arange(0, BLOCK_N)
    token0 = row.to(tl.int64) * T
    dd, vv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_V)
    k_tile = load_tile(k + (token0 * H + h) * D, i, T, H * D, dd, D)
    v_tile = load_tile(v + (token0 * H + h) * V, i, T, H * V, vv, V)
    if SINK_GRADS:  # the accumulators start from the sinks' sums past the reach (zero for the other keys)
        sink = i - lo  # the keys' ranks among the row's sinks
        is_sink = ((sink >= 0) & (i < sink_end))[:, None]
        sink_base = row.to(tl.int64) * sinks * H + h
        dk_acc = tl.load(sink_dk + sink_base * D + tile_offsets(sink, H * D, dd), mask=is_sink & (dd < D)[None, :],
                         other=0.0)
        dv_acc = tl.load(sink_dv + sink_base * V + tile_offsets(sink, H * V, vv), mask=is_sink & (vv < V)[None, :],
                         other=0.0)
    else:
        dk_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv_acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    q_stop = tl.minimum(hi, _window_reach(first, window, BLOCK_N))
    for q_first in range(tl.maximum(first, lo), q_stop, BLOCK_M):
        t = q_first + tl.arange(0, BLOCK_M)
        # The last block may run past q_stop: the window keeps those queries from the other keys, not from sinks.
        allowed = _window_mask(t, i, lo, q_stop, sink_end, window)
        dv_part, dk_part = _window_key_block_grads(
            q, dnum, dden, row_max, row_argmax, d_max, token0, t, i, allowed, k_tile, v_tile, scale, T, h, H, D, V,
            BLOCK_D, BLOCK_V, BF16_DOT,
        )
        dv_acc += dv_part
        dk_acc += dk_part
    store_tile(dk + (token0 * H + h) * D, dk_acc * scale, i, T, H * D, dd, D)
    store_tile(dv + (token0 * H + h) * V, dv_acc, i, T, H * V, vv, V)


@triton.autotune(configs=autotune_configs(), key=["D", "V"], prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _window_sink_dkdv_kernel(
    q, k, v, dnum, dden, row_max, row_argmax, d_max, sink_dk, sink_dv, bounds, scale, T, window, sinks, slice_blocks,
    H: tl.constexpr, D: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    DKDV_BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, BF16_DOT: tl.constexpr,
):
    """The sink keys' dk_i / scale and dv_i (as in `_window_dkdv_kernel`) from the queries past the window reach of
    their blocks of DKDV_BLOCK_N keys (`_window_reach`), which `_window_dkdv_kernel` leaves out: without this kernel
    the program of the sinks' block would run through every query of the row while the others stop after a window.

    The queries from the first sink's reach to the row's end are cut into slices of slice_blocks blocks of BLOCK_M
    queries; a program takes one slice and BLOCK_S sinks and stores their sums, zeros included, to sink_dk
    [B, slices, sinks, H, D] and sink_dv [B, slices, sinks, H, V] (fp32; sink j of a row is its token lo + j), which
    the host sums over the slices. Other shapes as in `_window_fwd_kernel`. Grid: (slices, B · H, sinks / BLOCK_S).
    """
    tl.static_assert(BLOCK_S >= 16)  # the smallest tile of tl.dot
    tl.static_assert(BLOCK_S <= DKDV_BLOCK_N)  # no more accumulator rows than `_window_dkdv_kernel` holds
    slice_id, row, h, lo, hi, sink_end = _window_setup(bounds, sinks, H)
    sink = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)  # the keys' ranks among the row's sinks
    i = lo + sink
    token0 = row.to(tl.int64) * T
    dd, vv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_V)
    k_tile = load_tile(k + (token0 * H + h) * D, i, sink_end, H * D, dd, D)
    v_tile = load_tile(v + (token0 * H + h) * V, i, sink_end, H * V, vv, V)
    reach = _window_reach(i, window, DKDV_BLOCK_N)
    dk_acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    dv_acc = tl.zeros([BLOCK_S, BLOCK_V], dtype=tl.float32)
    q_start = _window_reach(lo, window, DKDV_BLOCK_N) + slice_id * slice_blocks * BLOCK_M
    for q_first in range(q_start, tl.minimum(hi, q_start + slice_blocks * BLOCK_M), BLOCK_M):
        t = q_first + tl.arange(0, BLOCK_M)
        allowed = (t[:, None] >= reach[None, :]) & (t < hi)[:, None] & (i < sink_end)[None, :]
        dv_part, dk_part = _window_key_block_grads(
            q, dnum, dden, row_max, row_argmax, d_max, token0, t, i, allowed, k_tile, v_tile, scale, T, h, H, D, V,
            BLOCK_D, BLOCK_V, BF16_DOT,
        )
        dv_acc += dv_part
        dk_acc += dk_part
    base = (row.to(tl.int64) * tl.num_programs(0) + slice_id) * sinks * H + h  # [row, slice, sink 0, h]
    store_tile(sink_dk + base * D, dk_acc, sink, sinks, H * D, dd, D)
    store_tile(sink_dv + base * V, dv_acc, sink, sinks, H * V, vv, V)


# ---------------------------------------------------------------------------------------------------------------
# Launchers and autograd
# ---------------------------------------------------------------------------------------------------------------


def _window_blocks(head_dim: int) -> dict:
    """{kernel: (BLOCK_M queries, BLOCK_N keys)} of the window kernels for head dims D, V ≤ head_dim: WINDOW_BLOCK
    (half that past 128), halved where an sm_90 compile spills registers otherwise: the key blocks of dq, the query
    blocks of dkdv, and its key blocks past 64. The sink kernel takes dkdv's query blocks and SINK_BLOCK sinks."""
    block = WINDOW_BLOCK if head_dim <= 128 else WINDOW_BLOCK // 2
    half = block // 2
    dkdv = (half, block if head_dim <= 64 else half)
    return {"fwd": (block, block), "dq": (block, half), "dkdv": dkdv, "sink_dkdv": (dkdv[0], SINK_BLOCK)}


def _sink_slice_blocks(window: int, block_m: int, block_n: int) -> int:
    """Query blocks per slice of `_window_sink_dkdv_kernel`: as many as a `_window_dkdv_kernel` program visits (its
    key block and the window), at least SINK_SLICE_MIN_BLOCKS (which bounds the slices' partial sums)."""
    return max(triton.cdiv(block_n - 1 + window, block_m), SINK_SLICE_MIN_BLOCKS)


def _window_sink_grads(q, k, v, grads, bounds, blocks: dict, launch: dict) -> tuple[Tensor, Tensor] | None:
    """The sink keys' dk / scale and dv from the queries past their blocks' window reach (see
    `_window_sink_dkdv_kernel`): fp32 [B, sinks, H, D] and [B, sinks, H, V], the slices summed in a fixed order (no
    atomics: the same bits every run); None without sinks or without such queries (T within one block's reach)."""
    batch, length, heads = q.shape[:3]
    block_m, block_s = blocks["sink_dkdv"]
    block_n = blocks["dkdv"][1]
    slice_blocks = _sink_slice_blocks(launch["window"], block_m, block_n)
    # The first sink's reach is at least that of token 0's block: past it, at most this many queries of any row.
    queries = length - (block_n - 1 + launch["window"])
    sinks = launch["sinks"]
    if sinks == 0 or queries <= 0:
        return None
    slices = triton.cdiv(queries, slice_blocks * block_m)
    sink_dk = q.new_empty(batch, slices, sinks, heads, launch["D"], dtype=torch.float32)
    sink_dv = q.new_empty(batch, slices, sinks, heads, launch["V"], dtype=torch.float32)
    _window_sink_dkdv_kernel[(slices, batch * heads, triton.cdiv(sinks, block_s))](
        q, k, v, *grads, sink_dk, sink_dv, bounds, slice_blocks=slice_blocks, BLOCK_M=block_m, BLOCK_S=block_s,
        DKDV_BLOCK_N=block_n, **launch,
    )
    return sink_dk.sum(1), sink_dv.sum(1)


class _WindowSoftmax(torch.autograd.Function):
    """(num, den) of the window softmax part, fp32 [B, T, H, V] and [B, T, H] (see `_window_fwd_kernel`)."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, scale, window, sinks):
        batch, length, heads, head_dim = q.shape
        value_dim = v.shape[-1]
        num = v.new_empty(v.shape, dtype=torch.float32)
        den, row_max = (q.new_empty(batch, length, heads, dtype=torch.float32) for _ in range(2))
        row_argmax = q.new_empty(batch, length, heads, dtype=torch.int32)
        ctx.blocks = _window_blocks(max(head_dim, value_dim))
        ctx.launch = dict(
            scale=scale, T=length, window=window, sinks=sinks, H=heads, D=head_dim, V=value_dim,
            BLOCK_D=block_size(head_dim, 256), BLOCK_V=block_size(value_dim, 256),
            BF16_DOT=q.dtype == torch.bfloat16 and not INTERPRET,
        )
        block_m, block_n = ctx.blocks["fwd"]
        _window_fwd_kernel[(triton.cdiv(length, block_m), batch * heads)](
            q, k, v, num, den, row_max, row_argmax, bounds, BLOCK_M=block_m, BLOCK_N=block_n, **ctx.launch
        )
        ctx.save_for_backward(q, k, v, bounds, num, den, row_max, row_argmax)
        return num, den

    @staticmethod
    def backward(ctx, dnum, dden):
        q, k, v, bounds, num, den, row_max, row_argmax = ctx.saved_tensors
        dnum, dden = dnum.contiguous(), dden.contiguous()
        # num and den scale as e^{−c}: the gradient w.r.t. c, which reaches the argmax key's score.
        d_max = -((dnum * num).sum(-1) + dden * den)
        grads = (dnum, dden, row_max, row_argmax, d_max)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        batch, length, heads = q.shape[:3]
        block_m, block_n = ctx.blocks["dq"]  # a program per BLOCK_M queries
        _window_dq_kernel[(triton.cdiv(length, block_m), batch * heads)](
            q, k, v, *grads, dq, bounds, BLOCK_M=block_m, BLOCK_N=block_n, **ctx.launch
        )
        sink_grads = _window_sink_grads(q, k, v, grads, bounds, ctx.blocks, ctx.launch)
        block_m, block_n = ctx.blocks["dkdv"]  # a program per BLOCK_N keys
        _window_dkdv_kernel[(triton.cdiv(length, block_n), batch * heads)](
            q, k, v, *grads, *(sink_grads or (d_max, d_max)), dk, dv, bounds, BLOCK_M=block_m, BLOCK_N=block_n,
            SINK_GRADS=sink_grads is not None, **ctx.launch,
        )
        return dq, dk, dv, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Backend entry point (arguments already validated by `ops.window_attention`)
# ---------------------------------------------------------------------------------------------------------------


def triton_window_attention(
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
    """Sliding-window softmax + linear attention in Triton: arguments and results as
    `ops_chunked.chunk_window_attention` (log_decay: None or [B, T, H, 1 | F], decaying the linear part). The
    softmax head dims D and V must be ≤ MAX_WINDOW_HEAD_DIM."""
    batch, length = q.shape[:2]
    bounds = real_token_bounds(key_padding_mask, batch, length, q.device)

    # Linear part: the linear kernels on delayed keys and values (see `window_linear_inputs`), decayed at the
    # queries' steps, with the normaliser (a ones value column: where the delay leaves no value, the key is zero).
    real, sink = window_token_masks(key_padding_mask, batch, length, num_sink_tokens, q.device)
    k_older, v_older = window_linear_inputs(k_feat, v, real, sink, window_size)
    linear, linear_den, state = linear_sums(
        q_feat, k_older, v_older, log_decay, initial_state, scale=1.0, chunks=batch_chunks(batch, length, q.device),
        out_dtype=torch.float32, normalize=True,
    )

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    num, den = _WindowSoftmax.apply(q, k, v, bounds, scale, min(window_size, length), num_sink_tokens)
    gamma = torch.sigmoid(window_gate.float())
    o = divide_at_real_queries(
        gamma[:, None] * num + linear, (gamma * den + linear_den)[..., None], real[..., None, None]
    )
    return o.to(v.dtype), state if output_final_state else None
