"""Chunked linear attention and chunked sliding-window hybrid attention in plain PyTorch.

Runs on any device and is differentiable by autograd. The sequence is cut into chunks of CHUNK_SIZE
tokens: the state carried between chunks gives each chunk the contribution of everything before it, and
a small masked C x C product gives the contribution from inside the chunk. Work O(T·C·(K + V) + T·K·V),
memory O(T·C + (T/C)·K·V) per head (vector decay adds O(T·K·(L + C/L)), L = VECTOR_SUB_BLOCK), and no T x T
tensor. Arguments, shapes, dtypes and the state layout are those of the oracles in `ops_reference`.

In float32 the decay between two positions is a difference of prefix sums of log_decay within a chunk,
so its absolute error is about 1e-7 · |Σ log_decay over the chunk|: negligible for ordinary decays,
1e-4 relative at −30 per step; exp never overflows whatever the decay. Log decays below
`ops_common.log_decay_floor` (−87 in float32), −inf included, are raised to it first: they decay to 0 all
the same, and the differences stay free of nan (−inf − (−inf)) and of huge magnitudes.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops_common import (
    CHUNK_SIZE,
    accumulation_dtype,
    divide_at_real_queries,
    log_decay_floor,
    normalized,
    splits_packed_sequences,
    window_linear_inputs,
    window_token_masks,
)

SCAN_GROUP_SIZE = 16  # decays: chunks per group of the inter-chunk state scan (see _decayed_prefix_states)
# Vector decay: rows per sub-block of the intra-chunk product in torch (memory O(C·K·(L + C/L)) per chunk:
# small L keeps the explicit [L, L, K] decays small); must divide CHUNK_SIZE. The Triton kernels pick their own.
VECTOR_SUB_BLOCK = 8


def _masked_exp(exponent: Tensor, mask: Tensor) -> Tensor:
    """exp(exponent) where mask, else 0, in place of exponent (a temporary: the vector-decay ones are the
    largest tensors here). The mask is added as a 0 / −inf bias before exp, which keeps exp and its gradient
    finite, and has no work in backward (a masked_fill would mask the gradient once more)."""
    bias = torch.zeros(mask.shape, dtype=exponent.dtype, device=exponent.device).masked_fill_(~mask, -torch.inf)
    return exponent.add_(bias).exp_()


def _vector_decay_scores(q: Tensor, k: Tensor, b: Tensor) -> Tensor:
    """A[t, i] = Σ_k q_tk k_ik exp(b_tk − b_ik) for i ≤ t, 0 above the diagonal, per chunk.

    q, k, b: [..., C, K] with b the cumulative log decay within the chunk (non-increasing along C).
    Returns [..., C, C]. exp(b_t − b_i) is never formed for i > t (it may overflow): for keys in earlier
    sub-blocks than the query it is factored as exp(b_t − r) · exp(r − b_i) around r = b at the end of the
    sub-block before the query's, where both exponents are ≤ 0, and those scores are one matmul; inside a
    sub-block an explicit masked [L, L, K] decay is used. Memory O(C·K·(L + C/L)) per chunk instead of
    O(C·C·K).
    """
    *lead, length, key_dim = q.shape
    size = VECTOR_SUB_BLOCK
    blocks = length // size
    qs, ks, bs = (x.reshape(*lead, blocks, size, key_dim) for x in (q, k, b))

    # r_m = b just before sub-block m starts (0 for m = 0, where no earlier key exists anyway).
    r = F.pad(b, (0, 0, 1, 0))[..., :length:size, :]  # [..., M, K]
    q_tilde = qs * (bs - r[..., None, :]).exp()  # [..., M, L, K]
    earlier = torch.arange(length, device=q.device) < size * torch.arange(blocks, device=q.device)[:, None]
    # Exponents below add −b rather than subtract b: backward would negate a subtrahend's full-size gradient.
    k_tilde = k[..., None, :, :] * _masked_exp(r[..., None, :] + (-b)[..., None, :, :], earlier[..., None])
    scores = q_tilde @ k_tilde.transpose(-1, -2)  # [..., M, L, C], 0 for keys not in earlier sub-blocks

    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = _masked_exp(bs[..., :, None, :] + (-bs)[..., None, :, :], causal[..., None])  # [..., M, L, L, K]
    # A matrix-vector product per query contracts K (einsum would run one tiny bmm per (t, i) pair).
    diagonal = (decay * ks[..., None, :, :]) @ qs[..., None]  # [..., M, L (t), L (i), 1]
    scores = scores.view(*lead, blocks, size, blocks, size)
    scores.diagonal(dim1=-4, dim2=-2).copy_(diagonal[..., 0].movedim(-3, -1))  # into the diagonal sub-blocks
    return scores.view(*lead, length, length)


def _intra_chunk_scores(q: Tensor, k: Tensor, b: Tensor | None) -> Tensor:
    """Causal decayed scores inside each chunk: q, k [..., C, K], b None or [..., C, 1 | K] -> [..., C, C]."""
    if b is None:
        return (q @ k.transpose(-1, -2)).tril_()
    if b.shape[-1] == 1:
        causal = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).tril()
        return (q @ k.transpose(-1, -2)) * _masked_exp(b - b.transpose(-1, -2), causal)
    return _vector_decay_scores(q, k, b)


def _decayed_prefix_states(chunk_states: Tensor, chunk_log_decay: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The state each chunk starts from under decay: E_0 = state, E_{n+1} = exp(g_n) ⊙ E_n + C_n.

    chunk_states C: [B, H, N, K, V]; chunk_log_decay g: [B, H, N, 1 | K] (≤ 0), the log decay over each whole
    chunk, applied to the rows of the state; state: [B, H, K, V]. Returns E [B, H, N, K, V] and the final
    state E_N. A loop over chunks runs a few small ops per chunk in forward and backward, whose fixed cost
    dominated at long T; here the chunks form groups of L = SCAN_GROUP_SIZE, solved all at once, and only the
    G group boundaries are a loop. With a_j the log decay from the group start to chunk j's start,
    E_j = exp(a_j) ⊙ E_0 + Σ_{m<j} exp(a_j − a_{m+1}) ⊙ C_m: every exponent is ≤ 0 and masked before exp.
    """
    batch, heads, chunks, key_dim, value_dim = chunk_states.shape
    size = SCAN_GROUP_SIZE
    groups = -(-chunks // size)
    # Zero padding to whole groups: a chunk with C = 0 and g = 0 leaves the state as it is.
    pad = groups * size - chunks
    c = F.pad(chunk_states, (0, 0, 0, 0, 0, pad)).view(batch, heads, groups, size, key_dim, value_dim)
    g = F.pad(chunk_log_decay, (0, 0, 0, pad)).view(batch, heads, groups, size, -1)
    after = g.cumsum(dim=3)  # a_{m+1}: to the end of chunk m, [B, H, G, L, 1 | K]
    before = F.pad(after, (0, 0, 1, 0))  # a_j, j = 0 .. L (the next group's start), [B, H, G, L + 1, 1 | K]
    earlier = torch.arange(size, device=g.device) < torch.arange(size + 1, device=g.device)[:, None]  # m < j
    weights = _masked_exp(before[..., :, None, :] - after[..., None, :, :], earlier[..., None])  # [.., L + 1, L, ·]
    inside = torch.einsum("...jmk,...mkv->...jkv", weights.expand(*weights.shape[:-1], key_dim), c)

    # unbind once: indexing [:, :, n] inside the loop would make autograd scatter every step's gradient into
    # a zero tensor of the full [B, H, G, ...] size, i.e. O(G²) work in backward.
    decays, contributions = before[..., -1, :, None].exp().unbind(dim=2), inside[..., -1, :, :].unbind(dim=2)
    starts = []  # the state each group starts from
    for decay, contribution in zip(decays, contributions, strict=True):
        starts.append(state)
        state = decay * state + contribution
    entering = before[..., :-1, :, None].exp() * torch.stack(starts, dim=2)[:, :, :, None] + inside[..., :-1, :, :]
    return entering.view(batch, heads, groups * size, key_dim, value_dim)[:, :, :chunks], state


def _to_chunks(x: Tensor, dtype: torch.dtype, chunk_size: int, ones_column: bool = False) -> Tensor:
    """[B, T, H, D] -> [B, H, N, C, D (+ 1 if ones_column)], contiguous in dtype, in one copy.

    Contiguous, every chunk is a plain matrix and the batched matmuls run on views, without copies. The tail
    is zero padded to whole chunks: a step with k = v = log_decay = 0 is a no-op. ones_column appends a
    column of ones, whose output is the normaliser; its padding is ones too, harmless since k is zero there.
    """
    batch, length, heads, dim = x.shape
    chunks = -(-length // chunk_size)
    pad = (0, int(ones_column), 0, chunks * chunk_size - length)
    x = x.to(dtype).transpose(1, 2)
    # F.pad allocates a contiguous result, but with nothing to pad it clones x's strides.
    x = F.pad(x, pad, value=float(ones_column)) if any(pad) else x.contiguous()
    return x.view(batch, heads, chunks, chunk_size, x.shape[-1])


@splits_packed_sequences
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
) -> tuple[Tensor, Tensor | None]:
    """Chunked linear attention.

    q, k: [B, T, H, K]; v: [B, T, H, V]; log_decay: None or [B, T, H, 1 | K] (≤ 0); initial_state: None or
    [B, H, K, V (+ 1 if normalize)]; cu_seqlens: None or [N + 1] (B == 1, each sequence run on its own).
    Returns o [B, T, H, V] in v's dtype and the final state (None unless output_final_state).
    """
    batch, length, heads, key_dim = q.shape
    value_dim, out_dtype = v.shape[-1], v.dtype
    dtype = accumulation_dtype(q, k, v)
    # Precision is chosen here (`dtype`): under autocast, bmm would return bf16 and the in-place fp32
    # accumulation below would fail.
    with torch.autocast(q.device.type, enabled=False):
        q, k = _to_chunks(q, dtype, CHUNK_SIZE), _to_chunks(k, dtype, CHUNK_SIZE)
        v = _to_chunks(v, dtype, CHUNK_SIZE, ones_column=normalize)  # [B, H, N, C, V (+ 1)]
        # b: log of the decay accumulated from the chunk start, [B, H, N, C, 1 | K]; None skips all decay math.
        b = None
        if log_decay is not None:
            b = _to_chunks(log_decay, dtype, CHUNK_SIZE).clamp(min=log_decay_floor(dtype)).cumsum(dim=3)

        if initial_state is None:
            state = q.new_zeros(batch, heads, key_dim, v.shape[-1])
        else:
            state = initial_state.to(dtype)
        # Each chunk's own contribution to the state (every key decayed to the chunk end), then the state each
        # chunk starts from.
        if b is None:
            chunk_states = k.transpose(-1, -2) @ v  # [B, H, N, K, V (+ 1)]
            # Without decay the state entering chunk n is a plain (exclusive) prefix sum over chunks.
            entering = torch.cat([state[:, :, None], chunk_states[:, :, :-1]], dim=2).cumsum_(dim=2)
            state = entering[:, :, -1] + chunk_states[:, :, -1]
        else:
            b_last = b[..., -1:, :]  # [B, H, N, 1, 1 | K]
            chunk_states = (k * (b_last - b).exp()).transpose(-1, -2) @ v
            entering, state = _decayed_prefix_states(chunk_states, b_last[..., 0, :], state)

        q_decayed = q if b is None else q * b.exp()  # decay from the chunk start to each query
        # o = scale · (intra-chunk scores @ v + q_decayed @ entering state): the second product and the scale go
        # into the first one's result in place, as bmm's alpha and beta.
        o = torch.bmm(_intra_chunk_scores(q, k, b).flatten(0, 2), v.flatten(0, 2))
        o = o.baddbmm_(q_decayed.flatten(0, 2), entering.flatten(0, 2), beta=scale, alpha=scale)
        o = o.view(v.shape)  # [B, H, N, C, V (+ 1)]
    if normalize:
        o = normalized(o, value_dim)
    o = o.permute(0, 2, 3, 1, 4).reshape(batch, -1, heads, value_dim)[:, :length]
    return o.to(out_dtype), state if output_final_state else None


def chunk_window_attention(
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
    """Sliding-window softmax + linear attention (LoLCATs) without a T x T tensor.

    Same arguments and result as `ops_reference.reference_window_attention`. The linear part is causal
    linear attention against keys and values shifted forward by window_size positions, decayed by log_decay
    at the queries' own steps (a key delayed to position j + window_size is decayed by a_i for
    i = j + window_size + 1 .. t, exactly the hybrid's d_tj); the softmax part
    runs over blocks of CHUNK_SIZE queries, each against its window range of keys plus the sink keys
    (`_window_softmax`, all blocks at once).
    Memory O(T·(C + window_size + num_sink_tokens)).
    """
    batch, length, heads, head_dim = q.shape
    value_dim = v.shape[-1]
    dtype = accumulation_dtype(q, k, v, q_feat, k_feat)
    q, k, v_acc, q_feat, k_feat = (x.to(dtype) for x in (q, k, v, q_feat, k_feat))
    real, sink = window_token_masks(key_padding_mask, batch, length, num_sink_tokens, q.device)
    window_keys = real & ~sink  # keys reached through the window range or the linear part

    # Linear part: causal (decayed) linear attention on delayed keys and values (see `window_linear_inputs`);
    # the ones column returns the denominator with the numerator.
    v_ones = torch.cat([v_acc, torch.ones_like(v_acc[..., :1])], dim=-1)
    k_older, v_older = window_linear_inputs(k_feat, v_ones, real, sink, window_size)
    linear, state = chunk_linear_attention(
        q_feat, k_older, v_older, log_decay, scale=1.0, initial_state=initial_state,
        output_final_state=output_final_state,
    )  # [B, T, H, V + 1]

    # The sinks, gathered once: positions of the first num_sink_tokens real tokens of each row (a row with
    # fewer real tokens gets some non-sink positions, masked out by sink_ok).
    num_sinks = min(num_sink_tokens, length)
    sink_pos = torch.argsort(sink.to(torch.int8), dim=-1, descending=True, stable=True)[:, :num_sinks]
    sink_ok = sink.gather(1, sink_pos)  # [B, S]
    gather = sink_pos[:, :, None, None]
    k_sink = k.gather(1, gather.expand(-1, -1, heads, head_dim))
    v_sink = v_ones.gather(1, gather.expand(-1, -1, heads, value_dim + 1))

    softmax = _window_softmax(q, k, v_ones, window_keys, k_sink, v_sink, sink_ok, sink_pos, window_size, scale)

    gamma = torch.sigmoid(window_gate.to(dtype))[:, None]  # [H, 1]
    total = gamma * softmax + linear
    o = divide_at_real_queries(total[..., :value_dim], total[..., value_dim:], real[..., None, None])
    return o.to(v.dtype), state


def _window_softmax(
    q: Tensor, k: Tensor, values: Tensor, window_keys: Tensor, k_sink: Tensor, v_sink: Tensor, sink_ok: Tensor,
    sink_pos: Tensor, window_size: int, scale: float,
) -> Tensor:
    """The window hybrid's softmax terms, unnormalised: Σ_i exp(s_ti − c_t) [v_i, 1] over the sinks and the keys
    of t's window, as [B, T, H, V + 1] (the last column is the softmax's denominator).

    q, k: [B, T, H, D]; values: [B, T, H, V + 1]; window_keys: bool [B, T], keys reachable through the window
    range; k_sink: [B, S, H, D], v_sink: [B, S, H, V + 1], sink_ok: bool [B, S] and sink_pos: [B, S], the sinks.
    Queries are taken in blocks of CHUNK_SIZE; block n sees the keys from nC − (W − 1) to nC + C − 1, a span
    of C + W − 1 keys, and every block's span is one strided view (`unfold`) of the keys padded by W − 1 at the
    front (W capped at T): one batched product for all blocks, whose backward is one pass, where a loop of slices would
    allocate and fill a full-size gradient per block. Memory O(T·(C + W + S)) per head, as the scores are.
    """
    batch, length, heads, head_dim = q.shape
    # A window longer than the sequence reaches back to its start: no key lies further back than length − 1.
    size, front = CHUNK_SIZE, min(window_size, length) - 1
    blocks = -(-length // size)
    span = size + front
    back = blocks * size - length

    def spans(x: Tensor) -> Tensor:  # [B, T, ...] -> [B, N, ..., span]: block n's window range, zero padded
        pad = [0, 0] * (x.dim() - 2) + [front, back]
        return F.pad(x, pad).unfold(1, span, size)

    q_blocks = F.pad(q, (0, 0, 0, 0, 0, back)).view(batch, blocks, size, heads, head_dim)
    scores = torch.cat([
        torch.einsum("bnchd,bshd->bnhcs", q_blocks, k_sink),
        torch.einsum("bnchd,bnhds->bnhcs", q_blocks, spans(k)),
    ], dim=-1) * scale  # [B, N, H, C, S + span]

    # Query t = nC + c sees key j of its span (position nC − front + j) iff c ≤ j ≤ c + front: inside the window
    # and not in the future, the same band for every block; pads at either end are not window keys.
    c = torch.arange(size, device=q.device)[:, None]
    j = torch.arange(span, device=q.device)
    in_range = spans(window_keys)[:, :, None, :] & ((c <= j) & (j <= c + front))  # [B, N, C, span]
    t = torch.arange(blocks * size, device=q.device).view(blocks, size)
    sinks_seen = sink_ok[:, None, None, :] & (sink_pos[:, None, None, :] <= t[..., None])  # [B, N, C, S]
    allowed = torch.cat([sinks_seen, in_range], dim=-1)[:, :, None]  # [B, N, 1, C, S + span]
    scores = scores.masked_fill(~allowed, -torch.inf)
    top = scores.amax(-1, keepdim=True)
    top = torch.where(top.isfinite(), top, 0.0)  # a pad query has an empty window: keep exp(−inf − top) = 0
    weights = (scores - top).exp()
    sink_count = k_sink.shape[1]
    out = (torch.einsum("bnhcs,bshv->bnchv", weights[..., :sink_count], v_sink)
           + torch.einsum("bnhcs,bnhvs->bnchv", weights[..., sink_count:], spans(values)))
    return out.reshape(batch, blocks * size, heads, -1)[:, :length]
