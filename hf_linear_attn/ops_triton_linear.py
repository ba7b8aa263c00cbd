"""Triton kernels of `linear_attention` (backend "triton"): chunked linear attention, forward and backward.

Same arguments, results and state layout as the torch chunked backend (`ops_chunked`). Inputs may be float16,
bfloat16 or float32; every sum is float32, and so are the states, except the chunk-boundary states of the forward
pass for bfloat16 inputs (bfloat16, see `_states_dtype`). Memory layout, chunk tables, tile helpers and the
interpreter guard are those of `ops_triton_common`. `ops_triton_window` runs its linear part on `linear_sums`, and
`ops_triton_delta_rule` its output on `chunk_output`.

Chunked linear attention
------------------------
Batch rows, or the sequences of a packed row (cu_seqlens), are cut into chunks of CHUNK_SIZE tokens. Inside a
chunk, with b_t = Σ_{s ≤ t} log_decay_s (cumulative from the chunk start; [.., 1] per head or [.., K] per key
dim; no decay is b = 0), q̂ = scale·q, S the state entering the chunk and S' the one leaving it:

    o_t  = (q̂_t ⊙ e^{b_t})ᵀ S + Σ_{i ≤ t} A_ti v_i,        A_ti = Σ_k q̂_tk k_ik e^{b_tk − b_ik}
    S'   = e^{b_last} ⊙ S + Σ_i (k_i ⊙ e^{b_last − b_i}) v_iᵀ
    dS   = e^{b_last} ⊙ dS' + Σ_t (q̂_t ⊙ e^{b_t}) do_tᵀ
    dv_i = (k_i ⊙ e^{b_last − b_i})ᵀ dS' + Σ_{t ≥ i} A_ti do_t
    dq̂_t = e^{b_t} ⊙ (S do_t) + Σ_{i ≤ t} dA_ti k_i ⊙ e^{b_t − b_i},        dA_ti = do_t · v_i
    dk_i = e^{b_last − b_i} ⊙ (dS' v_i) + Σ_{t ≥ i} dA_ti q̂_t ⊙ e^{b_t − b_i}
    d log_decay_t = Σ_{s ≥ t} (q̂_s ⊙ dq̂_s − k_s ⊙ dk_s) + Σ_v S' ⊙ dS'   (summed over K for a per-head decay)

Kernels: `ops_triton_common.chunk_cumsum` (b), `_state_pass_kernel` (S through the chunks of each sequence; dS
backwards), `_chunk_output_kernel` (o; transposed, dv), `_chunk_dqk_kernel` (dq, dk and the decay gradient) and,
for the per-key-dim decay, `_vector_scores_kernel` (A) and `_vector_grads_kernel` (the intra-chunk part of dq̂
and dk, and the decay gradient). Gradients leave the kernels in the inputs' dtypes, scale folded into dq; the
decay gradient (its in-chunk reverse sum included) is computed only when log_decay needs one.
b is non-increasing inside a chunk, so every exponent above is ≤ 0 and nothing overflows, however strong the
decay — except e^{b_tk − b_ik} inside A for a per-key-dim decay, which cannot be split into e^{b_t}·e^{−b_i}:
there sub-chunks of VECTOR_SUB_CHUNK rows factor it around a reference r between i and t (e^{b_t − r}·e^{r − b_i},
both ≤ 1), and the diagonal sub-blocks use the explicit [SUB, SUB, K] decay. The normaliser of normalize=True is
the output of an all-ones value column, carried beside the values rather than as a (V + 1)-th one: its state is a
K-vector z per chunk (a V = 1 state pass), its output den_t = (q̂_t ⊙ e^{b_t})·z_j + Σ_{i ≤ t} A_ti comes from the
first V block of the output kernel, and the dq/dk kernel adds its terms; V keeps its width (128: two 64-wide
blocks, not three).
"""

import torch
from torch import Tensor

from .ops_common import CHUNK_SIZE, NORM_EPS
from .ops_triton_common import (
    DECAY_NONE,
    DECAY_SCALAR,
    DECAY_VECTOR,
    HAS_TRITON,
    INTERPRET,
    LOG_DECAY_FLOOR,
    Chunks,
    autotune_configs,
    batch_chunks,
    block_size,
    causal_decay,
    chunk_bounds,
    chunk_cumsum,
    decay_mode,
    dot,
    launch_warps,
    load_decay,
    load_tile,
    packed_chunks,
    start_state_pass,
    state_base,
    store_tile,
    tile_offsets,
    tl,
    triton,
    usable_configs,
)

__all__ = ["chunk_output", "linear_sums", "triton_linear_attention"]

# Per-key-dim decay: rows per sub-chunk of the intra-chunk products, one program each (the torch backend's
# sub-blocks are smaller, to bound its explicit decay tensors); must divide CHUNK_SIZE.
VECTOR_SUB_CHUNK = 16


# The BLOCK_V values `_dqk_configs` offers on a GPU; `_dqk_value_width` picks one of them.
DQK_VALUE_WIDTHS = (64, 128)


def _dqk_configs() -> list:
    """Launch configurations of `_chunk_dqk_kernel`: a BLOCK_V for V, see `_dqk_value_blocks`, at 8 warps and 2
    stages (an sm_90 compile at K = V = 128 spills registers with 4 warps, up to 1.8 KB, with 128-wide K blocks, and
    with 3 stages when the V loop runs more than once), and for head dims below 64 the 64-wide block at 4 warps (8
    faulted there, see `ops_triton_common.launch_warps`). One under the interpreter."""
    if not HAS_TRITON:
        return []
    if INTERPRET:
        return [triton.Config({"BLOCK_V": 64}, num_warps=4, num_stages=1)]
    return [*(triton.Config({"BLOCK_V": bv}, num_warps=8, num_stages=2) for bv in DQK_VALUE_WIDTHS),
            triton.Config({"BLOCK_V": 64}, num_warps=4, num_stages=2)]


