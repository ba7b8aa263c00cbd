"""Chunked (gated) delta rule in plain PyTorch: the WY / UT-transform form, differentiable by autograd.

Per batch row and head, with a_t = exp(log_decay_t) and q̃_t = scale · q_t:

    S_t = a_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ q̃_t

How the chunked form follows. Write the update as a decay plus one rank-one write,

    S_t = a_t S_{t−1} + k_t u_tᵀ        u_t = β_t (v_t − a_t S_{t−1}ᵀ k_t)

u_t is the "pseudo-value": the part of v_t the decayed state does not already predict, scaled by β_t. Inside a
chunk of C tokens starting from the state S_0, let D(i, t) = Σ_{i<s≤t} log_decay_s (the log decay from just
after token i to token t; i = −1 is the chunk start) and Γ_t = exp(D(−1, t)). Unrolling the first line:

    S_t = Γ_t S_0 + Σ_{i≤t} exp(D(i, t)) k_i u_iᵀ

Putting S_{t−1} back into u_t, every u_t depends linearly on the earlier u_i of the chunk and on S_0:

    u_t + Σ_{i<t} β_t exp(D(i, t)) (k_t·k_i) u_i = β_t v_t − β_t Γ_t S_0ᵀ k_t

which for the whole chunk is (I + A) U = diag(β) V − diag(β Γ) K S_0, with A strictly lower triangular,
A[t, i] = β_t exp(D(i, t)) k_t·k_i. One unit-lower-triangular solve per chunk (the "UT transform") gives

    W_v = (I + A)⁻¹ (β ⊙ V)        W_k = (I + A)⁻¹ (β Γ ⊙ K)        U = W_v − W_k S_0

where W_v and W_k depend only on the chunk, so they are computed for all chunks at once; only U needs S_0.
Then the outputs and the state after the chunk are

    O   = (Γ ⊙ Q̃) S_0 + (M ⊙ Q̃ Kᵀ) U        M[t, i] = exp(D(i, t)) for i ≤ t, else 0
    S_C = Γ_{C−1} S_0 + (exp(D(i, C−1)) ⊙ K)ᵀ U

Everything but S_0 is computed for all chunks at once (batched products over [B, H, N, ...]); the only
sequential part is a loop over chunks of two C x K by K x V products, U = W_v − W_k S_0 and K_Cᵀ U with
K_C = exp(D(i, C−1)) ⊙ K, which yields the state entering every chunk; O then is a batched product again.
(Carrying S_C = P S_0 + R with P = Γ_{C−1} I − K_Cᵀ W_k instead would loop over one product per chunk but
cost two more batched products, for P and R, and a third for U after the loop.) Without decay
(log_decay = 0) this is DeltaNet; with it, Gated DeltaNet.

On CPU the time goes to the batched C x C and C x K products and the elementwise passes over the [N, C, C] decay
and score matrices.

D is not a difference of prefix sums: each D(i, ·) is its own cumulative sum over tokens s > i, so a decay of
exp(−inf) = 0 (a full reset) gives D = −inf past it and never −inf − (−inf); exp(D) and its gradient stay finite,
and in float32 the decays carry no cancellation error.

Packed sequences (cu_seqlens) are laid out in one stream of chunks, each sequence padded with zero tokens
(k = v = β = log_decay = 0, which leave the state as it is) to a whole number of chunks, so every sequence starts
at a chunk boundary and the loop restarts the state there. Work O(T·(C + K)·(K + V)), memory O(T·C + T/C·K·(K + V))
per head, no T x T tensor. Arguments, shapes and dtypes are those of `ops_delta_rule.recurrent_delta_rule`.
"""

import torch
from torch import Tensor

from .ops_common import accumulation_dtype

# Tokens per chunk. Not ops_common.CHUNK_SIZE (64, the Triton kernels'): on CPU the forward+backward at T = 4K,
# K = V = 64 (one thread) measured 32 fastest, ~15% ahead of 64 and of 16, 128 far behind: halving C halves the
# C x C work but doubles the per-chunk state products and the steps of the loop over chunks.
CHUNK_SIZE = 32


