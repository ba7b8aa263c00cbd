"""The op family every layer calls, one op per path: `linear_attention`, `window_attention` (additive or delta
state rule, the sparse memory, packed documents) and `window_softmax` (defined here), `delta_rule_attention` (the
delta rule, re-exported from `ops_delta_rule`, which has its own backends), and the one-token decode steps
`linear_attention_step`, `window_attention_step` and `delta_window_attention_step` (torch steps in `ops_decode`,
fused kernels in `ops_triton_decode`).

Each validates its inputs before any work, picks the backend through `ops_common.pick_backend` and dispatches to
it, so callers (the model layers) pass `backend="auto"` or a user's choice and never need to know which one ran.
Shapes follow `[B, T, H, D]`: batch, time, heads, head dim. Every op takes keys and values with the layer's H_kv
KV heads (grouped-query attention, H_kv dividing the H query heads) and repeats them inside where a form needs one
per query head; features (q_feat, k_feat, q̂, k̂) are per query head.

Backends (the names `BACKENDS`, which the config's `linear_attention_backend` mirrors):
- "recurrent": the token loop (`ops_reference`), the oracle; for `window_attention` the hybrid's one oracle,
  its quadratic form, runs under this name and under "parallel".
- "parallel": the quadratic closed form (`ops_reference`), a second oracle.
- "torch": chunked PyTorch (`ops_chunked`), any device.
- "triton": chunked Triton kernels (`ops_triton_linear`, `ops_triton_window`): CUDA tensors (or CPU ones under
  TRITON_INTERPRET=1), float16, bfloat16 or float32, window head dims up to 256.
- "auto": one query (a decode step) runs the direct form, "recurrent" for linear attention (one state update)
  and the quadratic form for the window (one row of scores over the retained tokens); otherwise "triton" for
  CUDA tensors it supports, else "torch".
`window_attention` takes fewer queries than keys (queries behind a cache's retained keys) with every backend:
the chunked ones get zero queries in front, whose outputs are dropped.

Validation: shapes, dtypes and argument types are always checked. Checks that read tensor values (log_decay
≤ 0 and not nan, cu_seqlens boundaries, the triton window's contiguous padding) would force a host-device sync
in every layer call on a GPU, so they run for CPU tensors only, or for every tensor when the environment
variable HF_LINEAR_ATTN_CHECK_VALUES=1 is set (debugging), and never while torch.compile / torch.export
trace. The backends stay finite without them: any log_decay in [−inf, 0] (−inf: a full reset) gives what
the token loop gives.

State layout of `linear_attention` (the decode cache depends on it): float32 (float64 for float64
inputs) [B, H, K, V]; with normalize=True [B, H, K, V + 1], whose last column is the normaliser z.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops_triton_common
from .backends import BACKENDS, OP_BACKENDS
from .ops_chunked import chunk_linear_attention, chunk_window_attention
from .ops_common import (
    check_4d_floating,
    check_cu_seqlens,
    check_log_decay,
    check_qkv,
    check_sizes,
    checked_scale,
    pick_backend,
    repeat_kv_heads,
)
from .ops_decode import delta_window_decode_step, linear_decode_step, window_decode_step
from .ops_delta_rule import delta_rule_attention, window_delta_rule
from .ops_reference import parallel_linear_attention, recurrent_linear_attention, reference_window_attention
from .ops_sparse_memory import MEMORY_BLOCK_SIZE, KeyFeatureMap, SparseMemory, sparse_window_attention
from .ops_triton_decode import triton_linear_decode_step, triton_window_decode_step
from .ops_triton_linear import triton_linear_attention
from .ops_triton_window import triton_window_attention

__all__ = [
    "BACKENDS",
    "delta_rule_attention",
    "delta_window_attention_step",
    "linear_attention",
    "linear_attention_step",
    "window_attention",
    "window_attention_step",
    "window_softmax",
]


LINEAR_FORMS: dict[str, Callable[..., tuple[Tensor, Tensor | None]]] = {
    "recurrent": recurrent_linear_attention,
    "parallel": parallel_linear_attention,
    "torch": chunk_linear_attention,
    "triton": triton_linear_attention,
}
WINDOW_FORMS: dict[str, Callable[..., tuple[Tensor, Tensor | None]]] = {
    "recurrent": reference_window_attention,  # the hybrid has no token loop: its oracle is the quadratic form
    "parallel": reference_window_attention,
    "torch": chunk_window_attention,
    "triton": triton_window_attention,
}
CHUNKED = ("torch", "triton")  # the forms that need one query per key (ops pads the queries for them)
# The one-token steps (`*_step`): torch (`ops_decode`) and the fused Triton kernels (`ops_triton_decode`).
LINEAR_STEPS: dict[str, Callable[..., Tensor]] = {"torch": linear_decode_step, "triton": triton_linear_decode_step}
WINDOW_STEPS: dict[str, Callable[..., Tensor]] = {"torch": window_decode_step, "triton": triton_window_decode_step}
DELTA_WINDOW_STEPS: dict[str, Callable[..., Tensor]] = {"torch": delta_window_decode_step}


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
        q, k: [B, T, H, K], already feature-mapped (one per query head). v: [B, T, H_kv, V], H_kv dividing H
            (grouped-query attention: each value head serves H / H_kv query heads, repeated inside). B, T, H, K,
            V ≥ 1.
        log_decay: None (no decay), [B, T, H] (one decay per head and step; a per-head constant expanded
            over B and T gives a fixed decay) or [B, T, H, K] (one per key dim). Values in [−inf, 0]; −inf
            forgets everything before the step (a full reset).
        scale: a finite number > 0 that multiplies q; None means K ** -0.5.
        normalize: divide by the normaliser, as in the Linear Transformer.
        initial_state: None or the state to start from, [B, H, K, V] ([B, H, K, V + 1] if normalize; with
            cu_seqlens, N instead of B).
        output_final_state: also return the state after the last token (same layout, accumulation dtype).
        cu_seqlens: None or int [N + 1] boundaries (0, ..., T) of N sequences packed into a batch of 1;
            the state restarts at each boundary (from initial_state[n] if given).
        backend: one of BACKENDS (see the module docstring).

    Returns:
        o: [B, T, H, V] in the dtype of v; the final state, or None unless output_final_state.
    """
    check_qkv(q, k, v)
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    v = repeat_kv_heads(v, heads)
    scale = checked_scale(scale, key_dim**-0.5)
    if log_decay is not None:
        check_log_decay(log_decay, (batch, length, heads), (batch, length, heads, key_dim))
        if log_decay.dim() == 3:
            log_decay = log_decay[..., None]  # one decay shared by all K rows of the state
    states = batch
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, batch, length)
        states = len(cu_seqlens) - 1
    if initial_state is not None:
        expected = (states, heads, key_dim, value_dim + int(normalize))
        if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != expected:
            raise ValueError(
                f"initial_state must have shape {expected} ([N, H, K, V{' + 1' if normalize else ''}], N = "
                f"{'sequences' if cu_seqlens is not None else 'batch'}), got {getattr(initial_state, 'shape', None)}"
            )
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state must have a floating-point dtype, got {initial_state.dtype}")

    tensors = {"q": q, "k": k, "v": v, "log_decay": log_decay, "initial_state": initial_state}
    name = pick_backend(
        backend, q.device, single_query=length == 1, head_dims=(q.shape[-1], v.shape[-1]),
        triton_problem=lambda: ops_triton_common.unsupported_inputs(
            {n: x for n, x in tensors.items() if x is not None}
        ),
    )
    return LINEAR_FORMS[name](
        q, k, v, log_decay,
        scale=scale,
        normalize=normalize,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


def _check_contiguous_padding(key_padding_mask: Tensor) -> None:
    """The triton window kernels take each row's real tokens as one run [lo, hi) (left or right padding)."""
    batch, length = key_padding_mask.shape
    lo, hi = ops_triton_common.real_token_bounds(key_padding_mask, batch, length, key_padding_mask.device).unbind(-1)
    pos = torch.arange(length, device=key_padding_mask.device)
    if not torch.equal((pos >= lo[:, None]) & (pos < hi[:, None]), key_padding_mask):
        raise ValueError("key_padding_mask: backend 'triton' needs the real tokens of each row contiguous (left or "
                         "right padding); backend 'torch' takes any mask")


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
    log_decay: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    update_rule: str = "additive",
    beta: Tensor | None = None,
    state_output: Callable[[Tensor], Tensor] | None = None,
    memory_size: int = 0,
    memory: SparseMemory | None = None,
    key_feature_map: KeyFeatureMap | None = None,
    start_position: int = 0,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, SparseMemory | None]:
    """Sliding-window softmax beside a linear state: the LoLCATs hybrid (additive, optionally decayed, optionally
    with a sparse exact memory) or the delta rule behind a window.

    update_rule="additive": query t attends with softmax to the window W_t (keys i ≤ t with t − i < window_size,
    plus the first num_sink_tokens real tokens) and linearly to every older real key (L_t), one normaliser shared:

        o_t = (Σ_{W_t} γ e^{s_ti − c_t} v_i + Σ_{L_t} (d_tj ⊙ q_feat_t)·k_feat_j v_j)
              / (Σ_{W_t} γ e^{s_ti − c_t} + Σ_{L_t} (d_tj ⊙ q_feat_t)·k_feat_j)

    with s_ti = scale · q_t·k_i, c_t = max_{i∈W_t} s_ti, γ = sigmoid(window_gate) and the decay of key j at
    query t d_tj = Π_{i = j + window_size + 1}^{t} a_i, a_i = exp(log_decay_i) (1 without log_decay; per
    feature dimension for a [B, T, H, F] log_decay). The decay acts on the linear part only and its clock
    starts when the key leaves the window: the linear part is causal linear attention, decayed at every step,
    over keys and values delayed by window_size positions. When window_size ≥ T this is exactly causal
    softmax attention. With memory_size = m > 0 the window runs with the sparse exact memory of
    `ops_sparse_memory` (its module docstring gives the rule; blocks of MEMORY_BLOCK_SIZE absolute positions).

    update_rule="delta": o_t = softmax_t + λ · state_output(S_tᵀ (K^-½ q̂_t)), λ = window_gate (no sigmoid).
    softmax_t is exact softmax over the window and sinks alone, with its own normaliser (`window_softmax`); S holds
    the tokens that have left the window: at new step i the key of index j = (T − T_q) + i − window_size enters,
    S ← a_i (I − β_j k̂_j k̂_jᵀ) S + β_j k̂_j v_jᵀ (`delta_rule_attention`), with β_j = 0 when j is a sink, a pad or
    j < 0 (keys in front of that are taken to be in initial_state already). q_feat, k_feat are then q̂, k̂: the
    L2-normalised features (unit keys, as the delta rule needs).

    The queries may cover only the last T_q ≤ T positions (q, q_feat [B, T_q, H, ·]): a chunk behind a cache's
    retained keys computes just the new rows. Every backend takes T_q < T (the chunked ones compute the rows in
    front too, and drop them).

    Args:
        q: [B, T_q, H, D] queries of the softmax part (after RoPE). k: [B, T, H_kv, D], v: [B, T, H_kv, V], the
            keys and values as the layer projects them: H_kv KV heads dividing H (grouped-query attention, each KV
            head serving H / H_kv query heads; repeated inside where a backend needs them per query head).
            B, T_q, H, D, V ≥ 1.
        q_feat, k_feat: [B, T_q, H, F] and [B, T, H, F] feature-mapped queries and keys of the state part (one per
            query head); F ≥ 1. update_rule="delta": q̂ and k̂ (L2-normalised; k̂ over all T keys).
        window_gate: [H] per-head logits of the softmax weight γ (additive), or the state part's weight λ (delta).
        window_size: ≥ 1, number of most recent tokens (the query's own included) under softmax.
        num_sink_tokens: ≥ 0, number of first real tokens always under softmax.
        scale: of the softmax scores, a finite number > 0; None means D ** -0.5.
        log_decay: None (no decay), [B, T, H] or (additive) [B, T, H, F]: log a_i ≤ 0 at every one of the T
            positions (values in [−inf, 0]; −inf forgets every key that has left the window, and the initial
            state). Positions in front of the queries count too (they decay the initial state): a chunk behind a
            cache's retained keys passes 0 there (their steps have already decayed the cache's state), except with
            a sparse memory, whose retained positions pass their own decays (they decay the folds at the block end).
        key_padding_mask: None or bool [B, T], True for real tokens (the queries are its last T_q
            positions). Pad keys contribute nothing; pad queries output 0. Windows count positions, pads
            included. Backend "triton" needs the real tokens of each row contiguous (left or right padding;
            checked, at the price of one host sync on a GPU), so "auto" picks it only without a mask.
        initial_state: None or the state before the whole input (a cache's). Additive: [B, H, F, V + 1],
            Σ φ(k_j) [v_j, 1]ᵀ over keys older than the input, added to every query's linear part, decayed at query
            t by Π_{i=0}^{t} a_i. Delta: [B, H, F, V], the delta state.
        output_final_state: also return the final state. Additive: initial_state (decayed by Π_{i<T} a_i) plus
            every real, non-sink key that lies outside the window of the *next* query (index T), i.e. keys
            j ≤ T − 1 − window_size, each decayed by d_{T−1, j}: what a cache carries forward beside the last
            window_size tokens and the sinks (the next step decays it by its own a_t, and a key that leaves the
            window enters undecayed). Delta: the delta state after the last step.
        cu_seqlens: None or int [N + 1] boundaries (0, ..., T) of N documents packed into a batch of one, run one
            document at a time (the window and the state restart at each boundary): T_q == T, no initial_state,
            memory or start_position, and no final state (packed documents fill no cache).
        update_rule: "additive" (the hybrid above) or "delta".
        beta: update_rule="delta" only (required there): [B, T, H], each key's write strength in [0, 1] (a cache's
            retained keys' stored β in front).
        state_output: update_rule="delta" only: a callable applied to the state's read-out [B, T_q, H, V] (0 at
            pad queries) before λ weighs it, returning the same shape (e.g. the layer's output norm and gate);
            None: the read-out as it is.
        memory_size: m ≥ 0 sparse memory slots per KV head (additive only); with m > 0 the op runs
            `sparse_window_attention` and returns the memory too. The sparse form reads the state directly: it
            runs on no linear-attention backend (`backend` is validated, then unused).
        memory: memory_size > 0 only: None (empty) or the memory of the current block (`SparseMemory`, its log
            decay accumulated to the input's last retained step).
        key_feature_map: memory_size > 0 only (required there): k [B, ·, H_kv, D] -> φ [B, ·, H, F], the map that
            gave k_feat (the memory's features are recomputed from its keys).
        start_position: memory_size > 0 only: the absolute position of input index 0 (the memory's blocks are
            cut at absolute multiples of MEMORY_BLOCK_SIZE).
        backend: one of BACKENDS (see the module docstring; "recurrent" and "parallel" both run the quadratic
            reference form of the window). update_rule="delta": one of `delta_rule_attention`'s backends, which
            runs the state part under the same name.

    Returns:
        o: [B, T_q, H, V] in the dtype of v; the final state (fp32; see output_final_state) or None; with
        memory_size > 0 also the memory after the input (None unless output_final_state).
    """
    for arg, x, dims in (
        ("q", q, "[B, T_q, H, D]"),
        ("k", k, "[B, T, H_kv, D]"),
        ("v", v, "[B, T, H_kv, V]"),
        ("q_feat", q_feat, "[B, T_q, H, F]"),
        ("k_feat", k_feat, "[B, T, H, F]"),
    ):
        check_4d_floating(arg, x, dims)
    check_sizes("k", k, "[B, T, H_kv, D]", (0, 2, 3))
    batch, length, kv_heads, head_dim = k.shape
    queries, heads = q.shape[1], q.shape[2]
    if (q.shape[0], q.shape[3]) != (batch, head_dim) or queries > length or heads % kv_heads:
        raise ValueError(f"q must be [B, T_q, H, D] with T_q ≤ T, the B, D of k {tuple(k.shape)} and H a multiple "
                         f"of its H_kv, got shape {tuple(q.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must have B, T, H_kv = {tuple(k.shape[:3])}, got shape {tuple(v.shape)}")
    if q_feat.shape[:3] != q.shape[:3]:
        raise ValueError(f"q_feat must have B, T_q, H = {tuple(q.shape[:3])}, got shape {tuple(q_feat.shape)}")
    features = q_feat.shape[-1]
    if k_feat.shape != (batch, length, heads, features):
        raise ValueError(f"k_feat must have shape {(batch, length, heads, features)} ([B, T, H, F] with the F of "
                         f"q_feat), got {tuple(k_feat.shape)}")
    if queries == 0:
        raise ValueError("q, k, v must hold at least one token, got T = 0")
    check_sizes("v", v, "[B, T, H_kv, V]", (3,))
    check_sizes("q_feat", q_feat, "[B, T_q, H, F]", (3,))
    if (
        not isinstance(window_gate, Tensor) or tuple(window_gate.shape) != (heads,)
        or not window_gate.is_floating_point()
    ):
        raise ValueError(
            f"window_gate must be a floating-point tensor of shape ({heads},) (one logit per head), "
            f"got {getattr(window_gate, 'shape', window_gate)!r} of type {getattr(window_gate, 'dtype', None)}"
        )
    _check_window_sizes(window_size, num_sink_tokens)
    scale = checked_scale(scale, head_dim**-0.5)
    if not isinstance(backend, str) or backend not in BACKENDS:  # (checked here too: the sparse form takes none)
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    delta = _checked_update_rule(update_rule, backend, beta, state_output, memory_size, (batch, length, heads))
    if log_decay is not None:
        shapes = [(batch, length, heads)] + ([] if delta else [(batch, length, heads, features)])
        check_log_decay(log_decay, *shapes)
    _check_key_padding_mask(key_padding_mask, batch, length)
    value_dim = v.shape[-1]
    state_shape = (batch, heads, features, value_dim + int(not delta))
    if initial_state is not None and (
        not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != state_shape
        or not initial_state.is_floating_point()
    ):
        raise ValueError(
            f"initial_state must be a floating-point tensor of shape {state_shape} "
            f"([B, H, F, V{'' if delta else ' + 1'}]), "
            f"got {getattr(initial_state, 'shape', initial_state)!r} of type {getattr(initial_state, 'dtype', None)}"
        )
    sparse = memory_size > 0
    if sparse and not callable(key_feature_map):
        raise TypeError("key_feature_map must be a callable k [B, T, H_kv, D] -> φ [B, T, H, F] when memory_size > 0, "
                        f"got {type(key_feature_map).__name__}")
    if not sparse and (memory is not None or key_feature_map is not None or start_position != 0):
        raise ValueError("memory, key_feature_map and start_position belong to the sparse memory: pass them only "
                         "with memory_size > 0")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, batch, length)
        if queries != length or initial_state is not None or memory is not None or start_position != 0:
            raise ValueError("cu_seqlens: packed documents take one query per key (T_q == T) and no initial_state, "
                             "memory or start_position")
        if output_final_state:
            raise ValueError("cu_seqlens: packed documents fill no cache, so there is no final state to return "
                             "(pass output_final_state=False)")
    if not sparse:  # (the sparse form takes the KV heads as they are)
        k, v = repeat_kv_heads(k, heads), repeat_kv_heads(v, heads)
    options = dict(window_size=window_size, num_sink_tokens=num_sink_tokens, scale=scale, delta=delta,
                   memory_size=memory_size, key_feature_map=key_feature_map, backend=backend)
    if cu_seqlens is None:
        o, read, state, memory = _window_terms(
            q, k, v, q_feat, k_feat, window_gate, log_decay, beta, key_padding_mask, initial_state, memory,
            start_position, output_final_state, **options)
    else:  # one document at a time
        bounds = cu_seqlens.tolist()
        parts = [
            _window_terms(*(x[:, i:j] for x in (q, k, v, q_feat, k_feat)), window_gate,
                          *(None if x is None else x[:, i:j] for x in (log_decay, beta, key_padding_mask)),
                          None, None, 0, False, **options)
            for i, j in zip(bounds[:-1], bounds[1:], strict=True) if j > i
        ]
        o = torch.cat([part[0] for part in parts], dim=1)
        read = torch.cat([part[1] for part in parts], dim=1) if delta else None
        state = None
    if delta:
        o = o + window_gate.to(o.dtype).view(1, 1, -1, 1) * (read if state_output is None else state_output(read))
    return (o, state, memory) if sparse else (o, state)