def _dqk_value_width(value_dim: int, element_size: int) -> int:
    """BLOCK_V of `_chunk_dqk_kernel`, one of DQK_VALUE_WIDTHS: one 128-wide value block for 16-bit inputs with
    64 < V ≤ 128, 64-wide blocks otherwise (64-wide ones spill at V = 128 for the per-key-dim decay, 128-wide ones
    past V = 128; fp32 128-wide tiles need more than sm_90's shared memory). At V ≤ 64 the block stays 64 wide (its
    columns past V masked): a narrower one, as 16-bit inputs with V ≤ 32 once got, matched no config and left the
    autotuner none (on an H200 every such backward stopped with Triton's AutotunerError)."""
    return 128 if element_size <= 2 and 64 < value_dim <= 128 else 64


def _dqk_key_width(key_dim: int, value_dim: int, extra_terms: bool) -> int:
    """BLOCK_K of `_chunk_dqk_kernel`: 64, or 32 where a 64-wide K block spills registers on sm_90: three fp32
    [CHUNK, 64] accumulators and extra terms (the per-head decay gradient, the normaliser's), or a V loop of several
    64-wide blocks."""
    return block_size(key_dim, 32 if extra_terms or value_dim > 128 else 64)


def _dqk_value_blocks(configs: list, named_args: dict, **kwargs) -> list:
    """The config the autotuner may pick for this K and V: `_dqk_value_width`'s block at `launch_warps`' warps; any
    under the interpreter."""
    width = _dqk_value_width(kwargs["V"], named_args["q"].element_size())
    warps = launch_warps(K=kwargs["K"], V=kwargs["V"])
    return [c for c in configs if INTERPRET or (c.kwargs["BLOCK_V"] == width and c.num_warps == warps)]


# ---------------------------------------------------------------------------------------------------------------
# Device helpers of the per-key-dim decay
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _sub_chunk_decay(b, SUB: tl.constexpr):
    """[t, i, k] = e^{b_tk − b_ik} for i ≤ t, else 0, inside one sub-chunk; b: [SUB, BLOCK_K]."""
    local = tl.arange(0, SUB)
    causal = (local[:, None] >= local[None, :])[:, :, None]
    return tl.where(causal, tl.exp(tl.minimum(b[:, None, :] - b[None, :, :], 0.0)), 0.0)


