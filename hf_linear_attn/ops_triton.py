"""Triton kernels for `linear_attention` and `window_attention` (backend "triton"), forward and backward.

Same arguments, results and state layout as the torch chunked backend (`ops_chunked`); the kernels run on CUDA
tensors, or on CPU under the Triton interpreter (TRITON_INTERPRET=1 set before this module is imported: slow,
for tests). Inputs may be float16, bfloat16 or float32; every sum is float32, and so are the states, except the
chunk-boundary states of the forward pass for bfloat16 inputs (bfloat16, see `_states_dtype`). Without triton this
module still imports (remote code, CPU-only installs) and `HAS_TRITON` is False.

Memory layout and pointer arithmetic (the same in every kernel)
---------------------------------------------------------------
A [B, T, H, D] input is a contiguous buffer of B·T tokens (batch rows one after the other): element (token t,
head h, column d) lies at (t·H + h)·D + d. A kernel working on head h moves the base pointer by h·D once and
then addresses a [rows, cols] tile as base + row·(H·D) + col (`_load_tile` / `_store_tile`). States
[slots, H, K, V] address the same way from the base (slot·H + h)·K·V with row stride V. Every load is masked
(rows past the chunk or sequence, columns past the head dim) and zero-filled, so block sizes are powers of two
whatever T, K and V are: a zero key or value adds nothing to any sum.

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

Kernels: `_chunk_cumsum_kernel` (b), `_state_pass_kernel` (S through the chunks of each sequence; dS
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

Window hybrid
-------------
`window_attention`'s linear part is the linear kernel above on keys and values delayed by window_size; its
softmax part is a flash-attention style kernel over the sink keys and the window keys (`_window_fwd_kernel`,
backward `_window_dq_kernel` and `_window_dkdv_kernel`), which returns the unnormalised sums against the exact
window maximum c_t; torch combines the two parts and divides. A dk/dv program visits the queries within the window
of its keys only; the sinks' gradients from every later query come from `_window_sink_dkdv_kernel`, which cuts
those queries into slices of about a window each (partial sums, added in a fixed order): no program runs through
a whole row.
"""

import functools
import os
import weakref

import torch
from torch import Tensor

from .ops_common import (
    CHUNK_SIZE,
    NORM_EPS,
    divide_at_real_queries,
    log_decay_floor,
    window_linear_inputs,
    window_token_masks,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend is then not registered; the kernels below are defined but never launched
    triton = None

HAS_TRITON = triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # triton reads it when @triton.jit runs, i.e. at import
# Per-key-dim decay: rows per sub-chunk of the intra-chunk products, one program each (the torch backend's
# sub-blocks are smaller, to bound its explicit decay tensors); must divide CHUNK_SIZE.
VECTOR_SUB_CHUNK = 16
WINDOW_BLOCK = 64  # queries (and keys) per block of the window softmax kernels, see `_window_blocks`
SINK_BLOCK = 16  # sink keys per program of `_window_sink_dkdv_kernel` (the smallest tl.dot tile)
SINK_SLICE_MIN_BLOCKS = 4  # query blocks per program of `_window_sink_dkdv_kernel` at least, see `_sink_slice_blocks`
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_WINDOW_HEAD_DIM = 256  # D and V of the window softmax part: one tile of the window kernels

if not HAS_TRITON:

    class _NoTriton:
        """Stands in for `triton` and `triton.language` so that the kernel definitions below still execute."""

        class constexpr:  # noqa: N801 (triton's name)
            def __init__(self, value):
                self.value = value

        @staticmethod
        def jit(fn):
            return fn

        @staticmethod
        def autotune(**_):
            return lambda fn: fn

    triton = tl = _NoTriton

# The kernels' DECAY: no decay, one per head, one per key dim. Kernels may read only constexpr globals; host code
# passes and compares their .value.
DECAY_NONE, DECAY_SCALAR, DECAY_VECTOR = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# Log decays below it (−inf, a reset, included) are raised to it when b is summed and get no gradient, as
# log_decay.clamp(min=floor) would, see `log_decay_floor`.
LOG_DECAY_FLOOR = tl.constexpr(log_decay_floor(torch.float32))


def _configs() -> list:
    """Launch configurations to autotune over: a single one under the interpreter (several fail there)."""
    if not HAS_TRITON:
        return []
    if INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3)]


def _spill_free(configs: list, named_args: dict, **kwargs) -> list:
    """The configs the autotuner may pick for the kernels tuned over `_configs()`: at head dims ≥ 64 (K, D or V) only
    8 warps and 2 stages (an sm_90 compile of the others spills registers at 64 and 128, up to 2 KB in the linear
    kernels and 8 KB in the window and delta-rule ones, with 4 warps or 3 stages); all of them below, and under the
    interpreter."""
    if INTERPRET or max(kwargs.get(name, 0) for name in ("K", "D", "V")) < 64:
        return configs
    return [c for c in configs if (c.num_warps, c.num_stages) == (8, 2)]