def _check_window_sizes(window_size: int, num_sink_tokens: int) -> None:
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
        raise ValueError(f"window_size must be an int ≥ 1, got {window_size!r}")
    if isinstance(num_sink_tokens, bool) or not isinstance(num_sink_tokens, int) or num_sink_tokens < 0:
        raise ValueError(f"num_sink_tokens must be an int ≥ 0, got {num_sink_tokens!r}")


def _check_key_padding_mask(key_padding_mask: Tensor | None, batch: int, length: int) -> None:
    if key_padding_mask is not None and (
        not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool
        or tuple(key_padding_mask.shape) != (batch, length)
    ):
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape ({batch}, {length}) (True = real token), "
            f"got {getattr(key_padding_mask, 'shape', key_padding_mask)!r} of type "
            f"{getattr(key_padding_mask, 'dtype', None)}"
        )


def _checked_update_rule(
    update_rule: str, backend: str, beta: Tensor | None, state_output: Callable | None, memory_size: int,
    per_token: tuple[int, int, int],
) -> bool:
    """Checks the arguments that depend on window_attention's update rule; returns whether it is "delta"."""
    if update_rule not in ("additive", "delta"):
        raise ValueError(f"update_rule must be 'additive' or 'delta', got {update_rule!r}")
    if isinstance(memory_size, bool) or not isinstance(memory_size, int) or memory_size < 0:
        raise ValueError(f"memory_size must be an int ≥ 0, got {memory_size!r}")
    if update_rule == "additive":
        if beta is not None or state_output is not None:
            raise ValueError("beta and state_output belong to update_rule='delta'")
        return False
    if memory_size > 0:
        raise ValueError("the sparse memory (memory_size > 0) runs with update_rule='additive' only")
    if state_output is not None and not callable(state_output):
        raise TypeError(f"state_output must be None or a callable [B, T_q, H, V] -> [B, T_q, H, V], "
                        f"got {type(state_output).__name__}")
    if not isinstance(beta, Tensor) or tuple(beta.shape) != per_token or not beta.is_floating_point():
        raise ValueError(f"beta must be a floating-point tensor of shape {per_token} ([B, T, H], one write strength "
                         f"per key) with update_rule='delta', got {getattr(beta, 'shape', beta)!r}")
    if backend not in OP_BACKENDS["delta_rule_attention"]:
        raise ValueError(f"backend must be one of {OP_BACKENDS['delta_rule_attention']} with update_rule='delta' (the "
                         f"backends of delta_rule_attention), got {backend!r}")
    return True