@triton.jit
def _sub_chunk_grads(dA_diagonal, q_rows, k_rows, b_rows, SUB: tl.constexpr):
    """The pairs inside one sub-chunk of the per-key-dim decay gradients, one key i at a time:
    dq̂_t += Σ_{i ≤ t} dA_ti k_i ⊙ e^{b_t − b_i} and dk_i += Σ_{t ≥ i} dA_ti q̂_t ⊙ e^{b_t − b_i}.
    dA_diagonal: [SUB (t), SUB (i)]; q_rows (q̂), k_rows, b_rows: [SUB, BLOCK_K]. Returns the two [SUB, BLOCK_K] sums.
    [SUB, BLOCK_K] tiles only: the [SUB, SUB, BLOCK_K] products of `_sub_chunk_decay` spill registers on sm_90."""
    local = tl.arange(0, SUB)
    dq_part = tl.zeros(q_rows.shape, dtype=tl.float32)
    dk_part = tl.zeros(q_rows.shape, dtype=tl.float32)
    for i in range(SUB):
        row_i = (local == i)[:, None]
        k_i = tl.sum(tl.where(row_i, k_rows, 0.0), axis=0)[None, :]  # [1, BLOCK_K]
        b_i = tl.sum(tl.where(row_i, b_rows, 0.0), axis=0)[None, :]
        dA_i = tl.sum(tl.where((local == i)[None, :], dA_diagonal, 0.0), axis=1)[:, None]  # [SUB, 1]: dA_ti
        weights = tl.where((local >= i)[:, None], dA_i * tl.exp(tl.minimum(b_rows - b_i, 0.0)), 0.0)
        dq_part += weights * k_i
        dk_part += tl.where(row_i, tl.sum(weights * q_rows, axis=0)[None, :], 0.0)
    return dq_part, dk_part


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.autotune(configs=autotune_configs(), key=["K", "V", "DECAY", "REVERSE", "HAS_INIT", "work_bucket"],
                 prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _state_pass_kernel(
    outer_k, outer_v, b, init, states, last, seq_info, outer_k_scale, work_bucket,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DECAY: tl.constexpr, REVERSE: tl.constexpr,
    HAS_INIT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BF16_DOT: tl.constexpr,
):
    """Carries each sequence's state through its chunks and stores it at every chunk boundary.

    The state is a decayed sum of outer products outer_k_t outer_v_tᵀ (scaled by outer_k_scale), either way:
    Forward (REVERSE=0; outer_k = k, outer_v = v): S_0 = init (or 0),
        S_{j+1} = e^{b_last} ⊙ S_j + Σ_t (k_t ⊙ e^{b_last − b_t}) v_tᵀ;
    slot first + j receives S_j for j = 0 … n − 1 (n chunks), `last` the final state S_n.
    Reverse (REVERSE=1; outer_k = q, outer_v = do, outer_k_scale = scale): dS_n = init (the final state's
    gradient, or 0),
        dS_j = e^{b_last} ⊙ dS_{j+1} + Σ_t (scale·q_t ⊙ e^{b_t}) do_tᵀ;
    slot first + j receives dS_j for j = 1 … n, `last` dS_0 (the initial state's gradient).
    outer_k: [tokens, H, K]; outer_v: [tokens, H, V]; b: fp32 [tokens, H, 1 | K] or unused; init: [sequences, H,
    K, V]; states: [slots, H, K, V] in any float dtype (sums stay fp32); last: fp32 [sequences, H, K, V]; seq_info:
    int32 [sequences, 3] (first token, end token, first slot).
    work_bucket (unread) keys the autotuner: tokens · H rounded to a power of two.
    Grid: (K / BLOCK_K, V / BLOCK_V, sequences · H); a program owns one [BLOCK_K, BLOCK_V] tile of one state.
    """
    tl.static_assert((REVERSE == 0) or (REVERSE == 1))  # also the offset of a state slot below
    h, kk, vv, first_token, end_token, first_slot, num_chunks, state = start_state_pass(
        seq_info, init, tl.program_id(0), tl.program_id(1), tl.program_id(2), H, K, V, HAS_INIT, CHUNK, BLOCK_K,
        BLOCK_V,
    )
    for i in range(num_chunks):
        if REVERSE:
            j = num_chunks - 1 - i
        else:
            j = i
        store_tile(state_base(states, first_slot + j + REVERSE, h, H, K, V), state, kk, K, V, vv, V)
        start = first_token + j * CHUNK
        end = tl.minimum(start + CHUNK, end_token)
        rows = start + tl.arange(0, CHUNK)
        k_tile = load_tile(outer_k + h * K, rows, end, H * K, kk, K).to(tl.float32) * outer_k_scale
        b_rows = load_decay(b, h, rows, end, kk, H, K, DECAY)
        b_last = load_decay(b, h, end - 1 + tl.arange(0, 1), end, kk, H, K, DECAY)
        if REVERSE:
            k_tile = k_tile * tl.exp(b_rows)
        else:
            k_tile = k_tile * tl.exp(b_last - b_rows)
        v_tile = load_tile(outer_v + h * V, rows, end, H * V, vv, V)
        state = state * tl.exp(tl.trans(b_last)) + dot(tl.trans(k_tile), v_tile, BF16_DOT)
    store_tile(state_base(last, tl.program_id(2) // H, h, H, K, V), state, kk, K, V, vv, V)


@triton.autotune(configs=autotune_configs(), key=["K", "BLOCK_K"],
                 prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _vector_scores_kernel(
    q, k, b, scores, chunk_info, scale,
    H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr,
    BF16_DOT: tl.constexpr,
):
    """A_ti = Σ_k q̂_tk k_ik e^{b_tk − b_ik} for i ≤ t (0 above the diagonal) in each chunk, per-key-dim decay.

    scores: fp32 [tokens, H, CHUNK]; the row of token t holds A_t· against the keys of its chunk. A program fills the
    rows of one sub-chunk m of queries. Keys of earlier sub-chunks: e^{b_t − b_i} = e^{b_t − r}·e^{r − b_i} with r = b
    at the sub-chunk's first query, so one dot; keys of sub-chunk m itself: the explicit masked decay.
    Grid: (chunks, H, CHUNK / SUB).
    """
    tl.static_assert(CHUNK % SUB == 0)
    chunk, h, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end, _ = chunk_bounds(chunk_info, chunk)
    rows = start + m * SUB + tl.arange(0, SUB)
    keys = start + tl.arange(0, CHUNK)
    reference = tl.minimum(start + m * SUB, end - 1) + tl.arange(0, 1)
    earlier = (tl.arange(0, CHUNK) < m * SUB)[:, None]
    off_diagonal = tl.zeros([SUB, CHUNK], dtype=tl.float32)
    diagonal = tl.zeros([SUB, SUB], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        q_rows = load_tile(q + h * K, rows, end, H * K, kk, K).to(tl.float32) * scale
        b_rows = load_decay(b, h, rows, end, kk, H, K, DECAY_VECTOR)
        r = load_decay(b, h, reference, end, kk, H, K, DECAY_VECTOR)
        k_keys = load_tile(k + h * K, keys, end, H * K, kk, K).to(tl.float32)
        b_keys = load_decay(b, h, keys, end, kk, H, K, DECAY_VECTOR)
        k_keys = tl.where(earlier, k_keys * tl.exp(tl.minimum(r - b_keys, 0.0)), 0.0)
        q_ref = q_rows * tl.exp(tl.minimum(b_rows - r, 0.0))
        off_diagonal += dot(q_ref, tl.trans(k_keys), BF16_DOT)
        k_rows = load_tile(k + h * K, rows, end, H * K, kk, K).to(tl.float32)
        diagonal += tl.sum(q_rows[:, None, :] * k_rows[None, :, :] * _sub_chunk_decay(b_rows, SUB), axis=2)
    # Two stores to disjoint columns: the off-diagonal tile (zero right of the diagonal block), then the diagonal block.
    cols = tl.arange(0, CHUNK)
    outside = (cols < m * SUB) | (cols >= m * SUB + SUB)
    base = scores + h * CHUNK
    tl.store(base + tile_offsets(rows, H * CHUNK, cols), off_diagonal, mask=(rows < end)[:, None] & outside[None, :])
    store_tile(base, diagonal, rows, end, H * CHUNK, m * SUB + tl.arange(0, SUB), CHUNK)


@triton.autotune(configs=autotune_configs(), key=["K", "V", "DECAY", "TRANSPOSE", "HAS_STATE"],
                 prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _chunk_output_kernel(
    row_k, col_k, col_v, b, scores, states, out, norm_states, den, chunk_info, row_scale, col_scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DECAY: tl.constexpr, TRANSPOSE: tl.constexpr,
    HAS_STATE: tl.constexpr, NORM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BF16_DOT: tl.constexpr,
):
    """Each chunk's output: the contribution of a carried state plus the masked intra-chunk product.

    Output row r reads the state with row_k_r and sums col_v over the columns c of the chunk, weighted by the
    decayed, masked scores of row_k_r against col_k_c (row_scale and col_scale scale row_k and col_k):
    Forward (TRANSPOSE=0; rows: queries, row_k = q, col_k = k, col_v = v, states S):
        o_t  = (q̂_t ⊙ e^{b_t})ᵀ S_j + Σ_{i ≤ t} A_ti v_i
    Backward (TRANSPOSE=1; rows: keys, row_k = k, col_k = q, col_v = do, states dS):
        dv_i = (k_i ⊙ e^{b_last − b_i})ᵀ dS_{j+1} + Σ_{t ≥ i} A_ti do_t
    (q̂ = scale·q.) A = (q̂ kᵀ) ⊙ e^{b_t − b_i} masked, for no or per-head decay; read from `scores`
    (`_vector_scores_kernel`) for the per-key-dim decay. Without HAS_STATE the state term is left out (states
    unused): the intra-chunk product alone.
    If NORM (forward only), the programs of the first V block also store the normaliser, the output of a ones value
    column whose states z_j are the K-vectors norm_states: den_t = (q̂_t ⊙ e^{b_t})·z_j + Σ_{i ≤ t} A_ti.
    row_k, col_k: [tokens, H, K]; col_v, out: [tokens, H, V]; states: [slots, H, K, V] (fp32; bf16 forward states
    for bf16 inputs); norm_states: [slots, H, K] (same dtype); den: fp32 [tokens, H]; chunk_info: int32 [chunks,
    3]. Grid: (chunks, H, V / BLOCK_V).
    """
    tl.static_assert((not NORM) or (not TRANSPOSE))
    chunk, h, pid_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end, slot = chunk_bounds(chunk_info, chunk)
    rows = start + tl.arange(0, CHUNK)
    vv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    state = state_base(states, slot + TRANSPOSE, h, H, K, V)
    acc = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    den_acc = tl.zeros([CHUNK], dtype=tl.float32)
    scores_tile = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        row_tile = load_tile(row_k + h * K, rows, end, H * K, kk, K).to(tl.float32) * row_scale
        b_rows = load_decay(b, h, rows, end, kk, H, K, DECAY)
        if TRANSPOSE:
            b_last = load_decay(b, h, end - 1 + tl.arange(0, 1), end, kk, H, K, DECAY)
            weight = tl.exp(b_last - b_rows)
        else:
            weight = tl.exp(b_rows)
        if HAS_STATE:
            acc += dot(row_tile * weight, load_tile(state, kk, K, V, vv, V), BF16_DOT)
        if NORM:
            z = tl.load(state_base(norm_states, slot, h, H, K, 1) + kk, mask=kk < K, other=0.0).to(tl.float32)
            den_acc += tl.sum(row_tile * weight * z[None, :], axis=1)
        if DECAY != DECAY_VECTOR:
            col_tile = load_tile(col_k + h * K, rows, end, H * K, kk, K).to(tl.float32) * col_scale
            scores_tile += dot(row_tile, tl.trans(col_tile), BF16_DOT)
    if DECAY == DECAY_VECTOR:
        scores_tile = load_tile(scores + h * CHUNK, rows, end, H * CHUNK, tl.arange(0, CHUNK), CHUNK)
        if TRANSPOSE:
            scores_tile = tl.trans(scores_tile)
    else:
        scores_tile *= causal_decay(load_decay(b, h, rows, end, 0, H, K, DECAY), TRANSPOSE, CHUNK)
    acc += dot(scores_tile, load_tile(col_v + h * V, rows, end, H * V, vv, V), BF16_DOT)
    store_tile(out + h * V, acc, rows, end, H * V, vv, V)
    if NORM:
        if pid_v == 0:
            tl.store(den + rows.to(tl.int64) * H + h, den_acc + tl.sum(scores_tile, axis=1), mask=rows < end)


@triton.autotune(configs=_dqk_configs(), key=["K", "V", "DECAY", "DECAY_GRAD", "work_bucket"],
                 prune_configs_by={"early_config_prune": _dqk_value_blocks})
@triton.jit
def _chunk_dqk_kernel(
    q, k, v, do, log_decay, b, states, dstates, norm_states, d_norm_states, d_den, dq, dk, dA, state_term,
    d_log_decay, chunk_info, scale, tokens, work_bucket,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DECAY: tl.constexpr, DECAY_GRAD: tl.constexpr,
    NORM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BF16_DOT: tl.constexpr,
):
    """dq = scale · dq̂ (dq̂: the gradient w.r.t. q̂ = scale·q) and dk of each chunk, for one block of K, looping
    over V:

        dq̂_t = e^{b_t} ⊙ (S_j do_t) + Σ_{i ≤ t} dA_ti k_i ⊙ e^{b_t − b_i},          dA_ti = do_t · v_i
        dk_i = e^{b_last − b_i} ⊙ (dS_{j+1} v_i) + Σ_{t ≥ i} dA_ti q̂_t ⊙ e^{b_t − b_i}

    and, if DECAY_GRAD, the decay gradient. Its state term Σ_v S_{j+1} ⊙ dS_{j+1} comes without reading S_{j+1}:
    S_{j+1} = e^{b_last} ⊙ S_j + Σ_i (k_i ⊙ e^{b_last − b_i}) v_iᵀ makes it e^{b_last} ⊙ Σ_v S_j ⊙ dS_{j+1} +
    Σ_i k_i ⊙ (the state part of dk_i). Per-head decay: d_log_decay (fp32 [K / BLOCK_K, tokens, H], one partial
    sum per K block; in log_decay's dtype when one block covers K) receives Σ_{s ≥ t} Σ_k (q̂_s dq̂_s − k_s dk_s)
    + the state term, summed over the block's k, and 0 where log_decay (its raw values, [tokens, H]) is below
    LOG_DECAY_FLOOR. Per-key-dim decay: the intra-chunk sums are left to
    `_vector_grads_kernel`; dq, dk (fp32 [tokens, H, K]) receive the state parts only (dq̂, unscaled), dA (fp32
    [tokens, H, CHUNK], like `scores`) and the state term (fp32 [chunks, H, K]) are stored for it.
    Otherwise dq, dk are in q's and k's dtypes. If NORM, the normaliser's ones value column takes part as a
    (V + 1)-th one: its states z_j (norm_states, [slots, H, K]), their gradients dz_j (d_norm_states, fp32 [slots,
    H, K]) and the gradient d_den (fp32 [tokens, H]) of its output; it adds d_den_t z_j to S_j do_t, dz_{j+1} to
    dS_{j+1} v_i, d_den_t to dA_ti and z_j ⊙ dz_{j+1} to the state term. work_bucket (unread) keys the autotuner:
    the program count rounded to a power of two. Grid: (chunks, H, K / BLOCK_K).
    """
    tl.static_assert((DECAY != DECAY_NONE) or (not DECAY_GRAD))
    chunk, h, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end, slot = chunk_bounds(chunk_info, chunk)
    rows = start + tl.arange(0, CHUNK)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    entering = state_base(states, slot, h, H, K, V)
    d_leaving = state_base(dstates, slot + 1, h, H, K, V)
    dq_acc = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
    dk_acc = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
    dA_acc = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    entering_term = tl.zeros([BLOCK_K], dtype=tl.float32)  # Σ_v S_j ⊙ dS_{j+1}
    for v0 in range(0, V, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        do_tile = load_tile(do + h * V, rows, end, H * V, vv, V)
        v_tile = load_tile(v + h * V, rows, end, H * V, vv, V)
        state = load_tile(entering, kk, K, V, vv, V)
        d_state = load_tile(d_leaving, kk, K, V, vv, V)
        dq_acc += dot(do_tile, tl.trans(state), BF16_DOT)
        dk_acc += dot(v_tile, tl.trans(d_state), BF16_DOT)
        dA_acc += dot(do_tile, tl.trans(v_tile), BF16_DOT)
        if DECAY_GRAD:
            entering_term += tl.sum(state.to(tl.float32) * d_state.to(tl.float32), axis=1)
    if NORM:
        z = tl.load(state_base(norm_states, slot, h, H, K, 1) + kk, mask=kk < K, other=0.0).to(tl.float32)
        dz = tl.load(state_base(d_norm_states, slot + 1, h, H, K, 1) + kk, mask=kk < K, other=0.0)
        d_den = tl.load(d_den + rows.to(tl.int64) * H + h, mask=rows < end, other=0.0)[:, None]  # [CHUNK, 1]
        dq_acc += d_den * z[None, :]
        dk_acc += dz[None, :]
        dA_acc += d_den
        if DECAY_GRAD:
            entering_term += z * dz
    b_rows = load_decay(b, h, rows, end, kk, H, K, DECAY)
    b_last = load_decay(b, h, end - 1 + tl.arange(0, 1), end, kk, H, K, DECAY)
    dq_acc *= tl.exp(b_rows)
    dk_acc *= tl.exp(b_last - b_rows)
    k_tile = load_tile(k + h * K, rows, end, H * K, kk, K)
    term = tl.zeros([1, BLOCK_K], dtype=tl.float32)
    if DECAY_GRAD:
        term = entering_term[None, :] * tl.exp(b_last) + tl.sum(k_tile.to(tl.float32) * dk_acc, axis=0)[None, :]
    if DECAY == DECAY_VECTOR:
        if DECAY_GRAD:
            tl.store(state_term + (chunk.to(tl.int64) * H + h) * K + kk[None, :], term, mask=(kk < K)[None, :])
        if pid_k == 0:
            store_tile(dA + h * CHUNK, dA_acc, rows, end, H * CHUNK, tl.arange(0, CHUNK), CHUNK)
        store_tile(dq + h * K, dq_acc, rows, end, H * K, kk, K)
    else:
        dA_acc *= causal_decay(b_rows, False, CHUNK)
        dq_acc += dot(dA_acc, k_tile, BF16_DOT)
        q_tile = load_tile(q + h * K, rows, end, H * K, kk, K).to(tl.float32) * scale
        dk_acc += dot(tl.trans(dA_acc), q_tile, BF16_DOT)
        if DECAY_GRAD:
            db = tl.sum(q_tile * dq_acc - k_tile.to(tl.float32) * dk_acc, axis=1)  # [CHUNK]: d/db_t, no state term
            d_log = tl.cumsum(db, axis=0, reverse=True) + tl.sum(term)
            raw = tl.load(log_decay + rows.to(tl.int64) * H + h, mask=rows < end, other=0.0)
            d_log = tl.where(raw.to(tl.float32) >= LOG_DECAY_FLOOR, d_log, 0.0)
            partial = d_log_decay + pid_k.to(tl.int64) * tokens * H
            tl.store(partial + rows.to(tl.int64) * H + h, d_log.to(d_log_decay.dtype.element_ty), mask=rows < end)
        store_tile(dq + h * K, dq_acc * scale, rows, end, H * K, kk, K)
    store_tile(dk + h * K, dk_acc, rows, end, H * K, kk, K)


@triton.autotune(configs=autotune_configs(), key=["K", "BLOCK_K", "DECAY_GRAD"],
                 prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _vector_grads_kernel(
    q, k, log_decay, b, dA, dq_state, dk_state, state_term, dq, dk, d_log_decay, chunk_info, scale,
    H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr,
    DECAY_GRAD: tl.constexpr, BF16_DOT: tl.constexpr,
):
    """dq = scale · (dq_state + the intra-chunk part of dq̂), dk = dk_state + that of dk, per-key-dim decay, by
    sub-chunks m of the chunk, last first:

        dq̂_t += Σ_{i ≤ t} dA_ti k_i ⊙ e^{b_t − b_i}   (the queries t of sub-chunk m)
        dk_i += Σ_{t ≥ i} dA_ti q̂_t ⊙ e^{b_t − b_i}   (the keys i of sub-chunk m)

    Earlier keys, and later queries, in one dot each around the reference r = b at the first, and the last, row of
    sub-chunk m (both factors ≤ 1); pairs inside sub-chunk m with the explicit decay. If DECAY_GRAD, also
    d_log_decay_t = Σ_{s ≥ t} (q̂_s ⊙ dq̂_s − k_s ⊙ dk_s) + the chunk's state term, the sum over later sub-chunks
    carried from one to the next, and 0 where log_decay (raw, [tokens, H, K]) is below LOG_DECAY_FLOOR.
    dq_state, dk_state: fp32 [tokens, H, K]; dA: fp32 [tokens, H, CHUNK]; state_term: fp32 [chunks, H, K]; dq, dk,
    d_log_decay: [tokens, H, K] in q's, k's and log_decay's dtypes.
    Grid: (chunks, H, K / BLOCK_K).
    """
    tl.static_assert(CHUNK % SUB == 0)
    chunk, h, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end, _ = chunk_bounds(chunk_info, chunk)
    local = tl.arange(0, CHUNK)
    chunk_rows = start + local
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    q_chunk = load_tile(q + h * K, chunk_rows, end, H * K, kk, K).to(tl.float32) * scale
    k_chunk = load_tile(k + h * K, chunk_rows, end, H * K, kk, K).to(tl.float32)
    b_chunk = load_decay(b, h, chunk_rows, end, kk, H, K, DECAY_VECTOR)
    later = tl.zeros([BLOCK_K], dtype=tl.float32)  # Σ over the rows of later sub-chunks, plus the state term
    if DECAY_GRAD:
        later = tl.load(state_term + (chunk.to(tl.int64) * H + h) * K + kk, mask=kk < K, other=0.0)
    for step in range(CHUNK // SUB):
        m = CHUNK // SUB - 1 - step
        rows = start + m * SUB + tl.arange(0, SUB)
        q_rows = load_tile(q + h * K, rows, end, H * K, kk, K).to(tl.float32) * scale
        k_rows = load_tile(k + h * K, rows, end, H * K, kk, K).to(tl.float32)
        b_rows = load_decay(b, h, rows, end, kk, H, K, DECAY_VECTOR)
        dA_rows = load_tile(dA + h * CHUNK, rows, end, H * CHUNK, local, CHUNK)  # [SUB, CHUNK]: dA_t· for t in m
        dA_cols = load_tile(dA + h * CHUNK, chunk_rows, end, H * CHUNK, m * SUB + tl.arange(0, SUB), CHUNK)  # dA_·i

        first = load_decay(b, h, tl.minimum(start + m * SUB, end - 1) + tl.arange(0, 1), end, kk, H, K,
                            DECAY_VECTOR)
        k_ref = tl.where((local < m * SUB)[:, None], k_chunk * tl.exp(tl.minimum(first - b_chunk, 0.0)), 0.0)
        dq_acc = tl.exp(tl.minimum(b_rows - first, 0.0)) * dot(dA_rows, k_ref, BF16_DOT)

        last = load_decay(b, h, tl.minimum(start + m * SUB + SUB, end) - 1 + tl.arange(0, 1), end, kk, H, K,
                           DECAY_VECTOR)
        q_ref = tl.where((local >= m * SUB + SUB)[:, None], q_chunk * tl.exp(tl.minimum(b_chunk - last, 0.0)), 0.0)
        dk_acc = tl.exp(tl.minimum(last - b_rows, 0.0)) * dot(tl.trans(dA_cols), q_ref, BF16_DOT)

        dA_diagonal = load_tile(dA + h * CHUNK, rows, end, H * CHUNK, m * SUB + tl.arange(0, SUB), CHUNK)
        dq_part, dk_part = _sub_chunk_grads(dA_diagonal, q_rows, k_rows, b_rows, SUB)
        dq_acc += dq_part
        dk_acc += dk_part
        dq_acc += load_tile(dq_state + h * K, rows, end, H * K, kk, K)
        dk_acc += load_tile(dk_state + h * K, rows, end, H * K, kk, K)
        store_tile(dq + h * K, dq_acc * scale, rows, end, H * K, kk, K)
        store_tile(dk + h * K, dk_acc, rows, end, H * K, kk, K)
        if DECAY_GRAD:
            db = q_rows * dq_acc - k_rows * dk_acc  # [SUB, BLOCK_K]
            d_log = tl.cumsum(db, axis=0, reverse=True) + later[None, :]
            raw = load_tile(log_decay + h * K, rows, end, H * K, kk, K).to(tl.float32)
            store_tile(d_log_decay + h * K, tl.where(raw >= LOG_DECAY_FLOOR, d_log, 0.0), rows, end, H * K, kk, K)
            later += tl.sum(db, axis=0)


# ---------------------------------------------------------------------------------------------------------------
# Launchers and autograd
# ---------------------------------------------------------------------------------------------------------------


def _states_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the states the forward pass stores at chunk boundaries: bfloat16 for bfloat16 inputs (half the
    traffic; its range is float32's), else float32 (float16 states could overflow). Final states are float32."""
    return torch.bfloat16 if input_dtype == torch.bfloat16 else torch.float32


def _state_pass(
    outer_k: Tensor, outer_v: Tensor, b: Tensor | None, init: Tensor | None, chunks: Chunks, *, reverse: bool,
    outer_k_scale: float, bf16_dot: bool, states_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """[slots, H, K, V] in states_dtype: the state entering every chunk (reverse: the gradient leaving it), and the
    fp32 [sequences, H, K, V] final state (reverse: the initial state's gradient), see `_state_pass_kernel`."""
    heads, key_dim, value_dim = outer_k.shape[-2], outer_k.shape[-1], outer_v.shape[-1]
    states = outer_k.new_empty(chunks.num_slots, heads, key_dim, value_dim, dtype=states_dtype)
    last = outer_k.new_empty(chunks.num_seqs, heads, key_dim, value_dim, dtype=torch.float32)
    block_k, block_v = block_size(key_dim), block_size(value_dim)
    grid = (triton.cdiv(key_dim, block_k), triton.cdiv(value_dim, block_v), chunks.num_seqs * heads)
    _state_pass_kernel[grid](
        outer_k, outer_v, last if b is None else b, last if init is None else init, states, last, chunks.seq_info,
        outer_k_scale, triton.next_power_of_2(outer_k.numel() // key_dim),
        H=heads, K=key_dim, V=value_dim, DECAY=decay_mode(b), REVERSE=int(reverse), HAS_INIT=init is not None,
        CHUNK=CHUNK_SIZE, BLOCK_K=block_k, BLOCK_V=block_v, BF16_DOT=bf16_dot,
    )
    return states, last


def _norm_state_pass(k: Tensor, b: Tensor | None, init: Tensor | None, chunks: Chunks,
                     bf16_dot: bool) -> tuple[Tensor, Tensor]:
    """The normaliser's states z [slots, H, K, 1] (the state of a ones value column) and the fp32 final one
    [sequences, H, K, 1], from init [sequences, H, K, 1] or zeros."""
    ones = k.new_ones(*k.shape[:-1], 1)
    return _state_pass(k, ones, b, init, chunks, reverse=False, outer_k_scale=1.0, bf16_dot=bf16_dot,
                       states_dtype=_states_dtype(k.dtype))


def _vector_scores(q: Tensor, k: Tensor, b: Tensor, chunks: Chunks, scale: float, bf16_dot: bool) -> Tensor:
    """fp32 [.., H, CHUNK_SIZE]: the intra-chunk scores A of a per-key-dim decay (`_vector_scores_kernel`)."""
    heads, key_dim = q.shape[-2:]
    scores = q.new_empty(*q.shape[:-1], CHUNK_SIZE, dtype=torch.float32)
    _vector_scores_kernel[(chunks.num_chunks, heads, CHUNK_SIZE // VECTOR_SUB_CHUNK)](
        q, k, b, scores, chunks.chunk_info, scale, H=heads, K=key_dim, CHUNK=CHUNK_SIZE, SUB=VECTOR_SUB_CHUNK,
        BLOCK_K=block_size(key_dim, 32), BF16_DOT=bf16_dot,
    )
    return scores


def chunk_output(
    row_k: Tensor, col_k: Tensor, col_v: Tensor, b: Tensor | None, scores: Tensor | None, states: Tensor | None,
    chunks: Chunks, *, transpose: bool, row_scale: float, col_scale: float, out_dtype: torch.dtype, bf16_dot: bool,
    norm_states: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """o (or, transposed, dv) [.., H, V] in out_dtype, and the fp32 normaliser [.., H] of the states norm_states
    [slots, H, K, 1] (None without them), see `_chunk_output_kernel`; states None: the intra-chunk product alone."""
    heads, key_dim, value_dim = row_k.shape[-2], row_k.shape[-1], col_v.shape[-1]
    out = col_v.new_empty(col_v.shape, dtype=out_dtype)
    den = None if norm_states is None else col_v.new_empty(col_v.shape[:-1], dtype=torch.float32)
    block_v = block_size(value_dim)
    has_state = states is not None
    states = out if states is None else states  # any tensor, for pointer arguments a specialization does not read
    _chunk_output_kernel[(chunks.num_chunks, heads, triton.cdiv(value_dim, block_v))](
        row_k, col_k, col_v, states if b is None else b, states if scores is None else scores, states, out,
        states if norm_states is None else norm_states, out if den is None else den, chunks.chunk_info, row_scale,
        col_scale, H=heads, K=key_dim, V=value_dim, DECAY=decay_mode(b), TRANSPOSE=int(transpose),
        HAS_STATE=has_state, NORM=norm_states is not None, CHUNK=CHUNK_SIZE, BLOCK_K=block_size(key_dim),
        BLOCK_V=block_v, BF16_DOT=bf16_dot,
    )
    return out, den


def _chunk_grads(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, log_decay: Tensor | None, b: Tensor | None, states: Tensor,
    dstates: Tensor, chunks: Chunks, scale: float, bf16_dot: bool, decay_grad: bool,
    norm: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """dq, dk [.., H, K] in q's and k's dtypes and, if decay_grad, d log_decay in log_decay's shape and dtype
    (see `_chunk_dqk_kernel` and `_vector_grads_kernel`); log_decay: the raw values, b: their clamped prefix sums;
    norm: the normaliser's states and state gradients [slots, H, K, 1] and its output's gradient [.., H], or None."""
    heads, key_dim, value_dim = k.shape[-2], k.shape[-1], v.shape[-1]
    tokens = k.numel() // (heads * key_dim)
    decay = decay_mode(b)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    block_k = _dqk_key_width(key_dim, value_dim, (decay_grad and decay == DECAY_SCALAR.value) or norm is not None)
    k_blocks = triton.cdiv(key_dim, block_k)
    unused = dstates  # any tensor, for pointer arguments a specialization does not read
    d_log_decay = state_term = unused
    if decay_grad and decay == DECAY_SCALAR.value:  # one partial sum per K block, added here if there are several
        d_log_decay = log_decay.new_empty(k_blocks, *log_decay.shape,
                                          dtype=log_decay.dtype if k_blocks == 1 else torch.float32)
    elif decay_grad:
        d_log_decay = torch.empty_like(log_decay)
        state_term = k.new_empty(chunks.num_chunks, heads, key_dim, dtype=torch.float32)
    # Per-key-dim decay: this pass leaves the intra-chunk sums to `_vector_grads_kernel` and stores dA for it.
    if decay == DECAY_VECTOR.value:
        dq_state, dk_state = (torch.empty(k.shape, dtype=torch.float32, device=k.device) for _ in range(2))
        dA = q.new_empty(*q.shape[:-1], CHUNK_SIZE, dtype=torch.float32)
    else:
        dq_state, dk_state, dA = dq, dk, unused
    _chunk_dqk_kernel[(chunks.num_chunks, heads, k_blocks)](
        q, k, v, do, states if log_decay is None else log_decay, states if b is None else b, states, dstates,
        *((unused,) * 3 if norm is None else norm), dq_state, dk_state, dA, state_term, d_log_decay,
        chunks.chunk_info, scale, tokens, triton.next_power_of_2(chunks.num_chunks * heads * k_blocks), H=heads,
        K=key_dim, V=value_dim, DECAY=decay, DECAY_GRAD=decay_grad, NORM=norm is not None, CHUNK=CHUNK_SIZE,
        BLOCK_K=block_k, BF16_DOT=bf16_dot,
    )
    if decay == DECAY_VECTOR.value:
        block_k = block_size(key_dim, 32)
        _vector_grads_kernel[(chunks.num_chunks, heads, triton.cdiv(key_dim, block_k))](
            q, k, log_decay, b, dA, dq_state, dk_state, state_term, dq, dk, d_log_decay, chunks.chunk_info, scale,
            H=heads, K=key_dim, CHUNK=CHUNK_SIZE, SUB=VECTOR_SUB_CHUNK, BLOCK_K=block_k, DECAY_GRAD=decay_grad,
            BF16_DOT=bf16_dot,
        )
    elif decay_grad:
        d_log_decay = d_log_decay[0] if k_blocks == 1 else d_log_decay.sum(0).to(log_decay.dtype)
    return dq, dk, d_log_decay if decay_grad else None


class _ChunkedLinearAttention(torch.autograd.Function):
    """Unnormalised chunked linear attention with carried states and, if normalize, the normaliser: the output of a
    ones value column, carried as a separate K-vector state z ([.., K, 1]), so that V keeps its width. log_decay
    arrives raw (−inf allowed): the cumsum kernel raises it to LOG_DECAY_FLOOR, the gradient kernels zero its
    gradient there. Backward reuses b and, for a per-key-dim decay, the scores A of the forward pass, and recomputes
    the chunk states."""

    @staticmethod
    def forward(ctx, q, k, v, log_decay, initial_state, initial_norm, scale, chunks, out_dtype, normalize):
        bf16_dot = q.dtype == torch.bfloat16 and not INTERPRET
        b = None if log_decay is None else chunk_cumsum(log_decay, chunks, reverse=False, clamp=True)
        states, final_state = _state_pass(k, v, b, initial_state, chunks, reverse=False, outer_k_scale=1.0,
                                          bf16_dot=bf16_dot, states_dtype=_states_dtype(k.dtype))
        norm_states = final_norm = None
        if normalize:
            norm_states, final_norm = _norm_state_pass(k, b, initial_norm, chunks, bf16_dot)
        scores = None if decay_mode(b) != DECAY_VECTOR.value else _vector_scores(q, k, b, chunks, scale, bf16_dot)
        o, den = chunk_output(
            q, k, v, b, scores, states, chunks, transpose=False, row_scale=scale, col_scale=1.0, out_dtype=out_dtype,
            bf16_dot=bf16_dot, norm_states=norm_states,
        )
        ctx.save_for_backward(q, k, v, log_decay, initial_state, initial_norm, b, scores)
        ctx.scale, ctx.chunks, ctx.bf16_dot, ctx.normalize = scale, chunks, bf16_dot, normalize
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to write and read
        return o, den, final_state, final_norm

    @staticmethod
    def backward(ctx, do, d_den, d_final_state, d_final_norm):
        q, k, v, log_decay, initial_state, initial_norm, b, scores = ctx.saved_tensors
        scale, chunks, bf16_dot = ctx.scale, ctx.chunks, ctx.bf16_dot
        do = v.new_zeros(v.shape) if do is None else do.contiguous()
        d_final_state = None if d_final_state is None else d_final_state.contiguous()
        states, _ = _state_pass(k, v, b, initial_state, chunks, reverse=False, outer_k_scale=1.0, bf16_dot=bf16_dot,
                                states_dtype=_states_dtype(k.dtype))
        dstates, d_initial = _state_pass(
            q, do, b, d_final_state, chunks, reverse=True, outer_k_scale=scale, bf16_dot=bf16_dot
        )
        norm = d_initial_norm = None
        if ctx.normalize:
            d_den = q.new_zeros(q.shape[:-1], dtype=torch.float32) if d_den is None else d_den.contiguous()
            d_final_norm = None if d_final_norm is None else d_final_norm.contiguous()
            norm_states, _ = _norm_state_pass(k, b, initial_norm, chunks, bf16_dot)
            d_norm_states, d_initial_norm = _state_pass(
                q, d_den[..., None], b, d_final_norm, chunks, reverse=True, outer_k_scale=scale, bf16_dot=bf16_dot
            )
            norm = (norm_states, d_norm_states, d_den)
        dv, _ = chunk_output(
            k, q, do, b, scores, dstates, chunks, transpose=True, row_scale=1.0, col_scale=scale, out_dtype=v.dtype,
            bf16_dot=bf16_dot,
        )
        decay_grad = b is not None and ctx.needs_input_grad[3]  # none for a fixed decay
        dq, dk, d_log_decay = _chunk_grads(
            q, k, v, do, log_decay, b, states, dstates, chunks, scale, bf16_dot, decay_grad, norm
        )
        d_initial = None if initial_state is None else d_initial.to(initial_state.dtype)
        d_initial_norm = None if initial_norm is None else d_initial_norm.to(initial_norm.dtype)
        return dq, dk, dv, d_log_decay, d_initial, d_initial_norm, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Backend entry point (arguments already validated by `ops.linear_attention`)
# ---------------------------------------------------------------------------------------------------------------


def linear_sums(q, k, v, log_decay, initial_state, *, scale, chunks, out_dtype, normalize):
    """o [B, T, H, V] in out_dtype, the fp32 normaliser [B, T, H] (None unless normalize; the output of a ones value
    column) and the fp32 final states [N, H, K, V (+ 1 if normalize: the normaliser's state last)] of the
    unnormalised linear attention; initial_state: None or [N, H, K, V (+ 1)]."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    log_decay = None if log_decay is None else log_decay.contiguous()  # raised to the floor in the kernels
    initial_norm = None
    if initial_state is not None and normalize:
        initial_state, initial_norm = initial_state[..., :-1].contiguous(), initial_state[..., -1:].contiguous()
    initial_state = None if initial_state is None else initial_state.contiguous()
    o, den, final_state, final_norm = _ChunkedLinearAttention.apply(
        q, k, v, log_decay, initial_state, initial_norm, scale, chunks, out_dtype, normalize
    )
    return o, den, final_state if final_norm is None else torch.cat([final_state, final_norm], dim=-1)


def triton_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None,
    *,
    scale: float,
    normalize: bool = False,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunked linear attention in Triton: arguments and results as `ops_chunked.chunk_linear_attention`.

    q, k: [B, T, H, K]; v: [B, T, H, V]; log_decay: None or [B, T, H, 1 | K] (≤ 0); initial_state: None or
    [N, H, K, V (+ 1 if normalize)]; cu_seqlens: None or [N + 1] (B == 1; on the device or a CPU copy; its tables
    are built once per tensor, see `packed_chunks`). No host sync otherwise. Returns o [B, T, H, V] in v's dtype and
    the fp32 final state (None unless output_final_state).
    """
    chunks = batch_chunks(*q.shape[:2], q.device) if cu_seqlens is None else packed_chunks(cu_seqlens, q.device)
    o, den, final_state = linear_sums(
        q, k, v, log_decay, initial_state, scale=scale, chunks=chunks,
        out_dtype=torch.float32 if normalize else v.dtype, normalize=normalize,
    )
    if normalize:
        o = (o / (den[..., None] + NORM_EPS)).to(v.dtype)
    return o, final_state if output_final_state else None
