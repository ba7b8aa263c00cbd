"""Helpers shared by the attention ops (`ops`, `ops_delta_rule`) and their backends (`ops_reference`,
`ops_chunked`, `ops_triton_*`, `ops_delta_rule_chunked`).

What lives here is plumbing every backend needs the same way: the accumulation dtype, the per-sequence runner
for packed inputs (cu_seqlens), the token masks and the delayed keys of the window hybrid, the divisions that
produce outputs, the chunk length, and the input checks the ops share (those that read values: CPU only unless
switched on). The
math of each form stays in its own module, so that an oracle and a fast path never share a line of the
computation they are compared on.
"""

import functools
import math
import numbers
import os
from collections.abc import Callable
from functools import reduce

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import BACKENDS

NORM_EPS = 1e-6  # added to the denominator of normalised linear attention
CHUNK_SIZE = 64  # tokens per chunk of the chunked backends (torch and Triton)
# "auto" runs the chunked Triton kernels on a GPU only where some head dim they tile reaches this. On the first two GPU
# runs (an H200, Triton 3.6.0) every kernel fault came from inputs whose head dims were all below it: illegal memory
# accesses from 8-warp launches, which the kernels no longer make there (`ops_triton_common.usable_configs`); with a
# head dim of 64 or more none was seen (docs/design.md, "The first GPU run", "The second GPU run"). Until a GPU run
# passes every Triton test with the 4-warp launches, "auto" takes the torch backend below it; backend="triton" still
# runs the kernels.
AUTO_TRITON_MIN_HEAD_DIM = 64
# Set to "1" to run the input checks that read tensor values (one host sync each) on every device, not just CPU.
CHECK_VALUES_ENV = "HF_LINEAR_ATTN_CHECK_VALUES"


def accumulation_dtype(*tensors: Tensor) -> torch.dtype:
    """float32 for half / bfloat16 / float32 inputs, float64 if any input is float64."""
    return reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)


def log_decay_floor(dtype: torch.dtype) -> float:
    """The smallest log decay the chunked backends compute with in `dtype`: log of its smallest normal number
    (about −87.3 in float32, −708.4 in float64).

    The chunked forms take decays between two positions as differences of prefix sums of log_decay: a −inf (a
    full reset) would give −inf − (−inf) = nan, and a huge finite one (−1e30) swallows the small decays summed
    with it. A decay of e^{floor} already multiplies what it decays by less than the smallest normal number, so
    raising log_decay to the floor changes no result beyond rounding, and every difference stays exact enough.
    """
    return math.log(torch.finfo(dtype).tiny)


def splits_packed_sequences(backend: Callable[..., tuple[Tensor, Tensor | None]]):
    """Makes a linear-attention backend accept cu_seqlens: it then runs on each sequence of the packed batch
    (B == 1) on its own, and the results are packed again. The other arguments go to `backend` as they are.

    cu_seqlens: [N + 1] sequence boundaries; initial_state and the final state are [N, H, K, V (+ 1)].
    A zero-length sequence contributes no output and keeps its initial state (zeros if none given).
    """

    @functools.wraps(backend)
    def run(
        q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None, *, cu_seqlens: Tensor | None = None, **options
    ) -> tuple[Tensor, Tensor | None]:
        if cu_seqlens is None:
            return backend(q, k, v, log_decay, **options)
        initial_state = options.pop("initial_state", None)
        output_final_state = options.pop("output_final_state", False)
        _, _, heads, key_dim = q.shape
        state_shape = (1, heads, key_dim, v.shape[-1] + int(options.get("normalize", False)))
        dtype = accumulation_dtype(q, k, v)
        bounds = cu_seqlens.tolist()
        outputs, states = [], []
        for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            state = None if initial_state is None else initial_state[n : n + 1]
            if start < end:
                seq = slice(start, end)
                o, state = backend(
                    q[:, seq], k[:, seq], v[:, seq], None if log_decay is None else log_decay[:, seq],
                    initial_state=state, output_final_state=True, **options,
                )
                outputs.append(o)
            elif state is None:
                state = q.new_zeros(state_shape, dtype=dtype)
            states.append(state.to(dtype))
        return torch.cat(outputs, dim=1), torch.cat(states) if output_final_state else None

    return run


def normalized(o: Tensor, value_dim: int) -> Tensor:
    """o [..., V + 1] whose last column is the normaliser's output -> o / (normaliser + NORM_EPS), [..., V]."""
    return o[..., :value_dim] / (o[..., value_dim:] + NORM_EPS)