def _window_terms(
    q: Tensor, k: Tensor, v: Tensor, q_feat: Tensor, k_feat: Tensor, window_gate: Tensor,
    log_decay: Tensor | None, beta: Tensor | None, key_padding_mask: Tensor | None, initial_state: Tensor | None,
    memory: SparseMemory | None, start_position: int, output_final_state: bool, *, window_size: int,
    num_sink_tokens: int, scale: float, delta: bool, memory_size: int, key_feature_map: KeyFeatureMap | None,
    backend: str,
) -> tuple[Tensor, Tensor | None, Tensor | None, SparseMemory | None]:
    """`window_attention` of one sequence (its inputs validated; k, v per query head unless sparse): o, the delta
    rule's read-out (None unless delta: `window_attention` weighs it into o), the final state and the memory."""
    if memory_size > 0:
        o, state, memory = sparse_window_attention(
            q, k, v, q_feat, k_feat, window_gate, key_feature_map=key_feature_map, window_size=window_size,
            num_sink_tokens=num_sink_tokens, memory_size=memory_size, scale=scale, block_size=MEMORY_BLOCK_SIZE,
            start_position=start_position, log_decay=log_decay, key_padding_mask=key_padding_mask,
            initial_state=initial_state, memory=memory, output_final_state=output_final_state)
        return o, None, state, memory
    if not delta:
        o, state = _hybrid(q, k, v, q_feat, k_feat, window_gate, log_decay, key_padding_mask, initial_state,
                           output_final_state, window_size=window_size, num_sink_tokens=num_sink_tokens, scale=scale,
                           backend=backend)
        return o, None, state, None
    o = _softmax_only(q, k, v, key_padding_mask, window_size=window_size, num_sink_tokens=num_sink_tokens,
                      scale=scale, backend=backend)
    read, state = window_delta_rule(q_feat, k_feat, v, beta, log_decay, window_size=window_size,
                                    num_sink_tokens=num_sink_tokens, key_padding_mask=key_padding_mask,
                                    initial_state=initial_state, output_final_state=output_final_state,
                                    backend=backend)
    return o, read, state, None


