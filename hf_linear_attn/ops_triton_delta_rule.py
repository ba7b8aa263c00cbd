"""Triton kernels for `delta_rule_attention` (backend "triton"): the chunked (gated) delta rule, forward and backward.

Same arguments, results and state layout as the torch chunked backend (`ops_delta_rule_chunked`), whose module
docstring derives the chunked form; the kernels run on CUDA tensors, or on CPU under the Triton interpreter
(TRITON_INTERPRET=1 set before import: slow, for tests). Inputs may be float16, bfloat16 or float32, key dim
K ≤ MAX_KEY_DIM; states and every sum are float32. Without triton this module still imports (`HAS_TRITON` False).
Memory layout, chunk tables, tile helpers and the interpreter guard are those of `ops_triton_common`.

Forward, per chunk of C tokens (q̃ = scale·q, b_t the log decay summed from the chunk start to t, Γ_t = e^{b_t},
M[t, i] = e^{b_t − b_i} for i ≤ t, else 0; S_0 the state entering the chunk, S_C the one leaving it):

    A   = strictly lower part of diag(β) (M ⊙ K Kᵀ)          T = (I + A)⁻¹   (the UT transform)
    W_k = T (βΓ ⊙ K)        W_v = T (β ⊙ V)                   (`_ut_transform_kernel`, every chunk at once)
    U   = W_v − W_k S_0                                        (pseudo-values, `_delta_state_pass_kernel`:
    S_C = Γ_last S_0 + K̄ᵀ U,    K̄_i = e^{b_last − b_i} k_i      the only sequential part)
    O   = (Γ ⊙ Q̃) S_0 + P U,    P = M ⊙ Q̃ Kᵀ                   (`ops_triton_linear.chunk_output`)

Backward, with dO and dS_C (the gradient of the state leaving the chunk; the final state's for the last chunk):

    dU   = Pᵀ dO + K̄ dS_C
    dS_0 = Γ_last dS_C + (Γ ⊙ Q̃)ᵀ dO − W_kᵀ dU                  (`_delta_reverse_state_pass_kernel`)

then, chunk by chunk, `_delta_score_grads_kernel` (dR, dv and the [C, C] gradients w.r.t. P and A, which contract
over V) and `_delta_chunk_dqk_kernel` (dq and dk in blocks of K; dβ and db are summed from one part per kernel and K
block). U = T R with R = β ⊙ (V − Γ ⊙ K S_0) (the right-hand side of (I + A) U = R, the same as W_v − W_k S_0), so
dR = Tᵀ dU and, as dT = dU Rᵀ and T R = U, dA = −Tᵀ dT Tᵀ = −dR Uᵀ:

    dq̃   = Γ ⊙ (dO S_0ᵀ) + (M ⊙ dO Uᵀ) K
    dk   = (M ⊙ dO Uᵀ)ᵀ Q̃ + e^{b_last − b} ⊙ (U dS_Cᵀ) − βΓ ⊙ (dR S_0ᵀ) + (dG + dGᵀ) K,    dG = β ⊙ M ⊙ dA
    dv   = β ⊙ dR      dβ_t = (v_t − Γ_t S_0ᵀ k_t)·dR_t + Σ_{i<t} dA_ti M_ti k_t·k_i

and the gradient w.r.t. b, the log decay summed from the chunk start (each factor e^{b_t − b_i} gives its term's
x·dx to row t and takes it from row i; Γ_t = e^{b_t} only gives):

    db_t = q̃_t·dq̃_t − k_t·dk_t^{(P, S_C)} − β_t Γ_t (S_0ᵀ k_t)·dR_t + Σ_i (dA ⊙ A)_ti − Σ_s (dA ⊙ A)_st
           (+ Σ S_C ⊙ dS_C at the chunk's last token, whose decay scales the whole state S_C)

where dk^{(P, S_C)} is the part of dk from P and from S_C; d log_decay is the reverse cumulative sum of db over each
chunk. Exponents are differences b_t − b_i ≤ 0 (i ≤ t): nothing overflows however strong the decay; a −inf log
decay (a reset) is raised to `log_decay_floor` first so that no difference is −inf − (−inf).

T is found by forward substitution over the C rows (row t of T is e_t − Σ_{m<t} A_tm T_m), stored per chunk
(fp32 [tokens, H, C], as the scores of `ops_triton_linear`) with W_k, W_v and U (fp32 [tokens, H, K | V]) and the states
at the chunk boundaries; backward recomputes them from the inputs instead of keeping them alive.
"""

