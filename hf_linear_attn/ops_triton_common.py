"""What every Triton module of the package shares: the import guard, the tile helpers, the chunk layout, the
autotune configs and the input checks of backend "triton".

The kernels (`ops_triton_linear`, `ops_triton_window`, `ops_triton_delta_rule`, `ops_triton_decode`) run on CUDA
tensors, or on CPU under the Triton interpreter (TRITON_INTERPRET=1 set before this module is imported: slow, for
tests). Inputs may be float16, bfloat16 or float32 (`SUPPORTED_DTYPES`); every sum is float32. Without triton every
Triton module still imports (remote code, CPU-only installs): `triton` and `tl` are then stand-ins under which the
kernel definitions execute, and `HAS_TRITON` is False.

Memory layout and pointer arithmetic (the same in every kernel)
---------------------------------------------------------------
A [B, T, H, D] input is a contiguous buffer of B·T tokens (batch rows one after the other): element (token t,
head h, column d) lies at (t·H + h)·D + d. A kernel working on head h moves the base pointer by h·D once and
then addresses a [rows, cols] tile as base + row·(H·D) + col (`load_tile` / `store_tile`). States
[slots, H, K, V] address the same way from the base (slot·H + h)·K·V with row stride V. Every load is masked
(rows past the chunk or sequence, columns past the head dim) and zero-filled, so block sizes are powers of two
whatever T, K and V are: a zero key or value adds nothing to any sum.

Chunk layout
------------
The chunked kernels cut batch rows, or the sequences of a packed row (cu_seqlens), into chunks of CHUNK_SIZE
tokens, described by the int32 tables of `Chunks`: a program reads its chunk's tokens and state slot with
`chunk_bounds`, a state pass its sequence's with `start_state_pass`. `chunk_cumsum` sums log decays from each
chunk's start (b, see `load_decay`).
"""

import functools
import os
import weakref

import torch
from torch import Tensor

from .ops_common import CHUNK_SIZE, log_decay_floor

try:
    import triton
    import triton.language as tl
except ImportError:  # backend "triton" then refuses every input; the kernels are defined but never launched
    triton = None

HAS_TRITON = triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # triton reads it when @triton.jit runs, i.e. at import
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_WINDOW_HEAD_DIM = 256  # D and V of the window softmax part: one tile of the window kernels

if not HAS_TRITON:

    class _NoTriton:
        """Stands in for `triton` and `triton.language` so that the kernel definitions still execute."""

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


def autotune_configs() -> list:
    """Launch configurations to autotune over: a single one under the interpreter (several fail there)."""
    if not HAS_TRITON:
        return []
    if INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3)]


def launch_warps(**head_dims: int) -> int:
    """Warps of every GPU launch, by the widest head dim it tiles (K, D or V): 8 at 64 or more (with 4, an sm_90
    compile spills registers, up to 2 KB in the linear kernels and 8 KB in the window and delta-rule ones), 4 below.
    On an H200 (Triton 3.6) the linear kernels at K = 20, V = 7 stopped with an illegal memory access whenever they
    ran with 8 warps (2 or 3 stages) and ran with 4 (docs/design.md, "The second GPU run")."""
    return 8 if max(head_dims.get(name, 0) for name in ("K", "D", "V")) >= 64 else 4


def usable_configs(configs: list, named_args: dict, **kwargs) -> list:
    """The configs the autotuner may pick for the kernels tuned over `autotune_configs()`: `launch_warps`' warps,
    and at 8 warps only 2 stages (3 spill registers); all of them under the interpreter."""
    if INTERPRET:
        return configs
    warps = launch_warps(**kwargs)
    return [c for c in configs if c.num_warps == warps and (warps == 4 or c.num_stages == 2)]


def block_size(dim: int, cap: int = 64) -> int:
    """Tile size covering `dim`: a power of two in [16, cap] (tl.dot needs ≥ 16 on a GPU)."""
    return min(cap, max(16, triton.next_power_of_2(dim)))


# ---------------------------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def tile_offsets(rows, row_stride, cols):
    """Element offsets of the [len(rows), len(cols)] tile; int64 rows, so huge buffers index safely."""
    return rows.to(tl.int64)[:, None] * row_stride + cols[None, :]


@triton.jit
def load_tile(base, rows, row_end, row_stride, cols, num_cols):
    """base[rows, cols] of a row-major buffer, zero where rows ≥ row_end or cols ≥ num_cols."""
    mask = (rows < row_end)[:, None] & (cols < num_cols)[None, :]
    return tl.load(base + tile_offsets(rows, row_stride, cols), mask=mask, other=0.0)