class _UnitLowerTriangularSolve(torch.autograd.Function):
    """W = (I + A)⁻¹ R for strictly lower-triangular A [..., C, C] (entries on and above its diagonal are ignored)
    and R [..., C, D].

    Forward: T = (I + A)⁻¹ by one batched triangular solve against I, then W = T R. Backward, from
    d(I + A)⁻¹ = −T dA T: ∂L/∂R = Tᵀ ∂L/∂W and ∂L/∂A = −(∂L/∂R) Wᵀ below the diagonal (zero elsewhere, as A is
    read only there): two batched products with the saved T and W. Autograd through `torch.linalg.solve_triangular`
    would solve again in the backward, and a batch of small solves on CPU runs several times slower than products
    of the same size.
    """

    @staticmethod
    def forward(ctx, a: Tensor, rhs: Tensor) -> Tensor:
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
        inverse = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
        w = inverse @ rhs
        ctx.save_for_backward(inverse, w)
        return w

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_w: Tensor) -> tuple[Tensor, Tensor]:
        inverse, w = ctx.saved_tensors
        grad_rhs = inverse.transpose(-1, -2) @ grad_w
        return -(grad_rhs @ w.transpose(-1, -2)).tril(-1), grad_rhs


class _ChunkStates(torch.autograd.Function):
    """The sequential part: per chunk c, U_c = W_v,c − W_k,c S and S ← Γ_c S + K_c U_c, from each sequence's
    initial state.

    w_v [N, R, C, V], w_k [N, R, C, K], k_to_end [N, R, K, C] (K_c, the chunk's K_Cᵀ), decay_to_end [N, R, 1, 1]
    (Γ_c) for N chunks of R = B·H rows; initial [S, R, K, V] for S sequences; chunks[n] the chunk range of
    sequence n.
    Returns the state entering each chunk [N, R, K, V], the pseudo-values U [N, R, C, V] and the final state of
    each sequence [S, R, K, V].

    Written as a Function so that the loop runs outside autograd, into preallocated outputs (measured ~4% faster
    forward+backward at T = 4K than autograd through the loop), and the backward (the same recurrence in reverse)
    loops only over what is sequential: from the gradient dS' of the state after
    chunk c, dU_c += K_cᵀ dS' and dS = Γ_c dS' − W_k,cᵀ dU_c + ∂L/∂S_c. The gradients of W_v, W_k, K_c and Γ_c
    then are batched products over all chunks.
    """

    @staticmethod
    def forward(ctx, w_v: Tensor, w_k: Tensor, k_to_end: Tensor, decay_to_end: Tensor, initial: Tensor,
                chunks: list[range]) -> tuple[Tensor, Tensor, Tensor]:
        # Detached: autograd sees only this Function, and `out=` refuses inputs that require grad, which they do
        # where the forward is traced inline (torch.export) rather than run under the Function's no-grad mode.
        w_v, w_k, k_to_end, decay_to_end, initial = (x.detach() for x in (w_v, w_k, k_to_end, decay_to_end, initial))
        entering = w_v.new_empty(*w_v.shape[:2], *initial.shape[2:])
        u = torch.empty_like(w_v)
        finals = torch.empty_like(initial)
        for n, sequence_chunks in enumerate(chunks):
            if not sequence_chunks:
                finals[n] = initial[n]
                continue
            entering[sequence_chunks.start] = initial[n]
            for c in sequence_chunks:  # each state is written where it is kept: entering the next chunk, or final
                torch.baddbmm(w_v[c], w_k[c], entering[c], alpha=-1, out=u[c])
                after = entering[c + 1] if c + 1 in sequence_chunks else finals[n]
                torch.baddbmm(decay_to_end[c] * entering[c], k_to_end[c], u[c], out=after)
        ctx.chunks = chunks
        ctx.save_for_backward(w_k, k_to_end, decay_to_end, entering, u)
        return entering, u, finals

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_entering: Tensor, grad_u: Tensor, grad_finals: Tensor):
        w_k, k_to_end, decay_to_end, entering, u = ctx.saved_tensors
        grad_u = grad_u.clone()  # becomes the full gradient of U, dU_c + K_cᵀ dS'
        grad_after = torch.empty_like(entering)  # dS' of each chunk
        grad_initial = torch.empty_like(grad_finals)
        for n, sequence_chunks in enumerate(ctx.chunks):
            grad_state = grad_finals[n]
            for c in reversed(sequence_chunks):
                grad_after[c] = grad_state
                grad_u[c].baddbmm_(k_to_end[c].transpose(-1, -2), grad_state)
                grad_state = torch.baddbmm(decay_to_end[c] * grad_state + grad_entering[c], w_k[c].transpose(-1, -2),
                                           grad_u[c], alpha=-1)
            grad_initial[n] = grad_state
        grad_w_k = -(grad_u @ entering.transpose(-1, -2))
        grad_k_to_end = grad_after @ u.transpose(-1, -2)
        grad_decay_to_end = (grad_after * entering).sum((-1, -2), keepdim=True)
        return grad_u, grad_w_k, grad_k_to_end, grad_decay_to_end, grad_initial, None