import torch
from torch import Tensor

from . import ops_triton_common
from .ops_common import CHUNK_SIZE, log_decay_floor
from .ops_triton_common import (
    DECAY_NONE,
    HAS_TRITON,
    INTERPRET,
    Chunks,
    autotune_configs,
    batch_chunks,
    block_size,
    causal_decay,
    chunk_bounds,
    chunk_cumsum,
    decay_mode,
    dot,
    load_decay,
    load_tile,
    start_state_pass,
    state_base,
    store_tile,
    tl,
    triton,
    usable_configs,
)
from .ops_triton_linear import chunk_output

__all__ = ["HAS_TRITON", "triton_delta_rule", "unsupported_delta_rule_inputs"]

# The state passes hold whole fp32 [CHUNK, K] tiles (their products contract over K): at K = 128 they take up to
# 224 KiB of shared memory on a Hopper GPU, which has 227 KiB (benchmarks/gpu_compile_check.py).
MAX_KEY_DIM = 128
# The K block of `_delta_chunk_dqk_kernel`: at K = V = 128 an sm_90 compile of whole 128-wide ones spills registers.
DQK_KEY_WIDTH = 64


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(x, h, rows, row_end, H: tl.constexpr):
    """x[rows, h] of a [tokens, H] buffer as a fp32 [len(rows), 1] tile, 0 where rows ≥ row_end."""
    return load_tile(x + h, rows, row_end, H, tl.arange(0, 1), 1).to(tl.float32)


@triton.jit
def _strictly_lower(CHUNK: tl.constexpr):
    """[CHUNK, CHUNK] bool: i < t."""
    local = tl.arange(0, CHUNK)
    return local[:, None] > local[None, :]