def _softmax_only(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, *, window_size: int, num_sink_tokens: int,
    scale: float, backend: str,
) -> Tensor:
    """`window_softmax` of one validated sequence (k, v per query head): the hybrid's forms with an empty linear
    part, zero features of size 1 that add nothing to the numerator and denominator (so the weight γ cancels)."""
    batch, queries, heads = q.shape[:3]
    no_features = q.new_zeros(batch, k.shape[1], heads, 1)
    o, _ = _hybrid(q, k, v, no_features[:, k.shape[1] - queries :], no_features, q.new_zeros(heads), None,
                   key_padding_mask, None, False, window_size=window_size, num_sink_tokens=num_sink_tokens,
                   scale=scale, backend=backend)
    return o


def _hybrid(
    q: Tensor, k: Tensor, v: Tensor, q_feat: Tensor, k_feat: Tensor, window_gate: Tensor, log_decay: Tensor | None,
    key_padding_mask: Tensor | None, initial_state: Tensor | None, output_final_state: bool, *, window_size: int,
    num_sink_tokens: int, scale: float, backend: str,
) -> tuple[Tensor, Tensor | None]:
    """The additive hybrid of one sequence on the backend `pick_backend` chooses (k, v per query head)."""
    length, queries, head_dim = k.shape[1], q.shape[1], k.shape[-1]
    tensors = {"q": q, "k": k, "v": v, "q_feat": q_feat, "k_feat": k_feat, "window_gate": window_gate,
               "log_decay": log_decay, "initial_state": initial_state}

    def triton_problem() -> str | None:
        if backend == "auto" and key_padding_mask is not None:
            # The Triton kernels take each row's real tokens as one run; only a host sync could tell whether a
            # mask has holes, so "auto" runs masked inputs on "torch", which takes any mask.
            return "key_padding_mask given"
        return ops_triton_common.unsupported_inputs(
            {n: x for n, x in tensors.items() if x is not None}, window_head_dims=(head_dim, v.shape[-1])
        )

    name = pick_backend(backend, q.device, single_query=queries == 1, triton_problem=triton_problem,
                        head_dims=(head_dim, v.shape[-1], q_feat.shape[-1]))
    if name == "triton" and key_padding_mask is not None:  # chosen explicitly: checked on every device
        _check_contiguous_padding(key_padding_mask)
    skipped = length - queries if name in CHUNKED else 0
    if skipped:  # the chunked forms need a query per key: zero queries in front, whose rows are dropped
        # (log_decay already covers all T positions: the padding shifts no decay)
        q, q_feat = (F.pad(x, (0, 0, 0, 0, skipped, 0)) for x in (q, q_feat))
    if log_decay is not None and log_decay.dim() == 3:
        log_decay = log_decay[..., None]  # one decay shared by all F rows of the state
    o, state = WINDOW_FORMS[name](
        q, k, v, q_feat, k_feat, window_gate, log_decay,
        window_size=window_size,
        num_sink_tokens=num_sink_tokens,
        scale=scale,
        key_padding_mask=key_padding_mask,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
    return o[:, skipped:], state


def window_softmax(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window_size: int,
    num_sink_tokens: int = 0,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Exact causal softmax of each query over its window and sinks alone, with its own normaliser:

        o_t = Σ_{i∈W_t} e^{s_ti − c_t} v_i / Σ_{i∈W_t} e^{s_ti − c_t},   s_ti = scale · q_t·k_i, c_t = max_{W_t} s_ti

    W_t as in `window_attention` (the last window_size positions up to t, pads masked, plus the first
    num_sink_tokens real tokens); pad queries output 0. `ops_reference.reference_window_softmax` is its literal
    T × T form. The fast path runs `window_attention`'s forms (every backend, the Triton kernels included) with an
    empty linear part: zero features of size 1 add nothing to the numerator and denominator, so the window's
    weight γ cancels.

    Args:
        q: [B, T_q, H, D] (the last T_q ≤ T positions). k: [B, T, H_kv, D], v: [B, T, H_kv, V] (H_kv dividing H).
        window_size, num_sink_tokens, key_padding_mask, backend: as in `window_attention`.
        scale: of the scores, a finite number > 0; None means D ** -0.5.
        cu_seqlens: None or int [N + 1] boundaries of documents packed into a batch of one (T_q == T), each
            attending within itself.

    Returns:
        o: [B, T_q, H, V] in the dtype of v.
    """
    check_4d_floating("q", q, "[B, T_q, H, D]")
    batch, queries, heads = q.shape[:3]
    length = k.shape[1] if isinstance(k, Tensor) and k.dim() == 4 else queries
    no_features = q.new_zeros(batch, length, heads, 1)
    o, _ = window_attention(q, k, v, no_features[:, length - queries :], no_features, q.new_zeros(heads),
                            window_size=window_size, num_sink_tokens=num_sink_tokens, scale=scale,
                            key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens, backend=backend)
    return o


def _decode_kernel_problem(backend: str, tensors: dict[str, Tensor]) -> str | None:
    """Why a step cannot run on its fused Triton kernel (None if it can): what the kernels take, and for "auto" not
    while torch.compile traces (inductor fuses the torch step itself, and the graph then holds no hand-written
    launch: fullgraph and CUDA graphs stay possible)."""
    if backend == "auto" and torch.compiler.is_compiling():
        return "torch.compile traces the step: the torch step runs (inductor fuses it)"
    return ops_triton_common.unsupported_inputs(tensors)


def linear_attention_step(
    q_feat: Tensor,
    k_feat: Tensor,
    v: Tensor,
    log_decay: Tensor | None,
    state: Tensor,
    *,
    scale: float,
    normalize: bool,
    backend: str = "auto",
) -> Tensor:
    """One token of (decayed) linear attention behind a cache, updating `state` in place: o [B, 1, H, V] in v's
    dtype. S ← a ⊙ S + φ(k) [v, 1]ᵀ, then o = scale φ(q)ᵀ S (divided by its normaliser column if normalize): the
    step of `linear_attention`, in fixed shapes.

    Args:
        q_feat, k_feat: [B, 1, H, K] (feature-mapped). v: [B, 1, H_kv, V], H_kv dividing H (repeated inside).
        log_decay: None, [B, 1, H] or [B, 1, H, K] (≤ 0; 0 at a pad, whose k_feat and v the caller zeroes).
        state: [B, H, K, V (+ 1 if normalize)] as `linear_attention` lays it out (fp32), updated in place.
        scale: multiplies φ(q). normalize: divide by the normaliser column.
        backend: "torch" (`ops_decode.linear_decode_step`), "triton" (`ops_triton_decode.triton_linear_decode_step`,
            a contiguous fp32 state) or "auto": Triton for CUDA tensors it takes in eager mode, else torch.

    Like every step, it reads no tensor value on the host and checks only what the chosen backend needs: it runs
    once per layer and token.
    """
    name = pick_backend(backend, q_feat.device, single_query=False, names=("auto", *LINEAR_STEPS),
                        triton_problem=lambda: _decode_kernel_problem(backend, {"q_feat": q_feat, "state": state}))
    return LINEAR_STEPS[name](q_feat, k_feat, repeat_kv_heads(v, q_feat.shape[2]), log_decay, state, scale=scale,
                              normalize=normalize)


def window_attention_step(
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
    backend: str = "auto",
) -> Tensor:
    """One token of the additive window hybrid behind a cache, updating `state` in place: o [B, 1, H, V] in
    window_values' dtype. What `window_attention` gives the one query behind the retained slots, in fixed shapes;
    the caller has written the new token into the ring slot of the one leaving the window (which it passes here).

    Args (`ops_decode.window_decode_step` gives them in full):
        q: [B, 1, H, D]; q_feat: [B, 1, H, F]; log_decay: None, [B, 1, H] or [B, 1, H, F] (0 at a pad).
        state: [B, H, F, V + 1] (fp32), updated in place.
        window_keys, window_values: [B, R, H_kv, D | V], window_mask: bool [B, R]: the sink and ring slots.
        leaving_feat [B, 1, H, F], leaving_values [B, 1, H_kv, V], leaving_real bool [B, 1]: the token leaving the
            window, folded into the state where real; all three None with a sparse memory (nothing folds).
        window_gate: [H]; real: bool [B, 1], or None when every row's token is real; scale: of the softmax scores.
        memory_keys, memory_values: [B, H_kv, m, D | V], memory_mask: bool [B, H_kv, m]: the sparse memory's
            slots under the same softmax row (None without one).
        backend: "torch" (`ops_decode.window_decode_step`), "triton" (`ops_triton_decode.triton_window_decode_step`:
            no sparse memory, head dims up to 256) or "auto": Triton for CUDA tensors it takes in eager mode
            without a sparse memory, else torch.
    """
    def triton_problem() -> str | None:
        if memory_keys is not None or leaving_feat is None:
            return "the Triton window step has no sparse memory"
        return _decode_kernel_problem(backend, {"q": q, "state": state})

    name = pick_backend(backend, q.device, single_query=False, triton_problem=triton_problem,
                        names=("auto", *WINDOW_STEPS))
    # (the kernel, chosen only without a memory, takes no memory arguments)
    memory = {} if name == "triton" else dict(memory_keys=memory_keys, memory_values=memory_values,
                                              memory_mask=memory_mask)
    return WINDOW_STEPS[name](q, q_feat, log_decay, state, window_keys, window_values, window_mask, leaving_feat,
                              leaving_values, leaving_real, window_gate, real, scale=scale, **memory)


def delta_window_attention_step(
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
    backend: str = "auto",
) -> Tensor:
    """One token of the delta rule behind the window, updating `state` in place: o [B, 1, H, V] in window_values'
    dtype. What `window_attention(update_rule="delta")` gives the one query behind the retained slots; the caller
    has written the new token (k, v, β) into the ring slot of the one leaving the window (which it passes here).

    Args (`ops_decode.delta_window_decode_step` gives them in full): q [B, 1, H, D]; q_hat [B, 1, H, K]; log_decay
    None or [B, 1, H]; state [B, H, K, V] (fp32); window_keys, window_values [B, R, H_kv, D | V], window_mask bool
    [B, R]; leaving_key [B, 1, H, K] (k̂), leaving_values [B, 1, H_kv, V], leaving_beta [B, 1, H], leaving_real
    bool [B, 1]; window_gate [H] (λ); real bool [B, 1] or None; scale of the softmax scores; state_output applied to
    the state's read-out [B, 1, H, V]. backend: "torch" or "auto" (no Triton kernel: torch).
    """
    name = pick_backend(backend, q.device, single_query=False, names=("auto", *DELTA_WINDOW_STEPS),
                        triton_problem=lambda: "the delta window step has no Triton kernel")
    return DELTA_WINDOW_STEPS[name](q, q_hat, log_decay, state, window_keys, window_values, window_mask, leaving_key,
                                    leaving_values, leaving_beta, leaving_real, window_gate, real, scale=scale,
                                    state_output=state_output)
