"""Shared pieces of the benchmark scripts: memory readings, timing, and the table / JSON / plot report."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def return_freed_memory_to_the_os() -> None:
    """Re-exec this script with glibc serving every allocation over 64 KiB by mmap, so that freeing a tensor
    lowers RSS at once and per-measurement peaks (VmHWM - VmRSS) are not hidden by memory kept for reuse."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def rss_kib(field_name: str = "VmRSS") -> int:
    """VmRSS (current) or VmHWM (peak since the last `reset_peak_rss`) of this process, in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS, so the next reading is the peak of what runs in between."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median seconds over `repeats` calls, peak MiB of RSS added while running them)."""
    baseline = rss_kib()
    reset_peak_rss()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (rss_kib("VmHWM") - baseline) / 1024


def machine() -> str:
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")


def write_report(rows: list[dict], columns: dict[str, str], out_dir: str, name: str,
                 plot: Callable | None = None, meta: dict | None = None) -> str:
    """Print and save a markdown table of `rows` (`columns` maps row keys to headers), the rows as JSON, and a
    PNG drawn by `plot(plt)` when matplotlib is installed. Returns the table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return "–" if value is None else str(value)

    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(key)) for key in columns) + " |" for row in rows]
    table = "\n".join(lines)
    print(table)
    (out / f"{name}.md").write_text(f"Machine: {machine()}\n\n{table}\n")
    (out / f"{name}.json").write_text(json.dumps({"machine": machine(), **(meta or {}), "rows": rows}, indent=2))
    written = [f"{name}.md", f"{name}.json"]
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("(install matplotlib, e.g. `pip install -e .[bench]`, for the plot)")
        else:
            fig = plot(plt)
            fig.savefig(out / f"{name}.png", dpi=120)
            plt.close(fig)
            written.append(f"{name}.png")
    print(f"wrote {', '.join(str(out / w) for w in written)}")
    return table
