"""Compiles every Triton kernel specialization that a small workload of the triton backend launches, for a Hopper
GPU (sm_90), on a machine without one. The interpreter accepts code that a GPU compiler rejects (dot blocks < 16,
shapes it cannot lay out...): this catches it on CPU-only CI.

    python -m benchmarks.gpu_compile_check          # bfloat16, one head-dim set: a few dozen kernels
    python -m benchmarks.gpu_compile_check --cover  # of those, enough that each kernel's every value compiles (a test)
    python -m benchmarks.gpu_compile_check --all    # float16 / bfloat16 / float32, three head-dim sets

Run it WITHOUT TRITON_INTERPRET. Kernel launches are recorded instead of run, so the workload computes nothing.
Prints one line per kernel with its shared memory and exits 1 on any failure, a kernel that needs more shared memory
than a Hopper GPU has (227 KiB) included: such a kernel compiles, but fails at launch.
"""

import argparse
import os

import torch

from benchmarks.kernel_compile import compile_for_hopper, modes, record_workload


def covering(builds: list) -> list:
    """The fewest builds (greedy) in which every kernel, and each value of its constexprs, block sizes and argument
    types, is compiled at least once: the interpreter-only mistakes sit in one branch or block shape (a dot block
    < 16, a tile too big for shared memory), rarely in one combination of otherwise compiled ones. The CI test's
    choice: all 55 builds of the default workload take ~70 s on its slow machine."""
    def features(spec, config):
        return ({("constexpr", *item) for item in spec.constexprs.items()}
                | {("type", *item) for item in spec.signature.items()}
                | {("block", *item) for item in (config.kwargs.items() if config else ())})

    chosen = []
    for name in dict.fromkeys(name for name, _, _ in builds):
        mine = [(features(spec, config), (name, spec, config)) for n, spec, config in builds if n == name]
        uncovered = set().union(*(found for found, _ in mine))
        while uncovered:
            found, build = max(mine, key=lambda candidate: len(candidate[0] & uncovered))  # the first of the best
            uncovered -= found
            chosen.append(build)
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="all input dtypes and three head-dim sets")
    parser.add_argument("--cover", action="store_true", help="the fewest compiles in which every kernel and each "
                        "value of its constexprs, block sizes and argument types compiles at least once")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    if args.all:
        seen = record_workload([torch.bfloat16, torch.float16, torch.float32], [(128, 128), (80, 47), (256, 256)],
                               [False, True])
    else:
        seen = record_workload([torch.bfloat16], [(80, 47)], [False])
    builds = []  # (kernel name, spec, config)
    for (name, _, _), spec in seen.items():
        # One compile per distinct set of block sizes the autotuner may pick (the first such config's warps).
        by_blocks = {}
        for config in spec.configs:
            by_blocks.setdefault(tuple(sorted(config.kwargs.items())) if config else (), config)
        builds += [(name, spec, config) for config in by_blocks.values()]
    if args.cover:
        builds = covering(builds)
    failures = 0
    for name, spec, config in builds:
        warps = config.num_warps if config else 4
        try:
            compiled = compile_for_hopper(spec, config)
            print(f"ok   {name} {modes(spec)} {dict(config.kwargs) if config else ''} {warps} warps, shared "
                  f"{compiled.shared_bytes / 1024:.0f} KiB", flush=True)
        except Exception as error:  # report every failing kernel, not only the first
            failures += 1
            print(f"FAIL {name} {modes(spec)} {dict(config.kwargs) if config else ''}\n{error}", flush=True)
    print(f"{len(builds)} kernels compiled for sm_90, {failures} failed")
    return int(failures > 0)


if __name__ == "__main__":
    raise SystemExit(main())
