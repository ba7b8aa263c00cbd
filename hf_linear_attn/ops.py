"""Public entry points of the attention math: `linear_attention` and `window_attention`.

Both validate every input before any work and dispatch to a backend, so callers (the model layers) never
need to know which one ran. Shapes follow `[B, T, H, D]`: batch, time, heads, head dim.

State layout of `linear_attention` (the decode cache depends on it): float32 (float64 for float64
inputs) [B, H, K, V]; with normalize=True [B, H, K, V + 1], whose last column is the normaliser z.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from .ops_chunked import chunk_linear_attention, chunk_window_attention
from .ops_reference import parallel_linear_attention, recurrent_linear_attention, reference_window_attention
from .ops_triton import HAS_TRITON, triton_linear_attention, triton_window_attention

__all__ = ["linear_attention", "window_attention"]

LINEAR_BACKENDS: dict[str, Callable[..., tuple[Tensor, Tensor | None]]] = {
    "recurrent": recurrent_linear_attention,
    "parallel": parallel_linear_attention,
    "torch": chunk_linear_attention,
}
WINDOW_BACKENDS: dict[str, Callable[..., tuple[Tensor, Tensor | None]]] = {
    "reference": reference_window_attention,
    "torch": chunk_window_attention,
}
if HAS_TRITON:  # CUDA tensors, or CPU ones under TRITON_INTERPRET=1 (see ops_triton)
    LINEAR_BACKENDS["triton"] = triton_linear_attention
    WINDOW_BACKENDS["triton"] = triton_window_attention


def _pick_backend(backend: str, available: dict[str, Callable], device: torch.device) -> str:
    """The backend `backend` names, checked against `available`; "auto" resolves to the fastest one for `device`:
    Triton for CUDA tensors when triton is installed, else the torch chunked path."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and "triton" in available else "torch"
    if backend not in available:
        raise ValueError(f"backend must be one of {['auto', *available]}, got {backend!r}")
    return backend


