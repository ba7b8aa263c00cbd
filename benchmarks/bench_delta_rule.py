"""The delta rule on CPU: chunked `delta_rule_attention` vs its token-loop oracle, and peak memory vs T.

First the chunked forward+backward alone at each of `--memory_lengths`, to show memory linear in T (peak KiB per
token flat). Then the forward and forward+backward of `delta_rule_attention(backend="torch")` and
`delta_rule_attention(backend="recurrent")` (the Python loop over tokens) at each of `--lengths`, and the peak RSS
each adds. Gated decay, fp32, shape (B, T, H, K = V) = (1, T, 4, 64) by default. The issue's target: chunked
forward+backward ≥ 20× faster than the loop at T = 4K.

Peaks are read with glibc serving every allocation over 64 KiB by mmap (`return_freed_memory_to_the_os`), which
makes each such tensor a fresh mapping whose pages fault in on first touch: that slowed the chunked forward+backward
~2.7× and the loop ~1.5× in a measurement at T = 4K. So the speed table's times come from a child process with the
default allocator (the `*_mmap_ms` columns keep the times of the peak runs); the memory rows are timed as read.

    python -m benchmarks.bench_delta_rule
    python -m benchmarks.bench_delta_rule --lengths 256 --memory_lengths 256 512 --repeats 1   # quick look
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from transformers import HfArgumentParser

from benchmarks.common import machine, measure, return_freed_memory_to_the_os, write_report
from hf_linear_attn.ops_delta_rule import delta_rule_attention
from hf_linear_attn.training.command_line import parse_dataclasses


@dataclass
class DeltaRuleBenchmarkArguments:
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096],
                               metadata={"help": "T for the chunked vs token-loop comparison."})
    memory_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384],
                                      metadata={"help": "T for the chunked peak-memory scan."})
    batch: int = 1
    heads: int = 4
    head_dim: int = field(default=64, metadata={"help": "K = V."})
    repeats: int = field(default=3, metadata={"help": "Timed runs per chunked cell (median); 1 for the loop."})
    output_dir: str = "outputs/bench_delta_rule"
    timing_child: bool = field(default=False, metadata={"help": "Internal: time the speed cells, print JSON."})


def inputs(args: DeltaRuleBenchmarkArguments, length: int, grad: bool) -> dict:
    g = torch.Generator().manual_seed(length)
    shape = (args.batch, length, args.heads, args.head_dim)
    tensors = {
        "q": torch.randn(shape, generator=g),
        "k": F.normalize(torch.randn(shape, generator=g), dim=-1),
        "v": torch.randn(shape, generator=g),
        "beta": torch.rand(shape[:3], generator=g),
        "log_decay": F.logsigmoid(torch.randn(shape[:3], generator=g) + 4),
    }
    return {n: t.requires_grad_(grad) for n, t in tensors.items()}


def run(method: str, x: dict, backward: bool) -> None:
    o, _ = delta_rule_attention(**x, backend=method)
    if backward:
        o.sum().backward()


def time_cell(args: DeltaRuleBenchmarkArguments, method: str, length: int, backward: bool) -> tuple[float, float]:
    x = inputs(args, length, grad=backward)
    with torch.set_grad_enabled(backward):
        run(method, x, backward)  # warm-up
        repeats = 1 if method == "recurrent" else args.repeats  # the loop is slow and steady
        return measure(lambda: run(method, x, backward), repeats)


def speed_times(args: DeltaRuleBenchmarkArguments) -> dict[str, float]:
    """Median seconds of each speed cell, keyed "T method fwd|fwd_bwd"."""
    return {f"{length} {method} {'fwd_bwd' if backward else 'fwd'}": time_cell(args, method, length, backward)[0]
            for length in args.lengths for method in ("torch", "recurrent") for backward in (False, True)}


def speed_times_with_default_allocator(args: DeltaRuleBenchmarkArguments, argv: list[str]) -> dict[str, float]:
    """`speed_times` in a child process that runs with glibc's default allocator settings."""
    env = {name: value for name, value in os.environ.items() if name != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-m", __spec__.name, *argv, "--timing_child", "true"], capture_output=True,
                         text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    (args,) = parse_dataclasses(HfArgumentParser(DeltaRuleBenchmarkArguments), argv)
    if args.timing_child:
        print(json.dumps(speed_times(args)))
        return 0
    return_freed_memory_to_the_os()
    print(f"{machine()}; B={args.batch}, H={args.heads}, K=V={args.head_dim}, gated decay, fp32")
    rows = []
    # Memory first: the token loop's many small tensors leave freed heap in RSS that later runs would reuse
    # unseen, hiding their peaks.
    for length in args.memory_lengths:
        seconds, peak = time_cell(args, "torch", length, backward=True)
        rows.append({"part": "memory", "T": length, "method": "torch", "fwd_bwd_ms": 1000 * seconds,
                     "fwd_bwd_peak_mib": peak, "peak_kib_per_token": 1024 * peak / length})
        print(f"  T={length:>6} torch     fwd+bwd {1000 * seconds:9.1f} ms  peak {peak:.0f} MiB", flush=True)

    times = speed_times_with_default_allocator(args, argv)
    for length in args.lengths:
        for method in ("torch", "recurrent"):
            row = {"part": "speed", "T": length, "method": method}
            for backward in (False, True):
                seconds, peak = time_cell(args, method, length, backward)
                key = "fwd_bwd" if backward else "fwd"
                row[f"{key}_mmap_ms"], row[f"{key}_peak_mib"] = 1000 * seconds, peak
                row[f"{key}_ms"] = 1000 * times[f"{length} {method} {key}"]
            rows.append(row)
            print(f"  T={length:>6} {method:<9} fwd {row['fwd_ms']:9.1f} ms  fwd+bwd {row['fwd_bwd_ms']:9.1f} ms  "
                  f"(mmap {row['fwd_bwd_mmap_ms']:9.1f} ms)  peak {row['fwd_bwd_peak_mib']:.0f} MiB", flush=True)
    loop = {r["T"]: r for r in rows if r["method"] == "recurrent"}
    for r in rows:
        if r["part"] == "speed" and r["method"] == "torch":
            r["fwd_speedup_vs_recurrent"] = loop[r["T"]]["fwd_ms"] / r["fwd_ms"]
            r["fwd_bwd_speedup_vs_recurrent"] = loop[r["T"]]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            r["fwd_bwd_mmap_speedup_vs_recurrent"] = loop[r["T"]]["fwd_bwd_mmap_ms"] / r["fwd_bwd_mmap_ms"]

    columns = {"part": "part", "T": "T", "method": "method", "fwd_ms": "fwd ms", "fwd_bwd_ms": "fwd+bwd ms",
               "fwd_bwd_mmap_ms": "fwd+bwd ms (mmap)",
               "fwd_bwd_peak_mib": "fwd+bwd peak MiB", "peak_kib_per_token": "peak KiB / token",
               "fwd_speedup_vs_recurrent": "fwd × vs loop", "fwd_bwd_speedup_vs_recurrent": "fwd+bwd × vs loop",
               "fwd_bwd_mmap_speedup_vs_recurrent": "fwd+bwd × vs loop (mmap)"}

    def plot(plt):
        fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
        for method in ("torch", "recurrent"):
            mine = [r for r in rows if r["part"] == "speed" and r["method"] == method]
            speed.plot([r["T"] for r in mine], [r["fwd_bwd_ms"] for r in mine], "o-", label=method)
        speed.set(xscale="log", yscale="log", xlabel="T", ylabel="fwd+bwd ms")
        speed.legend()
        mine = [r for r in rows if r["part"] == "memory"]
        memory.plot([r["T"] for r in mine], [r["fwd_bwd_peak_mib"] for r in mine], "o-", label="torch (chunked)")
        memory.set(xlabel="T", ylabel="fwd+bwd peak MiB")
        memory.legend()
        fig.tight_layout()
        return fig

    write_report(rows, columns, args.output_dir, "delta_rule", plot, meta={"args": asdict(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