def _dqk_configs() -> list:
    """Launch configurations of `_chunk_dqk_kernel`: 8 warps, 2 stages and a BLOCK_V for V, see `_dqk_value_blocks`
    (an sm_90 compile at K = V = 128 spills registers with 4 warps, up to 1.8 KB, with 128-wide K blocks, and with 3
    stages when the V loop runs more than once). One under the interpreter."""
    if not HAS_TRITON:
        return []
    if INTERPRET:
        return [triton.Config({"BLOCK_V": 64}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_V": bv}, num_warps=8, num_stages=2) for bv in (64, 128)]


def _dqk_value_width(value_dim: int, element_size: int) -> int:
    """BLOCK_V of `_chunk_dqk_kernel`: one 128-wide value block for 16-bit inputs with 64 < V ≤ 128, 64-wide blocks
    otherwise (64-wide ones spill at V = 128 for the per-key-dim decay, 128-wide ones past V = 128; fp32 128-wide
    tiles need more than sm_90's shared memory)."""
    return _block(value_dim, 128) if element_size <= 2 and value_dim <= 128 else 64


def _dqk_key_width(key_dim: int, value_dim: int, extra_terms: bool) -> int:
    """BLOCK_K of `_chunk_dqk_kernel`: 64, or 32 where a 64-wide K block spills registers on sm_90: three fp32
    [CHUNK, 64] accumulators and extra terms (the per-head decay gradient, the normaliser's), or a V loop of several
    64-wide blocks."""
    return _block(key_dim, 32 if extra_terms or value_dim > 128 else 64)


def _dqk_value_blocks(configs: list, named_args: dict, **kwargs) -> list:
    """The config the autotuner may pick for this V (`_dqk_value_width`); any under the interpreter."""
    width = _dqk_value_width(kwargs["V"], named_args["q"].element_size())
    return [c for c in configs if INTERPRET or c.kwargs["BLOCK_V"] == width]


# ---------------------------------------------------------------------------------------------------------------
# Shared device helpers
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_offsets(rows, row_stride, cols):
    """Element offsets of the [len(rows), len(cols)] tile; int64 rows, so huge buffers index safely."""
    return rows.to(tl.int64)[:, None] * row_stride + cols[None, :]


@triton.jit
def _load_tile(base, rows, row_end, row_stride, cols, num_cols):
    """base[rows, cols] of a row-major buffer, zero where rows ≥ row_end or cols ≥ num_cols."""
    mask = (rows < row_end)[:, None] & (cols < num_cols)[None, :]
    return tl.load(base + _tile_offsets(rows, row_stride, cols), mask=mask, other=0.0)


@triton.jit
def _store_tile(base, tile, rows, row_end, row_stride, cols, num_cols):
    """base[rows, cols] = tile (in base's dtype), where rows < row_end and cols < num_cols."""
    mask = (rows < row_end)[:, None] & (cols < num_cols)[None, :]
    tl.store(base + _tile_offsets(rows, row_stride, cols), tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _state_base(states, slot, h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Pointer to state [slot, h] of a [slots, H, K, V] buffer: a [K, V] tile with row stride V."""
    return states + (slot.to(tl.int64) * H + h) * (K * V)


@triton.jit
def _chunk_bounds(chunk_info, chunk):
    """First token, end token (exclusive) and the state slot entering the chunk, from the int32 [chunks, 3] table."""
    return tl.load(chunk_info + 3 * chunk), tl.load(chunk_info + 3 * chunk + 1), tl.load(chunk_info + 3 * chunk + 2)


@triton.jit
def _start_state_pass(
    seq_info, init, pid_k, pid_v, pid_nh, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    HAS_INIT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The start of a state pass program, the one of state tile (pid_k, pid_v) of sequence n, head h
    (pid_nh = n · H + h), shared by the passes of `ops_triton` and `ops_delta_rule_triton`.

    Returns h, the tile's rows kk and columns vv, the sequence's first token, end token and first state slot (from
    the int32 [sequences, 3] table seq_info), its number of chunks, and the fp32 [BLOCK_K, BLOCK_V] state tile it
    starts from: init[n, h], or zeros unless HAS_INIT.
    """
    n, h = pid_nh // H, pid_nh % H
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    vv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    first_token, end_token = tl.load(seq_info + 3 * n), tl.load(seq_info + 3 * n + 1)
    first_slot = tl.load(seq_info + 3 * n + 2)
    if HAS_INIT:
        state = _load_tile(_state_base(init, n, h, H, K, V), kk, K, V, vv, V).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    return h, kk, vv, first_token, end_token, first_slot, tl.cdiv(end_token - first_token, CHUNK), state


@triton.jit
def _load_decay(b, h, rows, row_end, kk, H: tl.constexpr, K: tl.constexpr, DECAY: tl.constexpr):
    """Cumulative log decay b of `rows`: [rows, len(kk)] for DECAY_VECTOR, else [rows, 1] (DECAY_SCALAR: one per
    head; DECAY_NONE: no decay, i.e. zeros).

    b: fp32 [tokens, H, 1 | K]. Rows ≥ row_end read 0, which keeps every exponent built from them ≤ 0.
    """
    if DECAY == DECAY_VECTOR:
        tile = _load_tile(b + h * K, rows, row_end, H * K, kk, K)
    elif DECAY == DECAY_SCALAR:
        tile = _load_tile(b + h, rows, row_end, H, tl.arange(0, 1), 1)
    else:
        tile = tl.zeros([rows.shape[0], 1], dtype=tl.float32)
    return tile


@triton.jit
def _dot(a, b, BF16_DOT: tl.constexpr):
    """a @ b, accumulated in fp32. Operands in bf16 for bf16 inputs on a GPU, else fp32 (TF32 on a GPU): the
    interpreter's bf16 dot is wrong, and fp16 operands could overflow on states and sums."""
    if BF16_DOT:
        a = a.to(tl.bfloat16)
        b = b.to(tl.bfloat16)
    else:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b)


@triton.jit
def _causal_decay(b, TRANSPOSE: tl.constexpr, CHUNK: tl.constexpr):
    """Weights of the intra-chunk product for a per-head (or no) decay b [CHUNK, 1]: [t, i] = e^{b_t − b_i} for
    i ≤ t, 0 above the diagonal; laid out [i, t] if TRANSPOSE."""
    local = tl.arange(0, CHUNK)
    if TRANSPOSE:
        causal = local[:, None] <= local[None, :]
        gap = tl.trans(b) - b
    else:
        causal = local[:, None] >= local[None, :]
        gap = b - tl.trans(b)
    return tl.where(causal, tl.exp(tl.minimum(gap, 0.0)), 0.0)


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
# Chunked linear attention kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _chunk_cumsum_kernel(
    terms, sums, chunk_info, H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
    REVERSE: tl.constexpr, CLAMP: tl.constexpr,
):
    """sums = cumulative sum of terms over the tokens of each chunk, from its start (or from its end if REVERSE),
    each term first raised to LOG_DECAY_FLOOR if CLAMP.

    terms, sums: [tokens, H, D], sums fp32. Grid: (chunks, H).
    """
    chunk, h = tl.program_id(0), tl.program_id(1)
    start, end, _ = _chunk_bounds(chunk_info, chunk)
    rows = start + tl.arange(0, CHUNK)
    cols = tl.arange(0, BLOCK_D)
    tile = _load_tile(terms + h * D, rows, end, H * D, cols, D).to(tl.float32)
    if CLAMP:
        tile = tl.maximum(tile, LOG_DECAY_FLOOR)
    _store_tile(sums + h * D, tl.cumsum(tile, axis=0, reverse=REVERSE), rows, end, H * D, cols, D)


@triton.autotune(configs=_configs(), key=["K", "V", "DECAY", "REVERSE", "HAS_INIT", "work_bucket"],
                 prune_configs_by={"early_config_prune": _spill_free})
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
    h, kk, vv, first_token, end_token, first_slot, num_chunks, state = _start_state_pass(
        seq_info, init, tl.program_id(0), tl.program_id(1), tl.program_id(2), H, K, V, HAS_INIT, CHUNK, BLOCK_K,
        BLOCK_V,
    )
    for i in range(num_chunks):
        if REVERSE:
            j = num_chunks - 1 - i
        else:
            j = i
        _store_tile(_state_base(states, first_slot + j + REVERSE, h, H, K, V), state, kk, K, V, vv, V)
        start = first_token + j * CHUNK
        end = tl.minimum(start + CHUNK, end_token)
        rows = start + tl.arange(0, CHUNK)
        k_tile = _load_tile(outer_k + h * K, rows, end, H * K, kk, K).to(tl.float32) * outer_k_scale
        b_rows = _load_decay(b, h, rows, end, kk, H, K, DECAY)
        b_last = _load_decay(b, h, end - 1 + tl.arange(0, 1), end, kk, H, K, DECAY)
        if REVERSE:
            k_tile = k_tile * tl.exp(b_rows)
        else:
            k_tile = k_tile * tl.exp(b_last - b_rows)
        v_tile = _load_tile(outer_v + h * V, rows, end, H * V, vv, V)
        state = state * tl.exp(tl.trans(b_last)) + _dot(tl.trans(k_tile), v_tile, BF16_DOT)
    _store_tile(_state_base(last, tl.program_id(2) // H, h, H, K, V), state, kk, K, V, vv, V)


@triton.autotune(configs=_configs(), key=["K", "BLOCK_K"], prune_configs_by={"early_config_prune": _spill_free})
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
    start, end, _ = _chunk_bounds(chunk_info, chunk)
    rows = start + m * SUB + tl.arange(0, SUB)
    keys = start + tl.arange(0, CHUNK)
    reference = tl.minimum(start + m * SUB, end - 1) + tl.arange(0, 1)
    earlier = (tl.arange(0, CHUNK) < m * SUB)[:, None]
    off_diagonal = tl.zeros([SUB, CHUNK], dtype=tl.float32)
    diagonal = tl.zeros([SUB, SUB], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        q_rows = _load_tile(q + h * K, rows, end, H * K, kk, K).to(tl.float32) * scale
        b_rows = _load_decay(b, h, rows, end, kk, H, K, DECAY_VECTOR)
        r = _load_decay(b, h, reference, end, kk, H, K, DECAY_VECTOR)
        k_keys = _load_tile(k + h * K, keys, end, H * K, kk, K).to(tl.float32)
        b_keys = _load_decay(b, h, keys, end, kk, H, K, DECAY_VECTOR)
        k_keys = tl.where(earlier, k_keys * tl.exp(tl.minimum(r - b_keys, 0.0)), 0.0)
        q_ref = q_rows * tl.exp(tl.minimum(b_rows - r, 0.0))
        off_diagonal += _dot(q_ref, tl.trans(k_keys), BF16_DOT)
        k_rows = _load_tile(k + h * K, rows, end, H * K, kk, K).to(tl.float32)
        diagonal += tl.sum(q_rows[:, None, :] * k_rows[None, :, :] * _sub_chunk_decay(b_rows, SUB), axis=2)
    # Two stores to disjoint columns: the off-diagonal tile (zero right of the diagonal block), then the diagonal block.
    cols = tl.arange(0, CHUNK)
    outside = (cols < m * SUB) | (cols >= m * SUB + SUB)
    base = scores + h * CHUNK
    tl.store(base + _tile_offsets(rows, H * CHUNK, cols), off_diagonal, mask=(rows < end)[:, None] & outside[None, :])
    _store_tile(base, diagonal, rows, end, H * CHUNK, m * SUB + tl.arange(0, SUB), CHUNK)


@triton.autotune(configs=_configs(), key=["K", "V", "DECAY", "TRANSPOSE", "HAS_STATE"],
                 prune_configs_by={"early_config_prune": _spill_free})
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
    start, end, slot = _chunk_bounds(chunk_info, chunk)
    rows = start + tl.arange(0, CHUNK)
    vv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    state = _state_base(states, slot + TRANSPOSE, h, H, K, V)
    acc = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    den_acc = tl.zeros([CHUNK], dtype=tl.float32)
    scores_tile = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        row_tile = _load_tile(row_k + h * K, rows, end, H * K, kk, K).to(tl.float32) * row_scale
        b_rows = _load_decay(b, h, rows, end, kk, H, K, DECAY)
        if TRANSPOSE:
            b_last = _load_decay(b, h, end - 1 + tl.arange(0, 1), end, kk, H, K, DECAY)
            weight = tl.exp(b_last - b_rows)
        else:
            weight = tl.exp(b_rows)
        if HAS_STATE:
            acc += _dot(row_tile * weight, _load_tile(state, kk, K, V, vv, V), BF16_DOT)
        if NORM:
            z = tl.load(_state_base(norm_states, slot, h, H, K, 1) + kk, mask=kk < K, other=0.0).to(tl.float32)
            den_acc += tl.sum(row_tile * weight * z[None, :], axis=1)
        if DECAY != DECAY_VECTOR:
            col_tile = _load_tile(col_k + h * K, rows, end, H * K, kk, K).to(tl.float32) * col_scale
            scores_tile += _dot(row_tile, tl.trans(col_tile), BF16_DOT)
    if DECAY == DECAY_VECTOR:
        scores_tile = _load_tile(scores + h * CHUNK, rows, end, H * CHUNK, tl.arange(0, CHUNK), CHUNK)
        if TRANSPOSE:
            scores_tile = tl.trans(scores_tile)
    else:
        scores_tile *= _causal_decay(_load_decay(b, h, rows, end, 0, H, K, DECAY), TRANSPOSE, CHUNK)
    acc += _dot(scores_tile, _load_tile(col_v + h * V, rows, end, H * V, vv, V), BF16_DOT)
    _store_tile(out + h * V, acc, rows, end, H * V, vv, V)
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
    start, end, slot = _chunk_bounds(chunk_info, chunk)
    rows = start + tl.arange(0, CHUNK)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    entering = _state_base(states, slot, h, H, K, V)
    d_leaving = _state_base(dstates, slot + 1, h, H, K, V)
    dq_acc = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
    dk_acc = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
    dA_acc = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    entering_term = tl.zeros([BLOCK_K], dtype=tl.float32)  # Σ_v S_j ⊙ dS_{j+1}
    for v0 in range(0, V, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        do_tile = _load_tile(do + h * V, rows, end, H * V, vv, V)
        v_tile = _load_tile(v + h * V, rows, end, H * V, vv, V)
        state = _load_tile(entering, kk, K, V, vv, V)
        d_state = _load_tile(d_leaving, kk, K, V, vv, V)
        dq_acc += _dot(do_tile, tl.trans(state), BF16_DOT)
        dk_acc += _dot(v_tile, tl.trans(d_state), BF16_DOT)
        dA_acc += _dot(do_tile, tl.trans(v_tile), BF16_DOT)
        if DECAY_GRAD:
            entering_term += tl.sum(state.to(tl.float32) * d_state.to(tl.float32), axis=1)
    if NORM:
        z = tl.load(_state_base(norm_states, slot, h, H, K, 1) + kk, mask=kk < K, other=0.0).to(tl.float32)
        dz = tl.load(_state_base(d_norm_states, slot + 1, h, H, K, 1) + kk, mask=kk < K, other=0.0)
        d_den = tl.load(d_den + rows.to(tl.int64) * H + h, mask=rows < end, other=0.0)[:, None]  # [CHUNK, 1]
        dq_acc += d_den * z[None, :]
        dk_acc += dz[None, :]
        dA_acc += d_den
        if DECAY_GRAD:
            entering_term += z * dz
    b_rows = _load_decay(b, h, rows, end, kk, H, K, DECAY)
    b_last = _load_decay(b, h, end - 1 + tl.arange(0, 1), end, kk, H, K, DECAY)
    dq_acc *= tl.exp(b_rows)
    dk_acc *= tl.exp(b_last - b_rows)
    k_tile = _load_tile(k + h * K, rows, end, H * K, kk, K)
    term = tl.zeros([1, BLOCK_K], dtype=tl.float32)
    if DECAY_GRAD:
        term = entering_term[None, :] * tl.exp(b_last) + tl.sum(k_tile.to(tl.float32) * dk_acc, axis=0)[None, :]
    if DECAY == DECAY_VECTOR:
        if DECAY_GRAD:
            tl.store(state_term + (chunk.to(tl.int64) * H + h) * K + kk[None, :], term, mask=(kk < K)[None, :])
        if pid_k == 0:
            _store_tile(dA + h * CHUNK, dA_acc, rows, end, H * CHUNK, tl.arange(0, CHUNK), CHUNK)
        _store_tile(dq + h * K, dq_acc, rows, end, H * K, kk, K)
    else:
        dA_acc *= _causal_decay(b_rows, False, CHUNK)
        dq_acc += _dot(dA_acc, k_tile, BF16_DOT)
        q_tile = _load_tile(q + h * K, rows, end, H * K, kk, K).to(tl.float32) * scale
        dk_acc += _dot(tl.trans(dA_acc), q_tile, BF16_DOT)
        if DECAY_GRAD:
            db = tl.sum(q_tile * dq_acc - k_tile.to(tl.float32) * dk_acc, axis=1)  # [CHUNK]: d/db_t, no state term
            d_log = tl.cumsum(db, axis=0, reverse=True) + tl.sum(term)
            raw = tl.load(log_decay + rows.to(tl.int64) * H + h, mask=rows < end, other=0.0)
            d_log = tl.where(raw.to(tl.float32) >= LOG_DECAY_FLOOR, d_log, 0.0)
            partial = d_log_decay + pid_k.to(tl.int64) * tokens * H
            tl.store(partial + rows.to(tl.int64) * H + h, d_log.to(d_log_decay.dtype.element_ty), mask=rows < end)
        _store_tile(dq + h * K, dq_acc * scale, rows, end, H * K, kk, K)
    _store_tile(dk + h * K, dk_acc, rows, end, H * K, kk, K)


@triton.autotune(configs=_configs(), key=["K", "BLOCK_K", "DECAY_GRAD"],
                 prune_configs_by={"early_config_prune": _spill_free})
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
    start, end, _ = _chunk_bounds(chunk_info, chunk)
    local = tl.arange(0, CHUNK)
    chunk_rows = start + local
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    q_chunk = _load_tile(q + h * K, chunk_rows, end, H * K, kk, K).to(tl.float32) * scale
    k_chunk = _load_tile(k + h * K, chunk_rows, end, H * K, kk, K).to(tl.float32)
    b_chunk = _load_decay(b, h, chunk_rows, end, kk, H, K, DECAY_VECTOR)
    later = tl.zeros([BLOCK_K], dtype=tl.float32)  # Σ over the rows of later sub-chunks, plus the state term
    if DECAY_GRAD:
        later = tl.load(state_term + (chunk.to(tl.int64) * H + h) * K + kk, mask=kk < K, other=0.0)
    for step in range(CHUNK // SUB):
        m = CHUNK // SUB - 1 - step
        rows = start + m * SUB + tl.arange(0, SUB)
        q_rows = _load_tile(q + h * K, rows, end, H * K, kk, K).to(tl.float32) * scale
        k_rows = _load_tile(k + h * K, rows, end, H * K, kk, K).to(tl.float32)
        b_rows = _load_decay(b, h, rows, end, kk, H, K, DECAY_VECTOR)
        dA_rows = _load_tile(dA + h * CHUNK, rows, end, H * CHUNK, local, CHUNK)  # [SUB, CHUNK]: dA_t· for t in m
        dA_cols = _load_tile(dA + h * CHUNK, chunk_rows, end, H * CHUNK, m * SUB + tl.arange(0, SUB), CHUNK)  # dA_·i

        first = _load_decay(b, h, tl.minimum(start + m * SUB, end - 1) + tl.arange(0, 1), end, kk, H, K,
                            DECAY_VECTOR)
        k_ref = tl.where((local < m * SUB)[:, None], k_chunk * tl.exp(tl.minimum(first - b_chunk, 0.0)), 0.0)
        dq_acc = tl.exp(tl.minimum(b_rows - first, 0.0)) * _dot(dA_rows, k_ref, BF16_DOT)

        last = _load_decay(b, h, tl.minimum(start + m * SUB + SUB, end) - 1 + tl.arange(0, 1), end, kk, H, K,
                           DECAY_VECTOR)
        q_ref = tl.where((local >= m * SUB + SUB)[:, None], q_chunk * tl.exp(tl.minimum(b_chunk - last, 0.0)), 0.0)
        dk_acc = tl.exp(tl.minimum(last - b_rows, 0.0)) * _dot(tl.trans(dA_cols), q_ref, BF16_DOT)

        dA_diagonal = _load_tile(dA + h * CHUNK, rows, end, H * CHUNK, m * SUB + tl.arange(0, SUB), CHUNK)
        dq_part, dk_part = _sub_chunk_grads(dA_diagonal, q_rows, k_rows, b_rows, SUB)
        dq_acc += dq_part
        dk_acc += dk_part
        dq_acc += _load_tile(dq_state + h * K, rows, end, H * K, kk, K)
        dk_acc += _load_tile(dk_state + h * K, rows, end, H * K, kk, K)
        _store_tile(dq + h * K, dq_acc * scale, rows, end, H * K, kk, K)
        _store_tile(dk + h * K, dk_acc, rows, end, H * K, kk, K)
        if DECAY_GRAD:
            db = q_rows * dq_acc - k_rows * dk_acc  # [SUB, BLOCK_K]
            d_log = tl.cumsum(db, axis=0, reverse=True) + later[None, :]
            raw = _load_tile(log_decay + h * K, rows, end, H * K, kk, K).to(tl.float32)
            _store_tile(d_log_decay + h * K, tl.where(raw >= LOG_DECAY_FLOOR, d_log, 0.0), rows, end, H * K, kk, K)
            later += tl.sum(db, axis=0)


# ---------------------------------------------------------------------------------------------------------------
# Chunked linear attention: launchers and autograd
# ---------------------------------------------------------------------------------------------------------------


def _block(dim: int, cap: int = 64) -> int:
    """Tile size covering `dim`: a power of two in [16, cap] (tl.dot needs ≥ 16 on a GPU)."""
    return min(cap, max(16, triton.next_power_of_2(dim)))


class _Chunks:
    """How the tokens of a batch split into sequences and chunks, as int32 tables on the inputs' device.

    Each batch row is a sequence, or the cu_seqlens bounds split the one packed row. Sequence n owns the state
    slots first_slots[n] … first_slots[n] + (its chunk count): the state entering each of its chunks, then its
    final state (a zero-length sequence has one slot, its initial state).
    """

    def __init__(self, bounds: list[int], device: torch.device):
        starts, ends = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:])
        counts = (ends - starts + CHUNK_SIZE - 1) // CHUNK_SIZE
        first_slots = torch.cumsum(counts + 1, 0) - (counts + 1)
        seq = torch.repeat_interleave(torch.arange(len(counts)), counts)  # the sequence of each chunk
        index = torch.arange(len(seq)) - (torch.cumsum(counts, 0) - counts)[seq]  # the chunk's index in it
        chunk_starts = starts[seq] + index * CHUNK_SIZE
        chunk_ends = torch.minimum(chunk_starts + CHUNK_SIZE, ends[seq])
        self.chunk_info = torch.stack([chunk_starts, chunk_ends, first_slots[seq] + index], 1).int().to(device)
        self.seq_info = torch.stack([starts, ends, first_slots], 1).int().to(device)
        self.first_slots = first_slots.to(device)
        self.final_slots = (first_slots + counts).to(device)
        self.num_chunks, self.num_seqs = len(seq), len(counts)
        self.num_slots = int((counts + 1).sum())


@functools.lru_cache(maxsize=32)
def _batch_chunks(batch: int, length: int, device: torch.device) -> _Chunks:
    """The tables of a batch of `batch` rows of `length` tokens, built once per shape and device."""
    return _Chunks(list(range(0, batch * length + 1, length)), device)


# id(cu_seqlens) -> (a weak reference to it, its version, the device, its _Chunks); an entry leaves with its tensor.
_PACKED_CHUNKS: dict[int, tuple] = {}


def _packed_chunks(cu_seqlens: Tensor, device: torch.device) -> _Chunks:
    """The tables of the sequences packed at cu_seqlens [N + 1], built on the first call with this tensor (again only
    if it is modified in place) and reused: the one read of its values (a host sync for a CUDA tensor; none for a CPU
    copy, which is accepted as it is) happens once, e.g. once per model forward for all layers."""
    key = id(cu_seqlens)
    cached = _PACKED_CHUNKS.get(key)
    if cached is not None and cached[0]() is cu_seqlens and cached[1:3] == (cu_seqlens._version, device):
        return cached[3]
    chunks = _Chunks(cu_seqlens.tolist(), device)
    reference = weakref.ref(cu_seqlens, lambda _: _PACKED_CHUNKS.pop(key, None))
    _PACKED_CHUNKS[key] = (reference, cu_seqlens._version, device, chunks)
    return chunks


def _chunk_cumsum(terms: Tensor, chunks: _Chunks, reverse: bool, clamp: bool = False) -> Tensor:
    """fp32 cumulative sum of terms [.., H, D] over the tokens of each chunk, terms raised to LOG_DECAY_FLOOR first
    if clamp (see `_chunk_cumsum_kernel`)."""
    heads, dim = terms.shape[-2:]
    sums = torch.empty(terms.shape, dtype=torch.float32, device=terms.device)
    _chunk_cumsum_kernel[(chunks.num_chunks, heads)](
        terms, sums, chunks.chunk_info, H=heads, D=dim, BLOCK_D=triton.next_power_of_2(dim), CHUNK=CHUNK_SIZE,
        REVERSE=reverse, CLAMP=clamp,
    )
    return sums


def _decay_mode(b: Tensor | None) -> int:
    """The kernels' DECAY for b: None, [.., 1] or [.., K]."""
    if b is None:
        return DECAY_NONE.value
    return DECAY_SCALAR.value if b.shape[-1] == 1 else DECAY_VECTOR.value


def _states_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the states the forward pass stores at chunk boundaries: bfloat16 for bfloat16 inputs (half the
    traffic; its range is float32's), else float32 (float16 states could overflow). Final states are float32."""
    return torch.bfloat16 if input_dtype == torch.bfloat16 else torch.float32


def _state_pass(
    outer_k: Tensor, outer_v: Tensor, b: Tensor | None, init: Tensor | None, chunks: _Chunks, *, reverse: bool,
    outer_k_scale: float, bf16_dot: bool, states_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """[slots, H, K, V] in states_dtype: the state entering every chunk (reverse: the gradient leaving it), and the
    fp32 [sequences, H, K, V] final state (reverse: the initial state's gradient), see `_state_pass_kernel`."""
    heads, key_dim, value_dim = outer_k.shape[-2], outer_k.shape[-1], outer_v.shape[-1]
    states = outer_k.new_empty(chunks.num_slots, heads, key_dim, value_dim, dtype=states_dtype)
    last = outer_k.new_empty(chunks.num_seqs, heads, key_dim, value_dim, dtype=torch.float32)
    block_k, block_v = _block(key_dim), _block(value_dim)
    grid = (triton.cdiv(key_dim, block_k), triton.cdiv(value_dim, block_v), chunks.num_seqs * heads)
    _state_pass_kernel[grid](
        outer_k, outer_v, last if b is None else b, last if init is None else init, states, last, chunks.seq_info,
        outer_k_scale, triton.next_power_of_2(outer_k.numel() // key_dim),
        H=heads, K=key_dim, V=value_dim, DECAY=_decay_mode(b), REVERSE=int(reverse), HAS_INIT=init is not None,
        CHUNK=CHUNK_SIZE, BLOCK_K=block_k, BLOCK_V=block_v, BF16_DOT=bf16_dot,
    )
    return states, last


def _norm_state_pass(k: Tensor, b: Tensor | None, init: Tensor | None, chunks: _Chunks,
                     bf16_dot: bool) -> tuple[Tensor, Tensor]:
    """The normaliser's states z [slots, H, K, 1] (the state of a ones value column) and the fp32 final one
    [sequences, H, K, 1], from init [sequences, H, K, 1] or zeros."""
    ones = k.new_ones(*k.shape[:-1], 1)
    return _state_pass(k, ones, b, init, chunks, reverse=False, outer_k_scale=1.0, bf16_dot=bf16_dot,
                       states_dtype=_states_dtype(k.dtype))


def _vector_scores(q: Tensor, k: Tensor, b: Tensor, chunks: _Chunks, scale: float, bf16_dot: bool) -> Tensor:
    """fp32 [.., H, CHUNK_SIZE]: the intra-chunk scores A of a per-key-dim decay (`_vector_scores_kernel`)."""
    heads, key_dim = q.shape[-2:]
    scores = q.new_empty(*q.shape[:-1], CHUNK_SIZE, dtype=torch.float32)
    _vector_scores_kernel[(chunks.num_chunks, heads, CHUNK_SIZE // VECTOR_SUB_CHUNK)](
        q, k, b, scores, chunks.chunk_info, scale, H=heads, K=key_dim, CHUNK=CHUNK_SIZE, SUB=VECTOR_SUB_CHUNK,
        BLOCK_K=_block(key_dim, 32), BF16_DOT=bf16_dot,
    )
    return scores


def _chunk_output(
    row_k: Tensor, col_k: Tensor, col_v: Tensor, b: Tensor | None, scores: Tensor | None, states: Tensor | None,
    chunks: _Chunks, *, transpose: bool, row_scale: float, col_scale: float, out_dtype: torch.dtype, bf16_dot: bool,
    norm_states: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """o (or, transposed, dv) [.., H, V] in out_dtype, and the fp32 normaliser [.., H] of the states norm_states
    [slots, H, K, 1] (None without them), see `_chunk_output_kernel`; states None: the intra-chunk product alone."""
    heads, key_dim, value_dim = row_k.shape[-2], row_k.shape[-1], col_v.shape[-1]
    out = col_v.new_empty(col_v.shape, dtype=out_dtype)
    den = None if norm_states is None else col_v.new_empty(col_v.shape[:-1], dtype=torch.float32)
    block_v = _block(value_dim)
    has_state = states is not None
    states = out if states is None else states  # any tensor, for pointer arguments a specialization does not read
    _chunk_output_kernel[(chunks.num_chunks, heads, triton.cdiv(value_dim, block_v))](
        row_k, col_k, col_v, states if b is None else b, states if scores is None else scores, states, out,
        states if norm_states is None else norm_states, out if den is None else den, chunks.chunk_info, row_scale,
        col_scale, H=heads, K=key_dim, V=value_dim, DECAY=_decay_mode(b), TRANSPOSE=int(transpose),
        HAS_STATE=has_state, NORM=norm_states is not None, CHUNK=CHUNK_SIZE, BLOCK_K=_block(key_dim),
        BLOCK_V=block_v, BF16_DOT=bf16_dot,
    )
    return out, den


def _chunk_grads(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, log_decay: Tensor | None, b: Tensor | None, states: Tensor,
    dstates: Tensor, chunks: _Chunks, scale: float, bf16_dot: bool, decay_grad: bool,
    norm: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """dq, dk [.., H, K] in q's and k's dtypes and, if decay_grad, d log_decay in log_decay's shape and dtype
    (see `_chunk_dqk_kernel` and `_vector_grads_kernel`); log_decay: the raw values, b: their clamped prefix sums;
    norm: the normaliser's states and state gradients [slots, H, K, 1] and its output's gradient [.., H], or None."""
    heads, key_dim, value_dim = k.shape[-2], k.shape[-1], v.shape[-1]
    tokens = k.numel() // (heads * key_dim)
    decay = _decay_mode(b)
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
        block_k = _block(key_dim, 32)
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
        b = None if log_decay is None else _chunk_cumsum(log_decay, chunks, reverse=False, clamp=True)
        states, final_state = _state_pass(k, v, b, initial_state, chunks, reverse=False, outer_k_scale=1.0,
                                          bf16_dot=bf16_dot, states_dtype=_states_dtype(k.dtype))
        norm_states = final_norm = None
        if normalize:
            norm_states, final_norm = _norm_state_pass(k, b, initial_norm, chunks, bf16_dot)
        scores = None if _decay_mode(b) != DECAY_VECTOR.value else _vector_scores(q, k, b, chunks, scale, bf16_dot)
        o, den = _chunk_output(
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
        dv, _ = _chunk_output(
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
# Window softmax kernels
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
    k_tile = _load_tile(k, i, hi, row_stride, tl.arange(0, BLOCK_D), D)
    allowed = _window_mask(t, i, lo, hi, sink_end, window) & ((i < sink_end) == in_sinks)[None, :]
    scores = tl.where(allowed, _dot(q_tile, tl.trans(k_tile), BF16_DOT) * scale, float("-inf"))
    return scores, i, allowed, k_tile


@triton.jit
def _window_setup(bounds, sinks, H: tl.constexpr):
    """Program ids of the first two axes of a (block, batch row · head[, ...]) grid → (block, row, head, lo, hi,
    sink_end)."""
    pid, bh = tl.program_id(0), tl.program_id(1)
    row, h = bh // H, bh % H
    lo, hi = tl.load(bounds + 2 * row), tl.load(bounds + 2 * row + 1)
    return pid, row, h, lo, hi, tl.minimum(lo + sinks, hi)


@triton.autotune(configs=_configs(), key=["D", "V"], prune_configs_by={"early_config_prune": _spill_free})
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
    q_tile = _load_tile(q + (token0 * H + h) * D, t, T, H * D, tl.arange(0, BLOCK_D), D)
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
        acc = acc * rescale[:, None] + _dot(p, _load_tile(v_base, i, hi, H * V, vv, V), BF16_DOT)
        argmax = tl.where(block_max > running_max, tl.min(i, axis=0) + tl.argmax(scores, axis=1), argmax)
        running_max = new_max
    stats = (token0 + t) * H + h  # offsets into the [B, T, H] buffers
    _store_tile(num + h * V, acc, token0 + t, token0 + T, H * V, vv, V)
    tl.store(den + stats, running_sum, mask=t < T)
    tl.store(row_max + stats, tl.where(running_max == float("-inf"), 0.0, running_max), mask=t < T)
    tl.store(row_argmax + stats, argmax, mask=t < T)


@triton.jit
def _window_score_grads(scores, allowed, i, row_max, argmax, d_max, dnum_tile, dden, v_tile, BF16_DOT: tl.constexpr):
    """p_ti = e^{s_ti − c_t} and ds_ti = p_ti·(dnum_t·v_i + dden_t) + dc_t·[i = argmax_t] for a [queries, keys] tile."""
    p = tl.exp(scores - row_max[:, None])
    ds = p * (_dot(dnum_tile, tl.trans(v_tile), BF16_DOT) + dden[:, None])
    return p, ds + tl.where(allowed & (i[None, :] == argmax[:, None]), d_max[:, None], 0.0)


@triton.jit
def _window_load_row_grads(dnum, dden, row_max, row_argmax, d_max, token0, t, T, h, H: tl.constexpr,
                           V: tl.constexpr, BLOCK_V: tl.constexpr):
    """dnum [len(t), BLOCK_V] and the per-query dden, c, argmax and dc of queries t of one row and head."""
    stats = (token0 + t) * H + h
    dnum_tile = _load_tile(dnum + h * V, token0 + t, token0 + T, H * V, tl.arange(0, BLOCK_V), V)
    return (dnum_tile, tl.load(dden + stats, mask=t < T, other=0.0), tl.load(row_max + stats, mask=t < T, other=0.0),
            tl.load(row_argmax + stats, mask=t < T, other=0), tl.load(d_max + stats, mask=t < T, other=0.0))


@triton.autotune(configs=_configs(), key=["D", "V"], prune_configs_by={"early_config_prune": _spill_free})
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
    q_tile = _load_tile(q + (token0 * H + h) * D, t, T, H * D, dd, D)
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
        v_tile = _load_tile(v_base, i, hi, H * V, tl.arange(0, BLOCK_V), V)
        _, ds = _window_score_grads(scores, allowed, i, max_rows, argmax_rows, d_max_rows, dnum_tile, dden_rows,
                                    v_tile, BF16_DOT)
        acc += _dot(ds, k_tile, BF16_DOT)
    _store_tile(dq + (token0 * H + h) * D, acc * scale, t, T, H * D, dd, D)


@triton.jit
def _window_key_block_grads(q, dnum, dden, row_max, row_argmax, d_max, token0, t, i, allowed, k_tile, v_tile, scale,
                            T, h, H: tl.constexpr, D: tl.constexpr, V: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_V: tl.constexpr, BF16_DOT: tl.constexpr):
    """The contributions of queries t to dv_i (Σ_t p_ti dnum_t, [len(i), BLOCK_V]) and to dk_i / scale (Σ_t ds_ti q_t,
    [len(i), BLOCK_D]) of keys i (tiles k_tile, v_tile), counting the pairs in `allowed` [len(t), len(i)]."""
    q_tile = _load_tile(q + (token0 * H + h) * D, t, T, H * D, tl.arange(0, BLOCK_D), D)
    dnum_tile, dden_rows, max_rows, argmax_rows, d_max_rows = _window_load_row_grads(
        dnum, dden, row_max, row_argmax, d_max, token0, t, T, h, H, V, BLOCK_V
    )
    scores = tl.where(allowed, _dot(q_tile, tl.trans(k_tile), BF16_DOT) * scale, float("-inf"))
    p, ds = _window_score_grads(scores, allowed, i, max_rows, argmax_rows, d_max_rows, dnum_tile, dden_rows, v_tile,
                                BF16_DOT)
    return _dot(tl.trans(p), dnum_tile, BF16_DOT), _dot(tl.trans(ds), q_tile, BF16_DOT)


@triton.jit
def _window_reach(i, window, BLOCK_N: tl.constexpr):
    """The first query past the window reach of key i's block of BLOCK_N keys (blocks from token 0): the queries of
    `_window_dkdv_kernel`'s program for that block stop there."""
    return (i // BLOCK_N) * BLOCK_N + BLOCK_N - 1 + window


@triton.autotune(configs=_configs(), key=["D", "V"], prune_configs_by={"early_config_prune": _spill_free})
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
    k_tile = _load_tile(k + (token0 * H + h) * D, i, T, H * D, dd, D)
    v_tile = _load_tile(v + (token0 * H + h) * V, i, T, H * V, vv, V)
    if SINK_GRADS:  # the accumulators start from the sinks' sums past the reach (zero for the other keys)
        sink = i - lo  # the keys' ranks among the row's sinks
        is_sink = ((sink >= 0) & (i < sink_end))[:, None]
        sink_base = row.to(tl.int64) * sinks * H + h
        dk_acc = tl.load(sink_dk + sink_base * D + _tile_offsets(sink, H * D, dd), mask=is_sink & (dd < D)[None, :],
                         other=0.0)
        dv_acc = tl.load(sink_dv + sink_base * V + _tile_offsets(sink, H * V, vv), mask=is_sink & (vv < V)[None, :],
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
    _store_tile(dk + (token0 * H + h) * D, dk_acc * scale, i, T, H * D, dd, D)
    _store_tile(dv + (token0 * H + h) * V, dv_acc, i, T, H * V, vv, V)


@triton.autotune(configs=_configs(), key=["D", "V"], prune_configs_by={"early_config_prune": _spill_free})
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
    k_tile = _load_tile(k + (token0 * H + h) * D, i, sink_end, H * D, dd, D)
    v_tile = _load_tile(v + (token0 * H + h) * V, i, sink_end, H * V, vv, V)
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
    _store_tile(sink_dk + base * D, dk_acc, sink, sinks, H * D, dd, D)
    _store_tile(sink_dv + base * V, dv_acc, sink, sinks, H * V, vv, V)


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
            BLOCK_D=_block(head_dim, 256), BLOCK_V=_block(value_dim, 256),
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
# Backend entry points (arguments already validated by `ops.linear_attention` / `ops.window_attention`)
# ---------------------------------------------------------------------------------------------------------------


def unsupported_inputs(tensors: dict[str, Tensor], window_head_dims: tuple[int, int] | None = None) -> str | None:
    """Why the triton backend cannot take these tensors (device, interpreter, dtypes, window head dims), or None.

    `ops` asks before picking the backend for "auto" and raises this message for an explicit backend="triton".
    window_head_dims: (D, V) of the window softmax part, which the kernels take up to MAX_WINDOW_HEAD_DIM.
    """
    if not HAS_TRITON:
        return "backend 'triton' needs the triton package (pip install triton); backend 'torch' runs anywhere"
    devices = {x.device for x in tensors.values()}
    if len(devices) > 1:
        return f"backend 'triton' needs all tensors on one device, got {sorted(map(str, devices))}"
    device = devices.pop()
    if device.type != "cuda" and not INTERPRET:
        return (
            f"backend 'triton' runs on CUDA tensors, got tensors on {device}; on CPU use backend 'torch' (or set "
            "TRITON_INTERPRET=1 before importing hf_linear_attn to run the kernels in the slow Triton interpreter)"
        )
    for name, x in tensors.items():
        if x.dtype not in SUPPORTED_DTYPES:
            return (
                f"backend 'triton' takes float16, bfloat16 or float32 tensors, got {name} in {x.dtype} "
                "(backend 'torch' handles float64)"
            )
    if window_head_dims is not None and max(window_head_dims) > MAX_WINDOW_HEAD_DIM:
        head_dim, value_dim = window_head_dims
        return (
            f"backend 'triton' supports window head dims up to {MAX_WINDOW_HEAD_DIM}, got D = {head_dim}, "
            f"V = {value_dim}"
        )
    return None


def _linear(q, k, v, log_decay, initial_state, *, scale, chunks, out_dtype, normalize):
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
    are built once per tensor, see `_packed_chunks`). No host sync otherwise. Returns o [B, T, H, V] in v's dtype and
    the fp32 final state (None unless output_final_state).
    """
    chunks = _batch_chunks(*q.shape[:2], q.device) if cu_seqlens is None else _packed_chunks(cu_seqlens, q.device)
    o, den, final_state = _linear(
        q, k, v, log_decay, initial_state, scale=scale, chunks=chunks,
        out_dtype=torch.float32 if normalize else v.dtype, normalize=normalize,
    )
    if normalize:
        o = (o / (den[..., None] + NORM_EPS)).to(v.dtype)
    return o, final_state if output_final_state else None


def real_token_bounds(key_padding_mask: Tensor | None, batch: int, length: int, device: torch.device) -> Tensor:
    """int32 [B, 2]: each row's real tokens [lo, hi), which the window kernels take to be contiguous (left or right
    padding; `ops.window_attention` checks it where it checks values)."""
    if key_padding_mask is None:
        return torch.tensor([[0, length]], dtype=torch.int32, device=device).expand(batch, 2).contiguous()
    lo = key_padding_mask.int().argmax(-1)  # the first real token (0 for a row without any)
    hi = lo + key_padding_mask.sum(-1)
    return torch.stack([lo, hi], dim=1).int()


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
    linear, linear_den, state = _linear(
        q_feat, k_older, v_older, log_decay, initial_state, scale=1.0, chunks=_batch_chunks(batch, length, q.device),
        out_dtype=torch.float32, normalize=True,
    )

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    num, den = _WindowSoftmax.apply(q, k, v, bounds, scale, min(window_size, length), num_sink_tokens)
    gamma = torch.sigmoid(window_gate.float())
    o = divide_at_real_queries(
        gamma[:, None] * num + linear, (gamma * den + linear_den)[..., None], real[..., None, None]
    )
    return o.to(v.dtype), state if output_final_state else None