def _chunk_layout(length: int, bounds: list[int], device: torch.device) -> tuple[Tensor, Tensor, list[range]]:
    """Where each token goes in the chunk stream of the sequences bounds[n]:bounds[n + 1] of a length-T axis.

    Returns (source, real, chunks): source [T'] maps each stream position to its token, or to T (a zero pad
    token) where the stream pads a sequence to a multiple of CHUNK_SIZE; real [T] holds the stream position of
    each token (to gather the outputs back); chunks[n] is the range of chunk indices of sequence n (empty for a
    zero-length sequence).
    """
    source, real, chunks = [], [], []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        count = -(-(end - start) // CHUNK_SIZE)
        real += range(len(source), len(source) + end - start)
        chunks.append(range(len(source) // CHUNK_SIZE, len(source) // CHUNK_SIZE + count))
        source += [*range(start, end), *[length] * (count * CHUNK_SIZE - (end - start))]
    # Built on the host from Python ints: no device synchronisation.
    source, real = torch.tensor(source, device=device), torch.tensor(real, device=device)
    return source, real, chunks


def chunk_delta_rule(
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
    """The delta rule chunk by chunk (see the module docstring for the derivation).

    q, k: [B, T, H, K]; v: [B, T, H, V]; beta, log_decay (None = no decay): [B, T, H]. initial_state: None or
    [N, H, K, V] with N = B, or the number of sequences with cu_seqlens ([N + 1] boundaries, B == 1).
    Returns o [B, T, H, V] in v's dtype and the final state [N, H, K, V] (None unless output_final_state), in
    float32 (float64 for float64 inputs).
    """
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    tensors = [q, k, v, beta] + ([] if log_decay is None else [log_decay])
    dtype = accumulation_dtype(*tensors)
    if log_decay is None:
        log_decay = q.new_zeros(batch, length, heads, dtype=dtype)
    # Precision is chosen here (`dtype`): under autocast the products below would come out in bf16 and meet the
    # fp32 state inside `_ChunkStates` (a mixed-dtype baddbmm fails).
    with torch.autocast(q.device.type, enabled=False):
        bounds = [0, length] if cu_seqlens is None else cu_seqlens.tolist()
        source, real, chunks = _chunk_layout(length, bounds, q.device)
        num_chunks = len(source) // CHUNK_SIZE
        # the zero token(s) `source` points at: the padding of a single sequence, one to gather from for packed ones
        pad_tokens = len(source) - length if cu_seqlens is None else 1

        def to_chunks(x: Tensor) -> Tensor:
            """[B, T, H, ...] → [num_chunks, B·H, C, ...] in the accumulation dtype, pad tokens zero."""
            x = x.to(dtype)
            if pad_tokens:
                x = torch.cat([x, x.new_zeros((batch, pad_tokens, *x.shape[2:]))], dim=1)
            if cu_seqlens is not None:  # packed sequences are gathered into whole chunks; one needs only the padding
                x = x.index_select(1, source)
            x = x.unflatten(1, (num_chunks, CHUNK_SIZE)).movedim(3, 2).movedim(0, 1)  # [N, B, H, C, ...]
            return x.flatten(1, 2)

        out_dtype = v.dtype
        q, k, v, beta, g = (to_chunks(x) for x in (q, k, v, beta, log_decay))
        q = q * scale  # Q̃

        # D[..., i, t] = Σ_{i<s≤t} g_s for t ≥ i: a cumulative sum over s of g_s masked to s > i, per row i (along
        # the last dim: along another one its backward is several times slower).
        token = torch.arange(CHUNK_SIZE, device=q.device)
        strictly_lower, causal = token[:, None] > token[None, :], token[:, None] >= token[None, :]  # [C, C]
        decay_sums = torch.where(strictly_lower.T, g[..., None, :], 0.0).cumsum(-1)  # [N, B·H, C, C]
        # M[t, i] = exp(D(i, t)) for i ≤ t; −inf before exp keeps exp and its gradient finite above the diagonal
        pair_decay = torch.where(causal, decay_sums.transpose(-1, -2), -torch.inf).exp()
        gamma = g.cumsum(-1).exp()  # Γ_t = exp(D(−1, t)), [N, B·H, C]

        # KKᵀ and Q̃Kᵀ in one product, both masked by the decays: [.., 0, t, i] = M ⊙ KKᵀ, [.., 1, t, i] = M ⊙ Q̃Kᵀ
        decayed_products = (torch.cat([k, q], dim=-2) @ k.transpose(-1, -2)).unflatten(-2, (2, CHUNK_SIZE))
        decayed_keys, scores = (decayed_products * pair_decay[..., None, :, :]).unbind(-3)  # each [N, B·H, C, C]

        # The UT transform: [W_v, W_k] = (I + A)⁻¹ [β ⊙ V, β Γ ⊙ K], one batched solve.
        ut_system = beta[..., None] * decayed_keys  # A below its diagonal, the only part the solve reads
        rhs = torch.cat([beta[..., None] * v, (beta * gamma)[..., None] * k], dim=-1)  # [N, B·H, C, V + K]
        w = _UnitLowerTriangularSolve.apply(ut_system, rhs)
        w_v, w_k = w.split([value_dim, key_dim], dim=-1)  # split, not slices: a slice's backward fills a full zero

        # The only sequential part: the state entering each chunk S_0 and U = W_v − W_k S_0.
        k_to_end = (pair_decay[..., -1, :, None] * k).transpose(-1, -2)  # K_Cᵀ, [N, B·H, K, C]
        decay_to_end = gamma[..., -1, None, None]  # Γ_{C−1}, [N, B·H, 1, 1]
        # [S, B·H, K, V]: one sequence of B·H rows, or S packed sequences of H rows (B = 1)
        initial_shape = (len(chunks), batch * heads, key_dim, value_dim)
        initial = (q.new_zeros(initial_shape) if initial_state is None
                   else initial_state.to(dtype).reshape(initial_shape))
        s0, u, finals = _ChunkStates.apply(w_v, w_k, k_to_end.contiguous(), decay_to_end, initial, chunks)

        o = (gamma[..., None] * q) @ s0 + scores @ u  # (Γ ⊙ Q̃) S_0 + (M ⊙ Q̃Kᵀ) U, [N, B·H, C, V]
        o = o.unflatten(1, (batch, heads)).movedim(0, 1).movedim(2, 3).flatten(1, 2)  # [B, T', H, V]
        o = o[:, :length] if cu_seqlens is None else o.index_select(1, real)
        return o.to(out_dtype), finals.reshape(-1, heads, key_dim, value_dim) if output_final_state else None
