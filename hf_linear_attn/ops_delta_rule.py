"""The delta rule (DeltaNet, Gated DeltaNet): the public `delta_rule_attention` and its token-loop oracle.

Additive linear attention only accumulates, S_t = a_t S_{t−1} + k_t v_tᵀ, so a fixed-size state blurs what it
has seen. The delta rule first removes what the state already stores under the key, then writes the new value:

    S_t = a_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ (scale · q_t)

per batch row and head, with β_t ∈ [0, 1] the write strength and a_t = exp(log_decay_t) ∈ [0, 1] an optional
data-dependent decay (Gated DeltaNet; a_t = 1 is DeltaNet). With unit keys, I − β_t k_t k_tᵀ has eigenvalues 1 and
1 − β_t, so the state never grows from the update itself.

`delta_rule_attention` validates every input before any work and dispatches to a backend:
"recurrent" (`recurrent_delta_rule` below, the equation token by token), "torch"
(`ops_delta_rule_chunked.chunk_delta_rule`, chunked) or "triton" (`ops_triton_delta_rule.triton_delta_rule`, the
same chunked form in Triton kernels). States are [B, H, K, V] in float32 (float64 for float64
inputs), the same layout as transformers' and flash-linear-attention's gated delta rule.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import OP_BACKENDS
from .ops_common import (
    accumulation_dtype,
    check_cu_seqlens,
    check_log_decay,
    check_qkv,
    checked_scale,
    checks_values,
    pick_backend,
    repeat_kv_heads,
    window_token_masks,
)
from .ops_delta_rule_chunked import chunk_delta_rule
from .ops_triton_delta_rule import triton_delta_rule, unsupported_delta_rule_inputs

__all__ = ["delta_rule_attention", "window_delta_rule"]

# How far above 1 a key's L2 norm may be: bfloat16 rounding of a unit vector moves its norm by up to ~4e-3.
KEY_NORM_TOLERANCE = 1e-2


def recurrent_delta_rule(
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
    """The recurrence, literally: one token at a time.

    q, k: [B, T, H, K]; v: [B, T, H, V]; beta, log_decay (None = no decay): [B, T, H]. initial_state: None or
    [B, H, K, V]; with cu_seqlens ([N + 1] boundaries, B == 1) every sequence starts from its own
    initial_state[n] (zeros if None) and the states are [N, H, K, V]; a zero-length sequence outputs nothing and
    keeps its initial state.
    Returns o [B, T, H, V] in v's dtype and the final state (None unless output_final_state) in float32
    (float64 for float64 inputs).
    """
    batch, length, heads, key_dim = q.shape
    value_dim, out_dtype = v.shape[-1], v.dtype
    dtype = accumulation_dtype(q, k, v, beta, *([] if log_decay is None else [log_decay]))
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    q = q * scale
    decay = torch.ones_like(beta) if log_decay is None else log_decay.to(dtype).exp()  # a_t, [B, T, H]
    bounds = [0, length] if cu_seqlens is None else cu_seqlens.tolist()
    # unbind, not x[:, t]: each indexing would give backward a full-size gradient to write, O(T²) in all
    steps = list(zip(*(x.unbind(1) for x in (q, k, v, decay, beta)), strict=True))

    outputs, finals = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        # the whole batch, or packed sequence n
        rows = slice(None) if cu_seqlens is None else slice(n, n + 1)
        state = (q.new_zeros(batch if cu_seqlens is None else 1, heads, key_dim, value_dim)
                 if initial_state is None else initial_state[rows].to(dtype))
        for q_t, k_t, v_t, a_t, beta_t in steps[start:end]:
            a_t, beta_t = a_t[..., None, None], beta_t[..., None, None]  # [B, H, 1, 1]; q_t, k_t, v_t [B, H, K | V]
            k_state = (k_t[..., None] * state).sum(-2)  # k_tᵀ S_{t−1}, [B, H, V]
            erased = state - beta_t * k_t[..., None] * k_state[..., None, :]  # (I − β_t k_t k_tᵀ) S_{t−1}
            state = a_t * erased + beta_t * k_t[..., None] * v_t[..., None, :]
            outputs.append((q_t[..., None] * state).sum(-2))  # S_tᵀ q̃_t, [B, H, V]
        finals.append(state)
    o = torch.stack(outputs, dim=1).to(out_dtype)  # [B, T, H, V]
    return o, torch.cat(finals) if output_final_state else None


DELTA_RULE_BACKENDS: dict[str, Callable[..., tuple[Tensor, Tensor | None]]] = {
    "recurrent": recurrent_delta_rule,
    "torch": chunk_delta_rule,
    "triton": triton_delta_rule,
}


def _check_per_token(name: str, x: Tensor, shape: tuple[int, int, int]) -> None:
    if tuple(x.shape) != shape or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor of shape {shape} ([B, T, H]), "
                         f"got shape {tuple(x.shape)} and dtype {x.dtype}")


def delta_rule_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Causal delta-rule linear attention (DeltaNet; Gated DeltaNet with log_decay), with carried state and
    packed sequences.

    Per batch row and head, with a_t = exp(log_decay_t):

        S_t = a_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ (scale · q_t)

    Args:
        q: [B, T, H, K]. k: [B, T, H, K], L2-normalised by the caller (e.g. k / ‖k‖ over K): the op does not
            normalise them. A key norm above 1 makes I − β k kᵀ expand the state, so norms above 1 + 1e-2 are
            an error (checked for CPU tensors; on an accelerator the check would cost a host sync per call).
            Norms below 1, as from an eps in the normalisation, are allowed.
        v: [B, T, H_kv, V], H_kv dividing H (grouped-query attention: each value head serves H / H_kv query heads,
            repeated inside; q and k are features, one per query head).
        beta: [B, T, H], the write strength, in [0, 1] (typically a sigmoid, which may round to exactly 0 or 1
            in low precision: both are well defined; checked for CPU tensors).
        log_decay: None (no decay, DeltaNet) or [B, T, H] (Gated DeltaNet), all ≤ 0 (checked for CPU tensors);
            −inf is allowed and resets the state (a_t = 0).
        scale: multiplies q; None means K ** -0.5 (as transformers' Qwen3-Next reference).
        initial_state: None or the state to start from, [B, H, K, V] (with cu_seqlens, N instead of B).
        output_final_state: also return the state after the last token.
        cu_seqlens: None or int [N + 1] boundaries (0, ..., T) of N sequences packed into a batch of 1; the
            state restarts at each boundary (from initial_state[n] if given).
        backend: "recurrent" (token loop, the oracle), "torch" (chunked), "triton" (chunked, Triton kernels: CUDA
            tensors in float16 / bfloat16 / float32, K ≤ 128) or "auto" (one token, a decode step: "recurrent";
            else "triton" for CUDA tensors it takes, else "torch"). Validated before the inputs.

    Returns:
        o: [B, T, H, V] in the dtype of v; the final state [B, H, K, V] (N with cu_seqlens) in float32
        (float64 for float64 inputs), or None unless output_final_state. Computation is in the same float32 /
        float64, whatever the input dtype.
    """
    check_qkv(q, k, v)
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    v = repeat_kv_heads(v, heads)
    scale = checked_scale(scale, key_dim**-0.5, positive=False)
    _check_per_token("beta", beta, (batch, length, heads))
    if log_decay is not None:
        check_log_decay(log_decay, (batch, length, heads))
    # Value checks read the data: only for CPU tensors, where they cost no device synchronisation.
    if checks_values(beta) and not ((beta >= 0) & (beta <= 1)).all():
        raise ValueError(f"beta must lie in [0, 1] (e.g. a sigmoid), got values in "
                         f"[{beta.min().item():g}, {beta.max().item():g}]")
    if checks_values(k):
        largest = k.float().square().sum(-1).max().sqrt().item()
        if not largest <= 1 + KEY_NORM_TOLERANCE:
            raise ValueError(f"k must be L2-normalised over its last dim (norm ≤ 1), got a key of norm {largest:g}: "
                             "normalise the keys before the call, e.g. k / k.norm(dim=-1, keepdim=True)")
    states = batch
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, batch, length)
        states = len(cu_seqlens) - 1
    if initial_state is not None:
        expected = (states, heads, key_dim, value_dim)
        if tuple(initial_state.shape) != expected or not initial_state.is_floating_point():
            raise ValueError(
                f"initial_state must be a floating-point tensor of shape {expected} ([N, H, K, V], N = "
                f"{'sequences' if cu_seqlens is not None else 'batch'}), got shape {tuple(initial_state.shape)} "
                f"and dtype {initial_state.dtype}"
            )
    tensors = {"q": q, "k": k, "v": v, "beta": beta, "log_decay": log_decay, "initial_state": initial_state}
    tensors = {arg: x for arg, x in tensors.items() if x is not None}
    name = pick_backend(backend, q.device, single_query=length == 1, names=OP_BACKENDS["delta_rule_attention"],
                        triton_problem=lambda: unsupported_delta_rule_inputs(tensors),
                        head_dims=(k.shape[-1], v.shape[-1]))
    return DELTA_RULE_BACKENDS[name](
        q, k, v, beta, log_decay,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


def window_delta_rule(
    q_hat: Tensor,
    k_hat: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Tensor | None,
    *,
    window_size: int,
    num_sink_tokens: int,
    key_padding_mask: Tensor | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    backend: str,
) -> tuple[Tensor, Tensor | None]:
    """The state part of the delta rule behind a sliding window: the delta rule over the tokens that have left the
    window, read by the T_q queries at the last T_q of the T key positions. Inputs validated by
    `ops.window_attention` (update_rule="delta"), whose docstring gives the rule.

    q_hat [B, T_q, H, K]; k_hat [B, T, H, K] (unit keys); v [B, T, H, V] (already one per query head); beta
    [B, T, H]; log_decay None or [B, T, H] (the T_q new steps' decays last; those in front of the queries decay
    the initial state: they join the first new step's); key_padding_mask None or bool [B, T]; initial_state None or
    [B, H, K, V]. At new step i the token of key index j = (T − T_q) + i − window_size enters the state with its β
    (none for j < 0; β = 0 for a sink or a pad), so keys in front of the queries (a cache's retained sinks and
    window) feed the first steps. Returns the read-out [B, T_q, H, V] (0 at pad queries) and the final state (None
    unless output_final_state).
    """
    batch, length = k_hat.shape[:2]
    queries = q_hat.shape[1]
    if log_decay is not None and length > queries:
        front, steps = log_decay[:, : length - queries], log_decay[:, length - queries :]
        log_decay = torch.cat([steps[:, :1] + front.sum(1, keepdim=True), steps[:, 1:]], dim=1)
    real_keys, sink_keys = window_token_masks(key_padding_mask, batch, length, num_sink_tokens, k_hat.device)
    offset = length - queries - window_size  # the key entering at new step 0 (< 0: that many steps see none)

    def entering(x: Tensor) -> Tensor:
        """x [B, T, ...] at the key entering at each new step: [B, T_q, ...], zeros where none enters."""
        return F.pad(x[:, max(offset, 0):], (0, 0) * (x.dim() - 2) + (max(-offset, 0), 0))[:, :queries]

    enters = (real_keys & ~sink_keys)[..., None]  # [B, T, 1]: real, non-sink keys enter when they leave
    read, state = delta_rule_attention(
        q_hat, entering(k_hat), entering(v), entering(beta * enters), log_decay,
        scale=q_hat.shape[-1] ** -0.5, initial_state=initial_state, output_final_state=output_final_state,
        backend=backend,
    )
    if key_padding_mask is not None:  # pad queries output 0, as the window's
        read = read * key_padding_mask[:, length - queries :, None, None].to(read.dtype)
    return read, state