def divide_at_real_queries(numerator: Tensor, denominator: Tensor, real: Tensor) -> Tensor:
    """numerator / denominator where `real`, 0 at pad queries.

    real broadcasts against both. Padding both sides (0 over 1) rather than the quotient keeps a pad query's
    empty sums from dividing 0 by 0, which would send nan into the gradients through torch.where.
    """
    return torch.where(real, numerator, 0.0) / torch.where(real, denominator, 1.0)


def window_token_masks(
    key_padding_mask: Tensor | None, batch: int, length: int, num_sink_tokens: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Which positions are real tokens and which of them are sinks, both bool [B, T].

    The sinks are the first `num_sink_tokens` real tokens of each row, so a left-padded row has the same
    sinks as the same row without padding.
    """
    if key_padding_mask is None:
        real = torch.ones(batch, length, dtype=torch.bool, device=device)
    else:
        real = key_padding_mask
    rank = real.cumsum(-1) - 1  # index of each position among the real tokens of its row
    return real, real & (rank < num_sink_tokens)


def window_linear_inputs(
    k_feat: Tensor, values: Tensor, real: Tensor, sink: Tensor, window_size: int
) -> tuple[Tensor, Tensor]:
    """Keys and values that turn the window hybrid's linear part into plain causal linear attention.

    Key j reaches query t linearly iff t − j ≥ window_size, so the linear part is causal linear attention
    against keys and values delayed by window_size positions; sinks and pads get zero keys and drop out. With
    left or right padding the real tokens are contiguous, so the index delay is also the real-token distance.
    The linear state after the delayed sequence holds exactly the keys older than the next query's window.
    A decayed hybrid runs that linear attention with the log decays at the queries' own steps, undelayed: the
    key delayed to position j + window_size is then decayed by a_i for i = j + window_size + 1 .. t, so its
    decay starts when it leaves the window, and a cache's state needs no per-token bookkeeping.

    k_feat: [B, T, H, F]; values: [B, T, H, V'] (the torch backend passes V' = V + 1, a ones column whose output
    is the denominator; the Triton backend V' = V, its kernels carry the normaliser beside the values); real, sink:
    bool [B, T]. Returns the delayed keys [B, T, H, F] and values [B, T, H, V'].
    """
    length = k_feat.shape[1]
    delay = min(window_size, length)

    def delayed(x: Tensor) -> Tensor:
        return F.pad(x, (0, 0, 0, 0, delay, 0))[:, :length]

    return delayed(k_feat * (real & ~sink)[..., None, None]), delayed(values)


def check_4d_floating(name: str, x: Tensor, dims: str) -> None:
    """x must be a 4-D floating-point tensor; dims names its layout in the message, e.g. "[B, T, H, K]"."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {dims}, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D {dims}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must have a floating-point dtype, got {x.dtype}")


def check_sizes(name: str, x: Tensor, dims: str, nonempty: tuple[int, ...]) -> None:
    """x's dims at the positions `nonempty` (of B, T, H, D) must be ≥ 1."""
    if any(x.shape[i] == 0 for i in nonempty):
        labels = dims.strip("[]").split(", ")
        needed = ", ".join(labels[i] for i in nonempty)
        raise ValueError(f"{name} must have {needed} ≥ 1 ({dims}), got shape {tuple(x.shape)}")


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """q, k [B, T, H, K] and v [B, T, H_kv, V] of `linear_attention` and `delta_rule_attention`: floating-point,
    k shaped as q, v with q's B, T and H_kv KV heads dividing H (grouped-query attention), every dim ≥ 1."""
    check_4d_floating("q", q, "[B, T, H, K]")
    check_4d_floating("k", k, "[B, T, H, K]")
    check_4d_floating("v", v, "[B, T, H_kv, V]")
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q, [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if q.shape[1] == 0:
        raise ValueError("q, k, v must hold at least one token, got T = 0")
    check_sizes("q", q, "[B, T, H, K]", (0, 2, 3))
    check_kv_heads("v", v, "[B, T, H_kv, V]", q.shape[:2], q.shape[2])
    check_sizes("v", v, "[B, T, H, V]", (3,))


def check_kv_heads(name: str, x: Tensor, dims: str, batch_time: tuple[int, int], heads: int) -> None:
    """x [B, T, H_kv, ·] must have the given B, T and a number of KV heads H_kv ≥ 1 that divides the H query heads
    (grouped-query attention: each KV head serves H / H_kv query heads)."""
    kv_heads = x.shape[2]
    if tuple(x.shape[:2]) != tuple(batch_time) or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{name} must be {dims} with B, T = {tuple(batch_time)} and H_kv dividing H = {heads} "
                         f"(grouped-query attention), got shape {tuple(x.shape)}")


def repeat_kv_heads(x: Tensor, heads: int) -> Tensor:
    """x [B, T, H_kv, ·] -> [B, T, H, ·], each KV head repeated for the H / H_kv query heads it serves (x itself
    when H_kv == H: no copy)."""
    groups = heads // x.shape[2]
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def checked_scale(scale: float | None, default: float, *, positive: bool = True) -> float:
    """scale as a float: `default` for None; otherwise a finite real number, and > 0 if `positive`."""
    if scale is None:
        return default
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale) or (positive and scale <= 0):
        raise ValueError(f"scale must be a finite number{' > 0' if positive else ''} (or None for the default), "
                         f"got {scale!r}")
    return float(scale)


def checks_values(x: Tensor) -> bool:
    """Whether to run the checks that read x's values: on CPU (free), or anywhere under the debug switch; never
    while torch.compile / torch.export trace (a value read is a data-dependent branch there)."""
    if torch.compiler.is_compiling():
        return False
    return x.device.type == "cpu" or os.environ.get(CHECK_VALUES_ENV) == "1"


def check_log_decay(log_decay: Tensor, *shapes: tuple[int, ...]) -> None:
    """log_decay: a floating-point tensor of one of `shapes`, and (when `checks_values`) every value in
    [−inf, 0], the log of a decay in [0, 1]."""
    if not isinstance(log_decay, Tensor) or tuple(log_decay.shape) not in shapes:
        raise ValueError(
            f"log_decay must be None or a tensor of shape {' or '.join(str(shape) for shape in shapes)}, "
            f"got {tuple(log_decay.shape) if isinstance(log_decay, Tensor) else type(log_decay).__name__}"
        )
    if not log_decay.is_floating_point():
        raise ValueError(f"log_decay must have a floating-point dtype, got {log_decay.dtype}")
    if not checks_values(log_decay):
        return
    if log_decay.isnan().any():
        raise ValueError("log_decay must not contain nan (allowed: values in [−inf, 0]; −inf is a full reset)")
    largest = log_decay.max().item()
    if largest > 0:
        raise ValueError(f"log_decay must be ≤ 0 (the log of a decay in [0, 1]; −inf is a full reset), "
                         f"got max {largest:g}")


def check_cu_seqlens(cu_seqlens: Tensor, batch: int, length: int) -> None:
    """cu_seqlens [N + 1] of N sequences packed into a batch of one: shape and dtype always, values when checked."""
    if batch != 1:
        raise ValueError(f"cu_seqlens requires packed inputs with batch size 1, got batch size {batch}")
    if (
        not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1
        or cu_seqlens.dtype not in (torch.int32, torch.int64) or len(cu_seqlens) < 2
    ):
        raise ValueError(
            "cu_seqlens must be a 1-D int32/int64 tensor [N + 1] of sequence boundaries, "
            f"got {getattr(cu_seqlens, 'shape', cu_seqlens)!r} of type {getattr(cu_seqlens, 'dtype', type(cu_seqlens))}"
        )
    if not checks_values(cu_seqlens):
        return
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {length}, got {bounds}")
    if any(end < start for start, end in zip(bounds[:-1], bounds[1:], strict=True)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")


def pick_backend(
    backend: str, device: torch.device, *, single_query: bool, triton_problem: Callable[[], str | None],
    names: tuple[str, ...] = BACKENDS, head_dims: tuple[int, ...] = (),
) -> str:
    """The backend that runs, for every op (`linear_attention`, `window_attention`, `delta_rule_attention`):
    `backend` itself once checked against the op's `names`, or for "auto" the direct form ("recurrent") for a
    single query, Triton for CUDA tensors it takes where a head dim reaches AUTO_TRITON_MIN_HEAD_DIM, else "torch".

    triton_problem: says why the triton backend cannot take the inputs (None if it can); asked only when needed.
    head_dims: the dims the chunked kernels tile (K and V, the window's D); the one-token steps give none.
    """
    if not isinstance(backend, str) or backend not in names:
        raise ValueError(f"backend must be one of {names}, got {backend!r}")
    if backend == "auto":
        if single_query:
            return "recurrent"
        proven = max(head_dims, default=AUTO_TRITON_MIN_HEAD_DIM) >= AUTO_TRITON_MIN_HEAD_DIM
        return "triton" if device.type == "cuda" and proven and triton_problem() is None else "torch"
    if backend == "triton":
        problem = triton_problem()
        if problem is not None:
            raise ValueError(problem)
    return backend
