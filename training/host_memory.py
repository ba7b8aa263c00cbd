"""Keep the host memory a training process frees for its next allocations (glibc malloc): `keep_freed_memory`.

A training or evaluation step on CPU allocates and frees tensors of tens to hundreds of MB over and over (the
logits `[T, vocab]` and their log-softmax, MLP activations, gradients). By default glibc serves every block over
32 MB with a fresh `mmap` and unmaps it when it is freed, so the next step's tensor of the same size page-faults
every page in again, zero-filled by the kernel (and, on a VM that reports freed pages to its host, backed by the
host anew). Served from malloc's heap instead, and the heap never trimmed, a freed block is reused as it is.
Measured on a converted SmolLM2-135M (2,048 tokens, forward + backward, 2 CPU threads, the 2nd-4th steps of 3
runs each, docs/design.md "Host memory"): 21-29 s a step by default, 13.5-18.5 s with it; the peak resident
memory was the same (9.3-9.7 GB). What it costs: a process's resident memory does not shrink until it ends, so
it is for commands that run one job in one process (the demo, conversion and evaluation commands call it first;
not distill and finetune, which run under `accelerate launch`: see docs/design.md),
never set on import of the library.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
LARGEST_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the heap is trimmed only when 2 GiB at its top are free


def keep_freed_memory() -> bool:
    """Have glibc malloc serve every allocation from its heap (no `mmap` per large block) and keep the heap's freed
    memory for later allocations. Returns whether the C library took both settings (False on a platform without
    glibc's `mallopt`, where nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, LARGEST_TRIM_THRESHOLD))