@triton.autotune(configs=autotune_configs(), key=["K", "V", "DECAY"],
                 prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _ut_transform_kernel(
    k, v, beta, b, inverse, w_k, w_v, chunk_info,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DECAY: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BF16_DOT: tl.constexpr,
):
    """T = (I + A)⁻¹ with A[t, i] = β_t e^{b_t − b_i} k_t·k_i (i < t), then W_k = T (βΓ ⊙ K), W_v = T (β ⊙ V).

    k: [tokens, H, K]; v: [tokens, H, V]; beta: [tokens, H]; b: fp32 [tokens, H, 1] or unused (DECAY_NONE);
    inverse: fp32 [tokens, H, CHUNK], the row of token t holds row t of its chunk's T; w_k, w_v: fp32 [tokens, H,
    K | V]. Rows past the chunk's end read zeros: their rows of A vanish and T is the identity there.
    Grid: (chunks, H).
    """
    chunk, h = tl.program_id(0), tl.program_id(1)
    start, end, _ = chunk_bounds(chunk_info, chunk)
    rows = start + tl.arange(0, CHUNK)
    local = tl.arange(0, CHUNK)
    beta_rows = _load_rows(beta, h, rows, end, H)  # [CHUNK, 1]
    b_rows = load_decay(b, h, rows, end, 0, H, K, DECAY)  # [CHUNK, 1]
    gram = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_tile = load_tile(k + h * K, rows, end, H * K, k0 + tl.arange(0, BLOCK_K), K)
        gram += dot(k_tile, tl.trans(k_tile), BF16_DOT)
    system = tl.where(_strictly_lower(CHUNK), beta_rows * gram * causal_decay(b_rows, False, CHUNK), 0.0)  # A

    # Forward substitution: rows m < t of T are final when row t (still e_t) is solved; A[t, m ≥ t] = 0.
    solved = tl.where(local[:, None] == local[None, :], 1.0, 0.0)
    for t in range(1, CHUNK):
        system_row = tl.sum(tl.where(local[:, None] == t, system, 0.0), axis=0)  # A[t, :]
        row = tl.sum(system_row[:, None] * solved, axis=0)  # Σ_m A[t, m] T[m, :]
        solved = tl.where(local[:, None] == t, solved - row[None, :], solved)
    store_tile(inverse + h * CHUNK, solved, rows, end, H * CHUNK, local, CHUNK)

    beta_gamma = beta_rows * tl.exp(b_rows)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_tile = load_tile(k + h * K, rows, end, H * K, kk, K).to(tl.float32)
        store_tile(w_k + h * K, dot(solved, k_tile * beta_gamma, False), rows, end, H * K, kk, K)
    for v0 in range(0, V, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        v_tile = load_tile(v + h * V, rows, end, H * V, vv, V).to(tl.float32)
        store_tile(w_v + h * V, dot(solved, v_tile * beta_rows, False), rows, end, H * V, vv, V)


@triton.autotune(configs=autotune_configs(), key=["K", "V", "DECAY"],
                 prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _delta_state_pass_kernel(
    k, w_k, w_v, b, init, states, pseudo_values, seq_info,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DECAY: tl.constexpr, HAS_INIT: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Carries each sequence's state through its chunks: U = W_v − W_k S_0, S_C = Γ_last S_0 + K̄ᵀ U.

    Slot first + j of `states` receives the state entering chunk j, slot first + n (n chunks) the final state;
    pseudo_values receives U. k: [tokens, H, K]; w_k, w_v: fp32 [tokens, H, K | V]; b: fp32 [tokens, H, 1] or
    unused; init: fp32 [sequences, H, K, V]; states: fp32 [slots, H, K, V]; pseudo_values: fp32 [tokens, H, V];
    seq_info: int32 [sequences, 3] (first token, end token, first slot).
    Grid: (V / BLOCK_V, sequences · H); a program owns all K rows of one [K, BLOCK_V] column block of a state.
    """
    tl.static_assert(BLOCK_K >= K)
    h, kk, vv, first_token, end_token, first_slot, num_chunks, state = start_state_pass(
        seq_info, init, 0, tl.program_id(0), tl.program_id(1), H, K, V, HAS_INIT, CHUNK, BLOCK_K, BLOCK_V
    )
    for j in range(num_chunks):
        store_tile(state_base(states, first_slot + j, h, H, K, V), state, kk, K, V, vv, V)
        start = first_token + j * CHUNK
        end = tl.minimum(start + CHUNK, end_token)
        rows = start + tl.arange(0, CHUNK)
        w_k_tile = load_tile(w_k + h * K, rows, end, H * K, kk, K)
        pseudo = load_tile(w_v + h * V, rows, end, H * V, vv, V) - dot(w_k_tile, state, False)
        store_tile(pseudo_values + h * V, pseudo, rows, end, H * V, vv, V)
        b_rows = load_decay(b, h, rows, end, 0, H, K, DECAY)
        b_last = load_decay(b, h, end - 1 + tl.arange(0, 1), end, 0, H, K, DECAY)  # [1, 1]
        k_tile = load_tile(k + h * K, rows, end, H * K, kk, K).to(tl.float32) * tl.exp(b_last - b_rows)
        state = state * tl.exp(b_last) + dot(tl.trans(k_tile), pseudo, False)
    store_tile(state_base(states, first_slot + num_chunks, h, H, K, V), state, kk, K, V, vv, V)


@triton.autotune(configs=autotune_configs(), key=["K", "V", "DECAY"],
                 prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _delta_reverse_state_pass_kernel(
    q, k, do, w_k, b, d_final, dstates, d_pseudo_values, seq_info, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DECAY: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BF16_DOT: tl.constexpr,
):
    """The state gradients, last chunk first: dU = Pᵀ dO + K̄ dS_C, dS_0 = Γ_last dS_C + (Γ ⊙ Q̃)ᵀ dO − W_kᵀ dU.

    Slot first + j + 1 of `dstates` receives the gradient of the state leaving chunk j (the last one: d_final),
    slot first that of the initial state; d_pseudo_values holds Pᵀ dO (`ops_triton_linear.chunk_output` without states,
    every chunk at once) and receives dU. q, k: [tokens, H, K]; do: [tokens, H, V]; w_k: fp32 [tokens, H, K]; b:
    fp32 [tokens, H, 1] or unused; d_final: fp32 [sequences, H, K, V]; dstates: fp32 [slots, H, K, V];
    d_pseudo_values: fp32 [tokens, H, V]; seq_info as in `_delta_state_pass_kernel`.
    Grid: (V / BLOCK_V, sequences · H).
    """
    tl.static_assert(BLOCK_K >= K)
    h, kk, vv, first_token, end_token, first_slot, num_chunks, d_state = start_state_pass(
        seq_info, d_final, 0, tl.program_id(0), tl.program_id(1), H, K, V, True, CHUNK, BLOCK_K, BLOCK_V
    )
    for i in range(num_chunks):
        j = num_chunks - 1 - i
        store_tile(state_base(dstates, first_slot + j + 1, h, H, K, V), d_state, kk, K, V, vv, V)
        start = first_token + j * CHUNK
        end = tl.minimum(start + CHUNK, end_token)
        rows = start + tl.arange(0, CHUNK)
        q_tile = load_tile(q + h * K, rows, end, H * K, kk, K)
        k_tile = load_tile(k + h * K, rows, end, H * K, kk, K).to(tl.float32)
        b_rows = load_decay(b, h, rows, end, 0, H, K, DECAY)
        b_last = load_decay(b, h, end - 1 + tl.arange(0, 1), end, 0, H, K, DECAY)
        # Γ ⊙ Q̃ is a row scaling: it goes onto the [CHUNK, BLOCK_V] tile of dO instead of the [CHUNK, K] one of q.
        do_tile = load_tile(do + h * V, rows, end, H * V, vv, V).to(tl.float32) * (scale * tl.exp(b_rows))
        d_pseudo = (load_tile(d_pseudo_values + h * V, rows, end, H * V, vv, V)
                    + dot(k_tile * tl.exp(b_last - b_rows), d_state, False))  # Pᵀ dO + K̄ dS_C
        store_tile(d_pseudo_values + h * V, d_pseudo, rows, end, H * V, vv, V)
        w_k_tile = load_tile(w_k + h * K, rows, end, H * K, kk, K)
        d_state = (d_state * tl.exp(b_last) + dot(tl.trans(q_tile), do_tile, BF16_DOT)
                   - dot(tl.trans(w_k_tile), d_pseudo, False))
    store_tile(state_base(dstates, first_slot, h, H, K, V), d_state, kk, K, V, vv, V)


@triton.autotune(configs=autotune_configs(), key=["K", "V", "DECAY"],
                 prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _delta_score_grads_kernel(
    k, v, beta, b, do, pseudo_values, d_pseudo_values, inverse, dv, score_grads, dbeta_parts, db_parts, chunk_info,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DECAY: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BF16_DOT: tl.constexpr, PARTS: tl.constexpr,
):
    """Of one chunk: dR = Tᵀ dU, dv = β ⊙ dR, the gradients w.r.t. P and A, and the parts of dβ and db that do not
    split over K (formulas in the module docstring). Loops over V, then over K for the Gram matrix K Kᵀ.

    Overwrites dU (d_pseudo_values) with dR, which `_delta_chunk_dqk_kernel` reads. score_grads receives, on and
    below the diagonal of row t's [CHUNK] slice, M ⊙ dO Uᵀ (the gradient w.r.t. P), strictly above it the
    transposed dG = β ⊙ M ⊙ dA (strictly lower itself: two triangles in one square). Part 0 of dbeta_parts receives
    v·dR + Σ_i dA_ti M_ti k_t·k_i, part 0 of db_parts Σ_i (dA ⊙ A)_ti − Σ_s (dA ⊙ A)_st.
    k: [tokens, H, K]; v, do, dv: [tokens, H, V]; beta: [tokens, H]; b: fp32 [tokens, H, 1] (unused for
    DECAY_NONE); pseudo_values, d_pseudo_values: fp32 [tokens, H, V]; inverse, score_grads: fp32 [tokens, H,
    CHUNK]; dbeta_parts, db_parts: fp32 [tokens, H, PARTS] (db_parts unused for DECAY_NONE). Grid: (chunks, H).
    """
    chunk, h = tl.program_id(0), tl.program_id(1)
    start, end, _ = chunk_bounds(chunk_info, chunk)
    rows = start + tl.arange(0, CHUNK)
    local = tl.arange(0, CHUNK)
    beta_rows = _load_rows(beta, h, rows, end, H)
    solved = load_tile(inverse + h * CHUNK, rows, end, H * CHUNK, local, CHUNK)  # T
    d_scores = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dO Uᵀ
    d_system = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # −dR Uᵀ, the gradient w.r.t. A (where i < t)
    dbeta_acc = tl.zeros([CHUNK, 1], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        pseudo = load_tile(pseudo_values + h * V, rows, end, H * V, vv, V)
        d_rhs = dot(tl.trans(solved), load_tile(d_pseudo_values + h * V, rows, end, H * V, vv, V), False)  # dR
        store_tile(d_pseudo_values + h * V, d_rhs, rows, end, H * V, vv, V)
        store_tile(dv + h * V, d_rhs * beta_rows, rows, end, H * V, vv, V)
        v_tile = load_tile(v + h * V, rows, end, H * V, vv, V).to(tl.float32)
        dbeta_acc += tl.sum(v_tile * d_rhs, axis=1, keep_dims=True)
        d_scores += dot(load_tile(do + h * V, rows, end, H * V, vv, V), tl.trans(pseudo), BF16_DOT)
        d_system -= dot(d_rhs, tl.trans(pseudo), False)
    gram = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_tile = load_tile(k + h * K, rows, end, H * K, k0 + tl.arange(0, BLOCK_K), K)
        gram += dot(k_tile, tl.trans(k_tile), BF16_DOT)

    # Through A = β_t M_ti k_t·k_i (i < t).
    decay = causal_decay(load_decay(b, h, rows, end, 0, H, K, DECAY), False, CHUNK)  # M
    d_system = d_system * tl.where(_strictly_lower(CHUNK), decay, 0.0)  # dA ⊙ M
    dbeta_acc += tl.sum(d_system * gram, axis=1, keep_dims=True)
    d_gram = d_system * beta_rows
    store_tile(score_grads + h * CHUNK, d_scores * decay + tl.trans(d_gram), rows, end, H * CHUNK, local, CHUNK)
    store_tile(dbeta_parts + h * PARTS, dbeta_acc, rows, end, H * PARTS, tl.arange(0, 1), 1)
    if DECAY != DECAY_NONE:
        d_exponent = d_gram * gram  # dA ⊙ A: row t gains it, row i loses it
        db_acc = tl.sum(d_exponent, axis=1, keep_dims=True) - tl.trans(tl.sum(d_exponent, axis=0, keep_dims=True))
        store_tile(db_parts + h * PARTS, db_acc, rows, end, H * PARTS, tl.arange(0, 1), 1)


@triton.autotune(configs=autotune_configs(), key=["K", "V", "DECAY"],
                 prune_configs_by={"early_config_prune": usable_configs})
@triton.jit
def _delta_chunk_dqk_kernel(
    q, k, beta, b, do, pseudo_values, d_rhs_values, score_grads, states, dstates, dq, dk, dbeta_parts, db_parts,
    chunk_info, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DECAY: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BF16_DOT: tl.constexpr, PARTS: tl.constexpr,
):
    """dq and dk of one block of BLOCK_K key dims of one chunk, and that K block's parts of dβ and db (formulas in
    the module docstring), from U, dR, the gradients w.r.t. P and A (`_delta_score_grads_kernel`) and the states
    and state gradients at the chunk's two ends. Loops over V in blocks.

    Part 1 + (K block) of dbeta_parts receives −Γ (S_0ᵀ k)·dR over the block's key dims, that of db_parts
    q̃·dq̃ − k·dk^{(P, S_C)} − βΓ (S_0ᵀ k)·dR (+ Σ S_C ⊙ dS_C at the chunk's last token) over them.
    q, k, dq, dk: [tokens, H, K]; do: [tokens, H, V]; beta: [tokens, H]; b: fp32 [tokens, H, 1] (unused for
    DECAY_NONE); pseudo_values (U), d_rhs_values (dR): fp32 [tokens, H, V]; score_grads: fp32 [tokens, H, CHUNK];
    states, dstates: fp32 [slots, H, K, V]; dbeta_parts, db_parts: fp32 [tokens, H, PARTS].
    Grid: (chunks, H, K / BLOCK_K).
    """
    tl.static_assert(PARTS == 1 + (K + BLOCK_K - 1) // BLOCK_K)
    chunk, h, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end, slot = chunk_bounds(chunk_info, chunk)
    rows = start + tl.arange(0, CHUNK)
    local = tl.arange(0, CHUNK)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    b_rows = load_decay(b, h, rows, end, 0, H, K, DECAY)
    b_last = load_decay(b, h, end - 1 + tl.arange(0, 1), end, 0, H, K, DECAY)
    entering = state_base(states, slot, h, H, K, V)
    leaving = state_base(states, slot + 1, h, H, K, V)
    d_leaving = state_base(dstates, slot + 1, h, H, K, V)

    dq_state = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)  # dO S_0ᵀ
    dk_acc = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)  # e^{b_last − b} ⊙ U dS_Cᵀ
    rhs_state = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)  # dR S_0ᵀ
    state_term = tl.zeros([BLOCK_K, 1], dtype=tl.float32)  # Σ_v S_C ⊙ dS_C
    for v0 in range(0, V, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        s_entering = load_tile(entering, kk, K, V, vv, V)
        ds_leaving = load_tile(d_leaving, kk, K, V, vv, V)
        pseudo = load_tile(pseudo_values + h * V, rows, end, H * V, vv, V)
        dq_state += dot(load_tile(do + h * V, rows, end, H * V, vv, V), tl.trans(s_entering), BF16_DOT)
        dk_acc += dot(pseudo * tl.exp(b_last - b_rows), tl.trans(ds_leaving), False)
        rhs_state += dot(load_tile(d_rhs_values + h * V, rows, end, H * V, vv, V), tl.trans(s_entering), False)
        if DECAY != DECAY_NONE:
            state_term += tl.sum(load_tile(leaving, kk, K, V, vv, V) * ds_leaving, axis=1, keep_dims=True)

    # Through O = (Γ ⊙ Q̃) S_0 + P U and A = β_t M_ti k_t·k_i (i < t); packed as `_delta_score_grads_kernel` says.
    packed = load_tile(score_grads + h * CHUNK, rows, end, H * CHUNK, local, CHUNK)
    d_scores = tl.where(local[:, None] >= local[None, :], packed, 0.0)  # M ⊙ dO Uᵀ
    d_gram = tl.trans(tl.where(local[:, None] < local[None, :], packed, 0.0))  # β ⊙ M ⊙ dA
    k_tile = load_tile(k + h * K, rows, end, H * K, kk, K).to(tl.float32)
    q_tile = load_tile(q + h * K, rows, end, H * K, kk, K).to(tl.float32) * scale
    gamma = tl.exp(b_rows)
    beta_gamma = _load_rows(beta, h, rows, end, H) * gamma
    dq_acc = gamma * dq_state + dot(d_scores, k_tile, False)
    dk_acc += dot(tl.trans(d_scores), q_tile, False)  # dk^{(P, S_C)}
    k_rhs_state = tl.sum(k_tile * rhs_state, axis=1, keep_dims=True)  # (S_0ᵀ k)·dR over this K block
    # Each factor e^{b_t} gives its term's x·dx to row t's db, each e^{−b_i} takes it from row i: queries gain,
    # the keys of P and of S_C lose, the keys of R (the term −βΓ ⊙ (K S_0)) gain.
    db_acc = (tl.sum(q_tile * dq_acc, axis=1, keep_dims=True) - tl.sum(k_tile * dk_acc, axis=1, keep_dims=True)
              - beta_gamma * k_rhs_state)
    db_acc += tl.where(rows[:, None] == end - 1, tl.sum(state_term, axis=0, keep_dims=True), 0.0)
    dk_acc += dot(d_gram, k_tile, False) + dot(tl.trans(d_gram), k_tile, False) - beta_gamma * rhs_state

    store_tile(dq + h * K, dq_acc * scale, rows, end, H * K, kk, K)
    store_tile(dk + h * K, dk_acc, rows, end, H * K, kk, K)
    part = h * PARTS + 1 + pid_k
    store_tile(dbeta_parts + part, -gamma * k_rhs_state, rows, end, H * PARTS, tl.arange(0, 1), 1)
    if DECAY != DECAY_NONE:
        store_tile(db_parts + part, db_acc, rows, end, H * PARTS, tl.arange(0, 1), 1)


# ---------------------------------------------------------------------------------------------------------------
# Launchers and autograd
# ---------------------------------------------------------------------------------------------------------------


def _forward_pass(
    k: Tensor, v: Tensor, beta: Tensor, b: Tensor | None, initial_state: Tensor | None, chunks: Chunks,
    bf16_dot: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """T [.., H, C], W_k [.., H, K], the states at every chunk boundary [slots, H, K, V] and U [.., H, V], fp32."""
    heads, key_dim, value_dim = k.shape[-2], k.shape[-1], v.shape[-1]
    decay = decay_mode(b)
    inverse = k.new_empty(*k.shape[:-1], CHUNK_SIZE, dtype=torch.float32)
    w_k = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    w_v = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    _ut_transform_kernel[(chunks.num_chunks, heads)](  # 32-wide K blocks: 64-wide ones spill registers on sm_90
        k, v, beta, inverse if b is None else b, inverse, w_k, w_v, chunks.chunk_info,
        H=heads, K=key_dim, V=value_dim, DECAY=decay, CHUNK=CHUNK_SIZE, BLOCK_K=block_size(key_dim, 32),
        BLOCK_V=block_size(value_dim), BF16_DOT=bf16_dot,
    )
    states = k.new_empty(chunks.num_slots, heads, key_dim, value_dim, dtype=torch.float32)
    pseudo_values = torch.empty_like(w_v)
    block_v = block_size(value_dim, 32)
    _delta_state_pass_kernel[(triton.cdiv(value_dim, block_v), chunks.num_seqs * heads)](
        k, w_k, w_v, states if b is None else b, states if initial_state is None else initial_state, states,
        pseudo_values, chunks.seq_info,
        H=heads, K=key_dim, V=value_dim, DECAY=decay, HAS_INIT=initial_state is not None, CHUNK=CHUNK_SIZE,
        BLOCK_K=block_size(key_dim, MAX_KEY_DIM), BLOCK_V=block_v,
    )
    return inverse, w_k, states, pseudo_values


class _ChunkedDeltaRule(torch.autograd.Function):
    """The chunked delta rule with carried states; every intermediate is recomputed in backward."""

    @staticmethod
    def forward(ctx, q, k, v, beta, log_decay, initial_state, scale, chunks):
        bf16_dot = q.dtype == torch.bfloat16 and not INTERPRET
        b = None if log_decay is None else chunk_cumsum(log_decay, chunks, reverse=False)
        _, _, states, pseudo_values = _forward_pass(k, v, beta, b, initial_state, chunks, bf16_dot)
        o, _ = chunk_output(
            q, k, pseudo_values, b, None, states, chunks, transpose=False, row_scale=scale, col_scale=1.0,
            out_dtype=v.dtype, bf16_dot=bf16_dot,
        )
        ctx.save_for_backward(q, k, v, beta, log_decay, initial_state)
        ctx.scale, ctx.chunks, ctx.bf16_dot = scale, chunks, bf16_dot
        return o, states[chunks.final_slots]

    @staticmethod
    def backward(ctx, do, d_final_state):
        q, k, v, beta, log_decay, initial_state = ctx.saved_tensors
        scale, chunks, bf16_dot = ctx.scale, ctx.chunks, ctx.bf16_dot
        heads, key_dim, value_dim = k.shape[-2], k.shape[-1], v.shape[-1]
        do, d_final_state = do.contiguous(), d_final_state.float().contiguous()
        b = None if log_decay is None else chunk_cumsum(log_decay, chunks, reverse=False)
        decay = decay_mode(b)
        inverse, w_k, states, pseudo_values = _forward_pass(k, v, beta, b, initial_state, chunks, bf16_dot)

        dstates = torch.empty_like(states)
        d_pseudo_values, _ = chunk_output(  # Pᵀ dO, to which the reverse pass adds K̄ dS_C
            k, q, do, b, None, None, chunks, transpose=True, row_scale=1.0, col_scale=scale, out_dtype=torch.float32,
            bf16_dot=bf16_dot,
        )
        block_k, block_v = block_size(key_dim, MAX_KEY_DIM), block_size(value_dim, 32)
        _delta_reverse_state_pass_kernel[(triton.cdiv(value_dim, block_v), chunks.num_seqs * heads)](
            q, k, do, w_k, states if b is None else b, d_final_state, dstates, d_pseudo_values, chunks.seq_info,
            scale, H=heads, K=key_dim, V=value_dim, DECAY=decay, CHUNK=CHUNK_SIZE, BLOCK_K=block_k,
            BLOCK_V=block_v, BF16_DOT=bf16_dot,
        )

        dv, score_grads = torch.empty_like(v), torch.empty_like(inverse)
        dq_block_k = block_size(key_dim, DQK_KEY_WIDTH)
        parts = 1 + triton.cdiv(key_dim, dq_block_k)  # dβ and db: one part that does not split over K, one per K block
        dbeta_parts = beta.new_empty(*beta.shape, parts, dtype=torch.float32)
        db_parts = None if b is None else b.new_empty(*b.shape[:-1], parts)
        unused = dbeta_parts  # for pointer arguments a specialization does not read
        _delta_score_grads_kernel[(chunks.num_chunks, heads)](  # 32-wide K, 16-wide V blocks: wider ones spill at 128
            k, v, beta, unused if b is None else b, do, pseudo_values, d_pseudo_values, inverse, dv, score_grads,
            dbeta_parts, unused if db_parts is None else db_parts, chunks.chunk_info,
            H=heads, K=key_dim, V=value_dim, DECAY=decay, CHUNK=CHUNK_SIZE, BLOCK_K=block_size(key_dim, 32),
            BLOCK_V=16, BF16_DOT=bf16_dot, PARTS=parts,
        )
        d_rhs_values = d_pseudo_values  # overwritten with dR
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        _delta_chunk_dqk_kernel[(chunks.num_chunks, heads, parts - 1)](
            q, k, beta, unused if b is None else b, do, pseudo_values, d_rhs_values, score_grads, states, dstates,
            dq, dk, dbeta_parts, unused if db_parts is None else db_parts, chunks.chunk_info, scale,
            H=heads, K=key_dim, V=value_dim, DECAY=decay, CHUNK=CHUNK_SIZE, BLOCK_K=dq_block_k, BLOCK_V=block_v,
            BF16_DOT=bf16_dot, PARTS=parts,
        )
        dbeta = dbeta_parts.sum(-1).to(beta.dtype)
        d_log_decay = None
        if db_parts is not None:
            d_log_decay = chunk_cumsum(db_parts.sum(-1, keepdim=True), chunks, reverse=True).to(log_decay.dtype)
        d_initial = None if initial_state is None else dstates[chunks.first_slots].to(initial_state.dtype)
        return dq, dk, dv, dbeta, d_log_decay, d_initial, None, None


def unsupported_delta_rule_inputs(tensors: dict[str, Tensor]) -> str | None:
    """Why the triton backend cannot take these delta-rule tensors (those of `ops_triton_common.unsupported_inputs`,
    and the key dim), or None. `delta_rule_attention` asks before picking the backend for "auto"."""
    problem = ops_triton_common.unsupported_inputs(tensors)
    if problem is None and tensors["k"].shape[-1] > MAX_KEY_DIM:
        problem = (f"backend 'triton' of delta_rule_attention supports key dims K ≤ {MAX_KEY_DIM}, got "
                   f"K = {tensors['k'].shape[-1]}; backend 'torch' takes any")
    return problem


def triton_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Tensor | None,
    *,
    scale: float,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The chunked delta rule in Triton: arguments and results as `ops_delta_rule_chunked.chunk_delta_rule`.

    q, k: [B, T, H, K]; v: [B, T, H, V]; beta, log_decay (None = no decay): [B, T, H]; initial_state: None or
    [N, H, K, V]; cu_seqlens: None or [N + 1] (B == 1). Returns o [B, T, H, V] in v's dtype and the fp32 final
    state (None unless output_final_state).
    """
    batch, length = q.shape[:2]
    chunks = batch_chunks(batch, length, q.device) if cu_seqlens is None else Chunks(cu_seqlens.tolist(), q.device)
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    if log_decay is not None:  # [B, T, H, 1], raised to the floor: see the module docstring
        log_decay = log_decay.clamp(min=log_decay_floor(torch.float32)).unsqueeze(-1).contiguous()
    initial_state = None if initial_state is None else initial_state.float().contiguous()
    o, final_state = _ChunkedDeltaRule.apply(q, k, v, beta, log_decay, initial_state, scale, chunks)
    return o, final_state if output_final_state else None
