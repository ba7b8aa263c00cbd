"""Kernel speed on a GPU: our Triton chunked linear attention vs flash-linear-attention vs FlashAttention, the
forward and forward+backward ms, TFLOP/s and the ratios ours / fla and sdpa / ours (benchmarks/kernel_timing.py
says what is timed and how the FLOPs are counted).

    python -m benchmarks.bench_kernels               # the issue's shapes and the T sweep 1K ... 64K (CUDA GPU)
    python -m benchmarks.bench_kernels --dry-run     # tiny shapes on CPU: torch chunked backend, plus the Triton
                                                     # kernels in the interpreter when triton is installed (and
                                                     # fla's ops when importable)

Prints a table, writes JSON (and a PNG of the T sweep when matplotlib is installed) to --output_dir.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # the Triton interpreter must be chosen before the kernels are defined (on import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import HfArgumentParser  # noqa: E402

from benchmarks.kernel_timing import KernelBenchmarkArguments, benchmark, report  # noqa: E402
from hf_linear_attn.training.command_line import parse_dataclasses  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    (args,) = parse_dataclasses(HfArgumentParser(KernelBenchmarkArguments), argv)
    report(benchmark(args), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