def _check_4d_floating(name: str, x: Tensor, dims: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D {dims}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must have a floating-point dtype, got {x.dtype}")


def _check_cu_seqlens(cu_seqlens: Tensor, batch: int, length: int) -> None:
    if batch != 1:
        raise ValueError(f"cu_seqlens requires packed inputs with batch size 1, got batch size {batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or len(cu_seqlens) < 2:
        raise ValueError(
            "cu_seqlens must be a 1-D int32/int64 tensor [N + 1] of sequence boundaries, "
            f"got shape {tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
        )
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {length}, got {bounds}")
    if any(end < start for start, end in zip(bounds[:-1], bounds[1:], strict=True)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    *,
    scale: float | None = None,
    normalize: bool = False,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Causal linear attention with optional decay, normalisation, carried state and packed sequences.

    Per batch row and head, with a_t = exp(log_decay_t) scaling the K rows of the state S (K x V):

        S_t = a_t ⊙ S_{t-1} + k_t v_tᵀ      o_t = (scale · q_t)ᵀ S_t
        normalize=True: z_t = a_t ⊙ z_{t-1} + k_t,  o_t = (scale · q_t)ᵀ S_t / ((scale · q_t)ᵀ z_t + 1e-6)

    Args:
        q, k: [B, T, H, K], already feature-mapped. v: [B, T, H, V].
        log_decay: None (no decay), [B, T, H] (one decay per head and step; a per-head constant expanded
            over B and T gives a fixed decay) or [B, T, H, K] (one per key dim). All values ≤ 0.
        scale: multiplies q; None means K ** -0.5.
        normalize: divide by the normaliser, as in the Linear Transformer.
        initial_state: None or the state to start from, [B, H, K, V] ([B, H, K, V + 1] if normalize; with
            cu_seqlens, N instead of B).
        output_final_state: also return the state after the last token (same layout, accumulation dtype).
        cu_seqlens: None or int [N + 1] boundaries (0, ..., T) of N sequences packed into a batch of 1;
            the state restarts at each boundary (from initial_state[n] if given).
        backend: "recurrent" (token loop), "parallel" (quadratic), "torch" (chunked), "triton" (chunked
            kernels; when triton is installed) or "auto".

    Returns:
        o: [B, T, H, V] in the dtype of v; the final state, or None unless output_final_state.
    """
    name = _pick_backend(backend, LINEAR_BACKENDS, q.device)
    _check_4d_floating("q", q, "[B, T, H, K]")
    _check_4d_floating("k", k, "[B, T, H, K]")
    _check_4d_floating("v", v, "[B, T, H, V]")
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q, [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {tuple(q.shape[:3])}, got {tuple(v.shape)}")
    if length == 0:
        raise ValueError("q, k, v must hold at least one token, got T = 0")
    if log_decay is not None:
        allowed = [(batch, length, heads), (batch, length, heads, key_dim)]
        if tuple(log_decay.shape) not in allowed:
            raise ValueError(
                f"log_decay must have shape {allowed[0]} or {allowed[1]}, got {tuple(log_decay.shape)}"
            )
        if not log_decay.is_floating_point():
            raise ValueError(f"log_decay must have a floating-point dtype, got {log_decay.dtype}")
        largest = log_decay.max().item()
        if largest > 0:
            raise ValueError(f"log_decay must be ≤ 0 (the log of a decay in (0, 1]), got max {largest:g}")
        if log_decay.dim() == 3:
            log_decay = log_decay[..., None]  # one decay shared by all K rows of the state
    states = batch
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, batch, length)
        states = len(cu_seqlens) - 1
    if initial_state is not None:
        expected = (states, heads, key_dim, value_dim + int(normalize))
        if tuple(initial_state.shape) != expected:
            raise ValueError(
                f"initial_state must have shape {expected} ([N, H, K, V{' + 1' if normalize else ''}], N = "
                f"{'sequences' if cu_seqlens is not None else 'batch'}), got {tuple(initial_state.shape)}"
            )
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state must have a floating-point dtype, got {initial_state.dtype}")
    return LINEAR_BACKENDS[name](
        q, k, v, log_decay,
        scale=key_dim**-0.5 if scale is None else scale,
        normalize=normalize,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


def window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_feat: Tensor,
    k_feat: Tensor,
    window_gate: Tensor,
    *,
    window_size: int,
    num_sink_tokens: int = 0,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Sliding-window softmax + linear attention sharing one normaliser (LoLCATs).

    Query t attends with softmax to the window W_t (keys i ≤ t with t − i < window_size, plus the first
    num_sink_tokens real tokens) and linearly to every older real key (L_t):

        o_t = (Σ_{W_t} γ e^{s_ti − c_t} v_i + Σ_{L_t} (q_feat_t·k_feat_i) v_i)
              / (Σ_{W_t} γ e^{s_ti − c_t} + Σ_{L_t} q_feat_t·k_feat_i)

    with s_ti = scale · q_t·k_i, c_t = max_{i∈W_t} s_ti and γ = sigmoid(window_gate). When window_size ≥ T
    this is exactly causal softmax attention.

    The queries may cover only the last T_q ≤ T positions (q, q_feat [B, T_q, H, ·]): a decode step behind
    a cache's retained keys computes just the new rows, O(T_q·T) instead of O(T²). Only the reference
    backend takes T_q < T ("auto" picks it then); the chunked ones need one query per key.

    Args:
        q, k: [B, T_q, H, D] queries and [B, T, H, D] keys of the softmax part (after RoPE). v: [B, T, H, V].
        q_feat, k_feat: [B, T_q, H, F] and [B, T, H, F] feature-mapped queries and keys of the linear part.
        window_gate: [H] logits of the per-head softmax weight γ.
        window_size: ≥ 1, number of most recent tokens (the query's own included) under softmax.
        num_sink_tokens: ≥ 0, number of first real tokens always under softmax.
        scale: of the softmax scores; None means D ** -0.5.
        key_padding_mask: None or bool [B, T], True for real tokens (the queries are its last T_q
            positions). Pad keys contribute nothing; pad queries output 0. Real tokens must be contiguous
            (left or right padding).
        initial_state: None or [B, H, F, V + 1]: Σ φ(k_j) [v_j, 1]ᵀ over keys older than the whole input
            (a decode cache's folded tokens), added to every query's linear part.
        output_final_state: also return initial_state plus every real, non-sink key that lies outside the
            window of the *next* query (index T), i.e. keys with index ≤ T − 1 − window_size: what a cache
            carries forward beside the last window_size tokens and the sinks.
        backend: "reference" (T x T), "torch" (chunked), "triton" (when triton is installed) or "auto".

    Returns:
        o: [B, T_q, H, V] in the dtype of v; the final linear state (fp32, [B, H, F, V + 1]) or None.
    """
    for arg, x, dims in (
        ("q", q, "[B, T_q, H, D]"),
        ("k", k, "[B, T, H, D]"),
        ("v", v, "[B, T, H, V]"),
        ("q_feat", q_feat, "[B, T_q, H, F]"),
        ("k_feat", k_feat, "[B, T, H, F]"),
    ):
        _check_4d_floating(arg, x, dims)
    batch, length, heads, head_dim = k.shape
    queries = q.shape[1]
    if (q.shape[0], q.shape[2], q.shape[3]) != (batch, heads, head_dim) or queries > length:
        raise ValueError(f"q must be [B, T_q, H, D] with T_q ≤ T and the B, H, D of k {tuple(k.shape)}, "
                         f"got shape {tuple(q.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must have B, T, H = {tuple(k.shape[:3])}, got shape {tuple(v.shape)}")
    if q_feat.shape[:3] != q.shape[:3]:
        raise ValueError(f"q_feat must have B, T_q, H = {tuple(q.shape[:3])}, got shape {tuple(q_feat.shape)}")
    if k_feat.shape != (*k.shape[:3], q_feat.shape[-1]):
        raise ValueError(f"k_feat must have shape {(*k.shape[:3], q_feat.shape[-1])} ([B, T, H, F] with the F of "
                         f"q_feat), got {tuple(k_feat.shape)}")
    if queries == 0:
        raise ValueError("q, k, v must hold at least one token, got T = 0")
    name = "reference" if backend == "auto" and queries < length else _pick_backend(backend, WINDOW_BACKENDS, q.device)
    if queries < length and name != "reference":
        raise ValueError(f"backend {name!r} needs one query per key (T_q = T); got T_q = {queries} < T = {length}: "
                         "use backend 'reference' (or 'auto') for queries behind cached keys")
    if tuple(window_gate.shape) != (heads,) or not window_gate.is_floating_point():
        raise ValueError(
            f"window_gate must be a floating-point tensor of shape ({heads},) (one logit per head), "
            f"got shape {tuple(window_gate.shape)} and dtype {window_gate.dtype}"
        )
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
        raise ValueError(f"window_size must be an int ≥ 1, got {window_size!r}")
    if isinstance(num_sink_tokens, bool) or not isinstance(num_sink_tokens, int) or num_sink_tokens < 0:
        raise ValueError(f"num_sink_tokens must be an int ≥ 0, got {num_sink_tokens!r}")
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (batch, length)
    ):
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape ({batch}, {length}) (True = real token), "
            f"got shape {tuple(key_padding_mask.shape)} and dtype {key_padding_mask.dtype}"
        )
    state_shape = (batch, heads, q_feat.shape[-1], v.shape[-1] + 1)
    if initial_state is not None and (
        tuple(initial_state.shape) != state_shape or not initial_state.is_floating_point()
    ):
        raise ValueError(
            f"initial_state must be a floating-point tensor of shape {state_shape} ([B, H, F, V + 1]), "
            f"got shape {tuple(initial_state.shape)} and dtype {initial_state.dtype}"
        )
    return WINDOW_BACKENDS[name](
        q, k, v, q_feat, k_feat, window_gate,
        window_size=window_size,
        num_sink_tokens=num_sink_tokens,
        scale=head_dim**-0.5 if scale is None else scale,
        key_padding_mask=key_padding_mask,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