@triton.jit
def store_tile(base, tile, rows, row_end, row_stride, cols, num_cols):
    """base[rows, cols] = tile (in base's dtype), where rows < row_end and cols < num_cols."""
    mask = (rows < row_end)[:, None] & (cols < num_cols)[None, :]
    tl.store(base + tile_offsets(rows, row_stride, cols), tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def state_base(states, slot, h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Pointer to state [slot, h] of a [slots, H, K, V] buffer: a [K, V] tile with row stride V."""
    return states + (slot.to(tl.int64) * H + h) * (K * V)


@triton.jit
def chunk_bounds(chunk_info, chunk):
    """First token, end token (exclusive) and the state slot entering the chunk, from the int32 [chunks, 3] table."""
    return tl.load(chunk_info + 3 * chunk), tl.load(chunk_info + 3 * chunk + 1), tl.load(chunk_info + 3 * chunk + 2)


@triton.jit
def start_state_pass(
    seq_info, init, pid_k, pid_v, pid_nh, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    HAS_INIT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The start of a state pass program, the one of state tile (pid_k, pid_v) of sequence n, head h
    (pid_nh = n · H + h), shared by the passes of `ops_triton_linear` and `ops_triton_delta_rule`.

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
        state = load_tile(state_base(init, n, h, H, K, V), kk, K, V, vv, V).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    return h, kk, vv, first_token, end_token, first_slot, tl.cdiv(end_token - first_token, CHUNK), state


@triton.jit
def load_decay(b, h, rows, row_end, kk, H: tl.constexpr, K: tl.constexpr, DECAY: tl.constexpr):
    """Cumulative log decay b of `rows`: [rows, len(kk)] for DECAY_VECTOR, else [rows, 1] (DECAY_SCALAR: one per
    head; DECAY_NONE: no decay, i.e. zeros).

    b: fp32 [tokens, H, 1 | K]. Rows ≥ row_end read 0, which keeps every exponent built from them ≤ 0.
    """
    if DECAY == DECAY_VECTOR:
        tile = load_tile(b + h * K, rows, row_end, H * K, kk, K)
    elif DECAY == DECAY_SCALAR:
        tile = load_tile(b + h, rows, row_end, H, tl.arange(0, 1), 1)
    else:
        tile = tl.zeros([rows.shape[0], 1], dtype=tl.float32)
    return tile


@triton.jit
def dot(a, b, BF16_DOT: tl.constexpr):
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
def causal_decay(b, TRANSPOSE: tl.constexpr, CHUNK: tl.constexpr):
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


# ---------------------------------------------------------------------------------------------------------------
# Chunk layout
# ---------------------------------------------------------------------------------------------------------------


class Chunks:
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
def batch_chunks(batch: int, length: int, device: torch.device) -> Chunks:
    """The tables of a batch of `batch` rows of `length` tokens, built once per shape and device."""
    return Chunks(list(range(0, batch * length + 1, length)), device)


# id(cu_seqlens) -> (a weak reference to it, its version, the device, its Chunks); an entry leaves with its tensor.
_PACKED_CHUNKS: dict[int, tuple] = {}


def packed_chunks(cu_seqlens: Tensor, device: torch.device) -> Chunks:
    """The tables of the sequences packed at cu_seqlens [N + 1], built on the first call with this tensor (again only
    if it is modified in place) and reused: the one read of its values (a host sync for a CUDA tensor; none for a CPU
    copy, which is accepted as it is) happens once, e.g. once per model forward for all layers."""
    key = id(cu_seqlens)
    cached = _PACKED_CHUNKS.get(key)
    if cached is not None and cached[0]() is cu_seqlens and cached[1:3] == (cu_seqlens._version, device):
        return cached[3]
    chunks = Chunks(cu_seqlens.tolist(), device)
    reference = weakref.ref(cu_seqlens, lambda _: _PACKED_CHUNKS.pop(key, None))
    _PACKED_CHUNKS[key] = (reference, cu_seqlens._version, device, chunks)
    return chunks


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
    start, end, _ = chunk_bounds(chunk_info, chunk)
    rows = start + tl.arange(0, CHUNK)
    cols = tl.arange(0, BLOCK_D)
    tile = load_tile(terms + h * D, rows, end, H * D, cols, D).to(tl.float32)
    if CLAMP:
        tile = tl.maximum(tile, LOG_DECAY_FLOOR)
    store_tile(sums + h * D, tl.cumsum(tile, axis=0, reverse=REVERSE), rows, end, H * D, cols, D)


def chunk_cumsum(terms: Tensor, chunks: Chunks, reverse: bool, clamp: bool = False) -> Tensor:
    """fp32 cumulative sum of terms [.., H, D] over the tokens of each chunk, terms raised to LOG_DECAY_FLOOR first
    if clamp (see `_chunk_cumsum_kernel`)."""
    heads, dim = terms.shape[-2:]
    sums = torch.empty(terms.shape, dtype=torch.float32, device=terms.device)
    _chunk_cumsum_kernel[(chunks.num_chunks, heads)](
        terms, sums, chunks.chunk_info, H=heads, D=dim, BLOCK_D=triton.next_power_of_2(dim), CHUNK=CHUNK_SIZE,
        REVERSE=reverse, CLAMP=clamp,
    )
    return sums


def decay_mode(b: Tensor | None) -> int:
    """The kernels' DECAY for b: None, [.., 1] or [.., K]."""
    if b is None:
        return DECAY_NONE.value
    return DECAY_SCALAR.value if b.shape[-1] == 1 else DECAY_VECTOR.value


# ---------------------------------------------------------------------------------------------------------------
# Input checks of backend "triton" (`ops` asks them before picking it)
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


def real_token_bounds(key_padding_mask: Tensor | None, batch: int, length: int, device: torch.device) -> Tensor:
    """int32 [B, 2]: each row's real tokens [lo, hi), which the window kernels take to be contiguous (left or right
    padding; `ops.window_attention` checks it where it checks values)."""
    if key_padding_mask is None:
        return torch.tensor([[0, length]], dtype=torch.int32, device=device).expand(batch, 2).contiguous()
    lo = key_padding_mask.int().argmax(-1)  # the first real token (0 for a row without any)
    hi = lo + key_padding_mask.sum(-1)
    return torch.stack([lo, hi], dim=1).int()
