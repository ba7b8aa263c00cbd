"""Shared pieces of the benchmark scripts: memory readings and timing. The table / JSON / plot report is
`training.report`'s (the evaluation writes the same tables), also importable from here."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hf_linear_attn.training.report import machine, write_report

__all__ = ["KERNEL_DECAYS", "KERNEL_SHAPES", "added_peak_mib", "machine", "measure", "reset_peak_rss",
           "return_freed_memory_to_the_os", "rss_kib", "write_report"]

# The kernel benchmark's and kernel report's problems: B x T x H x D shapes, and the decay modes of linear_attention.
KERNEL_SHAPES = ["1x8192x96x128", "2x16384x16x128", "4x2048x16x128", "8x1024x8x64"]
KERNEL_DECAYS = ("none", "scalar", "vector")


def return_freed_memory_to_the_os() -> None:
    """Re-exec this script with glibc serving every allocation over 64 KiB by mmap, so that freeing a tensor
    lowers RSS at once and per-measurement peaks (VmHWM - VmRSS) are not hidden by memory kept for reuse."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        # as it was started: `python -m benchmarks.NAME` (the benchmarks are modules of the checkout, not installed)
        os.execve(sys.executable, [sys.executable, "-m", sys.modules["__main__"].__spec__.name, *sys.argv[1:]], env)


def rss_kib(field_name: str = "VmRSS") -> int:
    """VmRSS (current) or VmHWM (peak since the last `reset_peak_rss`) of this process, in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS and return it (KiB), the baseline of `added_peak_mib`."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_kib("VmHWM")


def added_peak_mib(baseline: int) -> float:
    """MiB that the peak RSS rose above `baseline` (from `reset_peak_rss`). The kernel's RSS counters are
    approximate (counted in per-CPU batches), so a run that adds almost nothing can read a few pages below the
    baseline: that is a peak of 0, not a negative one."""
    return max(rss_kib("VmHWM") - baseline, 0) / 1024


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median seconds over `repeats` calls, peak MiB of RSS added while running them)."""
    baseline = reset_peak_rss()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), added_peak_mib(baseline)
