"""Chunked linear attention and chunked sliding-window hybrid attention in plain PyTorch.

Runs on any device and is differentiable by autograd. The sequence is cut into chunks of CHUNK_SIZE
tokens: the state carried between chunks gives each chunk the contribution of everything before it, and
a small masked C x C product gives the contribution from inside the chunk. Work O(T·C·(K + V) + T·K·V),
memory O(T·C + (T/C)·K·V) per head (vector decay adds O(T·K·(L + C/L)), L = SUB_CHUNK_SIZE), and no T x T
tensor. Arguments, shapes, dtypes and the state layout are those of the oracles in `ops_reference`.

In float32 the decay between two positions is a difference of prefix sums of log_decay within a chunk,
so its absolute error is about 1e-7 · |Σ log_decay over the chunk|: negligible for ordinary decays,
1e-4 relative at −30 per step; exp never overflows whatever the decay.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops_reference import NORM_EPS, accumulation_dtype, run_per_sequence, window_token_masks

CHUNK_SIZE = 64
SUB_CHUNK_SIZE = 16  # vector decay: sub-block size of the intra-chunk product; must divide CHUNK_SIZE


def _masked_exp(exponent: Tensor, mask: Tensor) -> Tensor:
    """exp(exponent) where mask, else 0. Masking before exp keeps both exp and its gradient finite."""
    return torch.where(mask, exponent, -torch.inf).exp()


def _vector_decay_scores(q: Tensor, k: Tensor, b: Tensor) -> Tensor:
    """A[t, i] = Σ_k q_tk k_ik exp(b_tk − b_ik) for i ≤ t, 0 above the diagonal, per chunk.

    q, k, b: [..., C, K] with b the cumulative log decay within the chunk (non-increasing along C).
    Returns [..., C, C]. exp(b_t − b_i) is never formed for i > t (it may overflow): diagonal sub-blocks
    use an explicit masked [L, L, K] decay; for keys in earlier sub-blocks it is factored as
    exp(b_t − r) · exp(r − b_i) around r = b at the end of the sub-block before the query's, where both
    exponents are ≤ 0. Memory O(C·K·(L + C/L)) per chunk instead of O(C·C·K).
    """
    *lead, length, key_dim = q.shape
    size = SUB_CHUNK_SIZE
    blocks = length // size
    qs, ks, bs = (x.reshape(*lead, blocks, size, key_dim) for x in (q, k, b))

    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = _masked_exp(bs[..., :, None, :] - bs[..., None, :, :], causal[..., None])  # [..., M, L, L, K]
    diagonal = torch.einsum("...tk,...ik,...tik->...ti", qs, ks, decay)  # [..., M, L, L]

    # r_m = b just before sub-block m starts (0 for m = 0, where no earlier key exists anyway).
    r = F.pad(b, (0, 0, 1, 0))[..., :length:size, :]  # [..., M, K]
    q_tilde = qs * (bs - r[..., None, :]).exp()  # [..., M, L, K]
    earlier = torch.arange(length, device=q.device) < size * torch.arange(blocks, device=q.device)[:, None]
    k_tilde = k[..., None, :, :] * _masked_exp(r[..., None, :] - b[..., None, :, :], earlier[..., None])
    off_diagonal = q_tilde @ k_tilde.transpose(-1, -2)  # [..., M, L, C], 0 for keys not in earlier sub-blocks

    eye = torch.eye(blocks, dtype=q.dtype, device=q.device)
    diagonal = torch.einsum("...mti,mn->...mtni", diagonal, eye)  # placed on the block diagonal
    return (off_diagonal.view(*lead, blocks, size, blocks, size) + diagonal).reshape(*lead, length, length)


def _intra_chunk_scores(q: Tensor, k: Tensor, b: Tensor | None) -> Tensor:
    """Causal decayed scores inside each chunk: q, k [..., C, K], b None or [..., C, 1 | K] -> [..., C, C]."""
    length = q.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if b is None:
        return (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)
    if b.shape[-1] == 1:
        return (q @ k.transpose(-1, -2)) * _masked_exp(b - b.transpose(-1, -2), causal)
    return _vector_decay_scores(q, k, b)


def chunk_linear_attention(
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
    """Chunked linear attention.

    q, k: [B, T, H, K]; v: [B, T, H, V]; log_decay: None or [B, T, H, 1 | K] (≤ 0); initial_state: None or
    [B, H, K, V (+ 1 if normalize)]; cu_seqlens: None or [N + 1] (B == 1, each sequence run on its own).
    Returns o [B, T, H, V] in v's dtype and the final state (None unless output_final_state).
    """
    if cu_seqlens is not None:
        return run_per_sequence(
            chunk_linear_attention, q, k, v, log_decay, scale=scale, normalize=normalize,
            initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        )
    batch, length, heads, key_dim = q.shape
    value_dim, out_dtype = v.shape[-1], v.dtype
    dtype = accumulation_dtype(q, k, v)
    chunks = -(-length // CHUNK_SIZE)

    def to_chunks(x: Tensor) -> Tensor:
        """[B, T, H, D] -> [B, H, N, C, D]. Zero padding: a step with k = v = log_decay = 0 is a no-op."""
        x = F.pad(x.to(dtype), (0, 0, 0, 0, 0, chunks * CHUNK_SIZE - length))
        return x.reshape(batch, chunks, CHUNK_SIZE, heads, x.shape[-1]).permute(0, 3, 1, 2, 4)

    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # its output column is the denominator
    q, k, v = to_chunks(q) * scale, to_chunks(k), to_chunks(v)
    # b: log of the decay accumulated from the chunk start, [B, H, N, C, 1 | K]; None skips all decay math.
    b = None if log_decay is None else to_chunks(log_decay).cumsum(dim=3)

    # Each chunk's own contribution to the state (every key decayed to the chunk end), and the decay of the
    # whole chunk applied to the state it starts from.
    if b is None:
        chunk_states, chunk_decay = k.transpose(-1, -2) @ v, None  # [B, H, N, K, V]
    else:
        b_last = b[..., -1:, :]  # [B, H, N, 1, 1 | K]
        chunk_states = (k * (b_last - b).exp()).transpose(-1, -2) @ v
        chunk_decay = b_last.transpose(-1, -2).exp()  # [B, H, N, 1 | K, 1]

    if initial_state is None:
        state = q.new_zeros(batch, heads, key_dim, v.shape[-1])
    else:
        state = initial_state.to(dtype)
    if chunk_decay is None:
        # Without decay the state entering chunk n is a plain (exclusive) prefix sum over chunks.
        entering = torch.cat([torch.zeros_like(chunk_states[:, :, :1]), chunk_states[:, :, :-1]], dim=2)
        entering = state[:, :, None] + entering.cumsum(dim=2)  # [B, H, N, K, V (+ 1)]
        state = entering[:, :, -1] + chunk_states[:, :, -1]
    else:
        # unbind once: indexing [:, :, n] inside the loop would make autograd scatter every step's gradient
        # into a zero tensor of the full [B, H, N, ...] size, i.e. O(N²) work in backward.
        contributions, decays = chunk_states.unbind(dim=2), chunk_decay.unbind(dim=2)
        states = []  # the state each chunk starts from
        for n in range(chunks):
            states.append(state)
            state = decays[n] * state + contributions[n]
        entering = torch.stack(states, dim=2)

    q_decayed = q if b is None else q * b.exp()  # decay from the chunk start to each query
    o = q_decayed @ entering + _intra_chunk_scores(q, k, b) @ v  # [B, H, N, C, V (+ 1)]
    if normalize:
        o = o[..., :value_dim] / (o[..., value_dim:] + NORM_EPS)
    o = o.permute(0, 2, 3, 1, 4).reshape(batch, chunks * CHUNK_SIZE, heads, value_dim)[:, :length]
    return o.to(out_dtype), state if output_final_state else None


def chunk_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_feat: Tensor,
    k_feat: Tensor,
    window_gate: Tensor,
    *,
    window_size: int,
    num_sink_tokens: int,
    scale: float,
    key_padding_mask: Tensor | None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Sliding-window softmax + linear attention (LoLCATs) without a T x T tensor.

    Same arguments and result as `ops_reference.reference_window_attention`. The linear part is causal
    linear attention against keys and values shifted forward by window_size positions; the softmax part
    runs over blocks of CHUNK_SIZE queries, each against its window range of keys plus the sink keys.
    Memory O(T·(C + window_size + num_sink_tokens)).
    """
    batch, length, heads, head_dim = q.shape
    value_dim = v.shape[-1]
    dtype = accumulation_dtype(q, k, v, q_feat, k_feat)
    q, k, v_acc, q_feat, k_feat = (x.to(dtype) for x in (q, k, v, q_feat, k_feat))
    real, sink = window_token_masks(key_padding_mask, batch, length, num_sink_tokens, q.device)
    window_keys = real & ~sink  # keys reached through the window range or the linear part

    # Linear part: key j reaches query t iff t − j ≥ window_size, i.e. plain causal linear attention with
    # keys and values moved window_size steps later. Left or right padding keeps the real tokens contiguous,
    # so the index shift is also the real-token distance. Zeroed keys drop sinks and pads; the ones column
    # returns the denominator with the numerator.
    shift = min(window_size, length)

    def delayed(x: Tensor) -> Tensor:
        return F.pad(x, (0, 0, 0, 0, shift, 0))[:, :length]

    v_ones = torch.cat([v_acc, torch.ones_like(v_acc[..., :1])], dim=-1)
    k_linear = delayed(k_feat * window_keys[..., None, None])
    # The state after the shifted sequence holds exactly the keys older than the next query's window.
    linear, state = chunk_linear_attention(
        q_feat, k_linear, delayed(v_ones), None, scale=1.0,
        initial_state=initial_state, output_final_state=output_final_state,
    )  # [B, T, H, V + 1]

    # The sinks, gathered once: positions of the first num_sink_tokens real tokens of each row (a row with
    # fewer real tokens gets some non-sink positions, masked out by sink_ok).
    num_sinks = min(num_sink_tokens, length)
    sink_pos = torch.argsort(sink.to(torch.int8), dim=-1, descending=True, stable=True)[:, :num_sinks]
    sink_ok = sink.gather(1, sink_pos)  # [B, S]
    gather = sink_pos[:, :, None, None]
    k_sink = k.gather(1, gather.expand(-1, -1, heads, head_dim))
    v_sink = v_ones.gather(1, gather.expand(-1, -1, heads, value_dim + 1))

    blocks = []
    for start in range(0, length, CHUNK_SIZE):
        end = min(start + CHUNK_SIZE, length)
        first = max(0, start - window_size + 1)  # oldest key any query of the block sees in its window
        t = torch.arange(start, end, device=q.device)[:, None]  # [Cq, 1]
        i = torch.arange(first, end, device=q.device)  # [L]
        in_range = window_keys[:, None, first:end] & (i <= t) & (t - i < window_size)  # [B, Cq, L]
        allowed = torch.cat([sink_ok[:, None, :] & (sink_pos[:, None, :] <= t), in_range], dim=-1)
        keys = torch.cat([k_sink, k[:, first:end]], dim=1)  # [B, S + L, H, D]
        values = torch.cat([v_sink, v_ones[:, first:end]], dim=1)  # [B, S + L, H, V + 1]

        scores = torch.einsum("bthd,bihd->bhti", q[:, start:end], keys) * scale
        scores = scores.masked_fill(~allowed[:, None], -torch.inf)
        c = scores.amax(-1, keepdim=True)
        c = torch.where(c.isfinite(), c, 0.0)  # a pad query has an empty window: keep exp(−inf − c) = 0
        blocks.append((scores - c).exp() @ values.transpose(1, 2))  # [B, H, Cq, V + 1]
    softmax = torch.cat(blocks, dim=2).transpose(1, 2)  # [B, T, H, V + 1], last column: Σ exp(s − c)

    gamma = torch.sigmoid(window_gate.to(dtype))[:, None]  # [H, 1]
    total = gamma * softmax + linear
    keep = real[..., None, None]  # pad queries output 0; the 1 avoids 0 / 0 (and nan gradients) there
    o = torch.where(keep, total[..., :value_dim], 0.0) / torch.where(keep, total[..., value_dim:], 1.0)
    return o.to(v.dtype), state
