"""A static report on the Triton kernels, made on CPU: how they compile for a Hopper GPU and how many HBM bytes a
forward + backward pass moves, beside flash-linear-attention's (fla) chunk ops.

Compile (no GPU needed): every kernel specialization the triton backend launches in bf16 at head dims 64 and 128
(linear attention with each decay mode and normalize, the window and delta-rule ops, forward and backward),
built for sm_90 with every autotune config: registers per thread, spill bytes and shared memory, from ptxas.
Target: zero spills in every config the autotuner may pick.

Traffic: linear_attention(backend="triton") with decay none / scalar (per head) / vector (per key dim), forward
and backward in bf16, against fla's chunk_simple_gla (none, scalar) and chunk_gla (vector). The kernels run in
Triton's interpreter, counting the bytes of every unmasked element each program loads and stores, plus the
bytes every torch operation between kernels reads and writes (benchmarks/kernel_traffic.py). A chunked pass
moves bytes = per_token · B·T·H + per_sequence · B·H: both are fitted on (1, T, 1, D) at two lengths and
checked at a third (the "fit error" column), then evaluated at the real shapes.
Target: ours / fla ≤ 1.0 on every shape and decay mode.

    python -m benchmarks.kernel_report                          # full report (several minutes)
    python -m benchmarks.kernel_report --fla_dir build/wheels   # fla's wheels (make fla-wheels) or packages
    python -m benchmarks.kernel_report --dry                    # tiny shapes, one kernel compiled (CI)
    python -m benchmarks.kernel_report --parts compile --kernels _chunk_dqk_kernel   # one part, some kernels

Run it WITHOUT TRITON_INTERPRET (the traffic is counted in a spawned process with it). Prints the tables and writes
kernel_compile.{md,json} and kernel_traffic.{md,json} to --output_dir.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import multiprocessing
import os
import sys
import tempfile
import zipfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import HfArgumentParser

from benchmarks.common import KERNEL_DECAYS as DECAYS
from benchmarks.common import KERNEL_SHAPES as SHAPES
from benchmarks.common import write_report
from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.training.command_line import exit_on_bad_input, parse_dataclasses

FLA_OPS = {"none": "chunk_simple_gla", "scalar": "chunk_simple_gla", "vector": "chunk_gla"}


@dataclass
class KernelReportArguments:
    shapes: list[str] = field(
        default_factory=lambda: list(SHAPES), metadata={"help": "BxTxHxD shapes of the traffic table."})
    fit_lengths: list[int] = field(default_factory=lambda: [128, 256, 512], metadata={
        "help": "Three T (multiples of 64) of the (1, T, 1, D) runs: the first two fit the byte counts, the third "
                "checks the fit."})
    compile_dims: list[int] = field(default_factory=lambda: [64, 128], metadata={"help": "Head dims compiled."})
    fla_dir: str = field(default="", metadata={
        "help": "A folder of fla's wheels (fla-core, flash-linear-attention; make fla-wheels) or of its unpacked "
                "packages; empty: fla as installed, if it is."})
    parts: list[str] = field(default_factory=lambda: ["traffic", "compile"], metadata={
        "help": "The parts to run: traffic, compile, or both."})
    kernels: list[str] = field(default_factory=list, metadata={
        "help": "Compile only the kernels with these names (e.g. _chunk_dqk_kernel); empty: every kernel."})
    dry: bool = field(default=False, metadata={"help": "Tiny shapes and one kernel config compiled (CI)."})
    output_dir: str = "outputs/kernel_report"


# ---------------------------------------------------------------------------------------------------------------
# Compile: registers, spills, shared memory
# ---------------------------------------------------------------------------------------------------------------


def compile_rows(args: KernelReportArguments) -> list[dict]:
    """One row per (kernel specialization, autotune config) at each head dim of `args.compile_dims`."""
    from benchmarks.kernel_compile import compile_for_hopper, modes, record_workload

    dims = [(d, d) for d in args.compile_dims]
    seen = record_workload([torch.bfloat16], dims, [False] if args.dry else [False, True])
    specs = [s for s in seen.values() if not args.kernels or s.kernel.__name__ in args.kernels]
    if args.dry:  # the first specialization launched
        specs = specs[:1]
    rows = []
    for spec in specs:
        for config in spec.configs[:1] if args.dry else spec.configs:
            row = {"kernel": spec.kernel.__name__, "modes": " ".join(f"{k}={v}" for k, v in modes(spec).items()),
                   "config": "default (4 warps, 2 stages)" if config is None else
                   " ".join([f"{k}={v}" for k, v in config.kwargs.items()]
                            + [f"warps={config.num_warps}", f"stages={config.num_stages}"])}
            try:
                row.update(asdict(compile_for_hopper(spec, config)))
            except Exception as error:  # recorded, and counted as a failure
                row["error"] = str(error).strip().splitlines()[0][:200]
            rows.append(row)
            print(f"  {row['kernel']:<26} {row['modes']:<60} {row['config']:<30} "
                  f"{row.get('registers', '-')} regs, {row.get('spill_stores', '-')} B spilled", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Traffic: bytes per forward + backward (in a spawned process, under TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------------------------


def traffic_inputs(decay: str, length: int, dim: int) -> dict:
    """bf16 q, k, v [1, T, 1, D] and an fp32 log decay ([1, T, 1] scalar, [1, T, 1, D] vector), all needing grads."""
    g = torch.Generator().manual_seed(length)
    x = {name: torch.randn(1, length, 1, dim, generator=g).bfloat16().requires_grad_() for name in ("q", "k", "v")}
    shape = {"none": None, "scalar": (1, length, 1), "vector": (1, length, 1, dim)}[decay]
    if shape is not None:
        x["g"] = F.logsigmoid(torch.randn(shape, generator=g) + 4).requires_grad_()
    return x


def traffic_ops(fla) -> dict:
    """{method: op(q, k, v, g=None) -> o [B, T, H, V]}: ours, and fla's when importable."""
    from hf_linear_attn.ops import linear_attention

    ops = {"ours": lambda q, k, v, g=None: linear_attention(q, k, v, g, backend="triton")[0]}
    if fla is not None:
        ops["fla"] = lambda q, k, v, g=None: getattr(fla, FLA_OPS["vector" if g is not None and g.dim() == 4 else
                                                                   "scalar"])(q, k, v, g, scale=q.shape[-1] ** -0.5)[0]
    return ops


def count_all(args: KernelReportArguments) -> dict:
    """{"fla_error": why fla is absent or None, "runs": [{method, decay, D, T, fwd, bwd, rows}]}."""
    from benchmarks.kernel_traffic import forward_backward_traffic

    try:
        import fla.ops as fla
        fla_error = None
    except Exception as error:  # ImportError, or an fla that fails to import on this machine
        fla, fla_error = None, f"{type(error).__name__}: {error}"
    runs = []
    dims = sorted({int(shape.split("x")[3]) for shape in args.shapes})
    for dim in dims:
        for method, op in traffic_ops(fla).items():
            for decay in DECAYS:
                for length in args.fit_lengths:
                    traffic = forward_backward_traffic(op, traffic_inputs(decay, length, dim))
                    runs.append({"method": method, "decay": decay, "D": dim, "T": length,
                                 "fwd": traffic.total("fwd"), "bwd": traffic.total("bwd"),
                                 "rows": [[phase, row, r, w] for (phase, row), (r, w) in traffic.rows.items()]})
                    print(f"  counted {method} {decay} D={dim} T={length}: {runs[-1]['fwd'] + runs[-1]['bwd']:,} B",
                          flush=True)
    return {"fla_error": fla_error, "runs": runs}


class PackagesFromFolder(importlib.abc.MetaPathFinder):
    """Imports the top-level packages and modules of `folder` (fla's unpacked wheels: fla, einops) from there, ahead
    of any installed copy, without putting `folder` on sys.path: their submodules then import from the packages'
    own folders."""

    def __init__(self, folder: str):
        self.folder = folder
        self.names = {entry.stem for entry in Path(folder).iterdir()
                      if (entry / "__init__.py").is_file() or entry.suffix == ".py"}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [self.folder])


def count_in_this_process(args: KernelReportArguments, fla_path: str) -> dict:
    """count_all in a fresh process: the interpreter chosen before any kernel is defined, fla's packages from
    `fla_path` (when given) ahead of installed ones, and no input value checks (`ops_common.checks_values`), which a
    GPU run skips."""
    os.environ["TRITON_INTERPRET"] = "1"
    if fla_path:
        sys.meta_path.insert(0, PackagesFromFolder(fla_path))
    from hf_linear_attn import ops_common

    ops_common.checks_values = lambda x: False  # as on a GPU: the value checks run on CPU tensors only
    return count_all(args)


def count_in_child(args: KernelReportArguments) -> dict:
    """count_all in a spawned process (this one compiles real kernels), with fla's packages from --fla_dir (its
    wheels unpacked into a temporary folder, or the folder itself)."""
    with tempfile.TemporaryDirectory() as unpacked:
        fla_path = ""
        if args.fla_dir:
            wheels = sorted(Path(args.fla_dir).glob("*.whl"))
            for wheel in wheels:
                zipfile.ZipFile(wheel).extractall(unpacked)
            fla_path = unpacked if wheels else args.fla_dir
        # The child imports this module, and with it hf_linear_attn (whose kernels take the interpreter or not at
        # import), before count_in_this_process runs: TRITON_INTERPRET is in its environment from its start.
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
                return pool.submit(count_in_this_process, args, fla_path).result()
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous


def fit(runs: list[dict], phase: str) -> tuple[float, float, float]:
    """(bytes per token-head, bytes per sequence-head, relative error at the third length) of `phase` ("fwd",
    "bwd" or "total") from runs at three lengths (one method, decay, D; one sequence, one head)."""
    (t1, b1), (t2, b2), (t3, b3) = [(r["T"], r["fwd"] + r["bwd"] if phase == "total" else r[phase]) for r in runs]
    per_token = (b2 - b1) / (t2 - t1)
    per_sequence = b1 - per_token * t1
    return per_token, per_sequence, abs(per_token * t3 + per_sequence - b3) / b3


def traffic_rows(counts: dict, args: KernelReportArguments) -> list[dict]:
    """One row per shape and decay: GB moved forward, backward and in all, ours and fla's, and their ratio."""
    rows = []
    for shape in args.shapes:
        batch, length, heads, dim = (int(n) for n in shape.split("x"))
        for decay in DECAYS:
            row = {"shape": shape, "decay": decay}
            for method in ("ours", "fla"):
                runs = [r for r in counts["runs"] if (r["method"], r["decay"], r["D"]) == (method, decay, dim)]
                if not runs:
                    continue
                for phase in ("fwd", "bwd", "total"):
                    per_token, per_sequence, error = fit(runs, phase)
                    moved = per_token * batch * length * heads + per_sequence * batch * heads
                    row[f"{method}_{phase}_gb"] = moved / 1e9
                    row[f"{method}_fit_error"] = max(row.get(f"{method}_fit_error", 0.0), error)
            if "fla_total_gb" in row:
                row["ours_vs_fla"] = row["ours_total_gb"] / row["fla_total_gb"]
                row["target_met"] = "yes" if row["ours_vs_fla"] <= 1.0 else "NO"
            rows.append(row)
    return rows


def kernel_breakdown(counts: dict, dim: int, length: int) -> list[dict]:
    """GB each kernel / torch op moves at (1, length, 1, dim), per method, decay and phase (the JSON's detail)."""
    detail = []
    for run in counts["runs"]:
        if (run["D"], run["T"]) == (dim, length):
            for phase, name, read, written in run["rows"]:
                detail.append({"method": run["method"], "decay": run["decay"], "phase": phase, "row": name,
                               "read": read, "written": written})
    return detail


# ---------------------------------------------------------------------------------------------------------------


def traffic_report(args: KernelReportArguments) -> None:
    """The traffic part: count, fit, print and write kernel_traffic.{md,json}."""
    print("Traffic (interpreted forward + backward passes):", flush=True)
    counts = count_in_child(args)
    if counts["fla_error"]:
        print(f"fla is not importable ({counts['fla_error']}): no fla columns (make fla-wheels, then --fla_dir)")
    rows = traffic_rows(counts, args)
    columns = {"shape": "B x T x H x D", "decay": "decay", "ours_fwd_gb": "ours fwd GB", "ours_bwd_gb": "ours bwd GB",
               "ours_total_gb": "ours GB", "fla_fwd_gb": "fla fwd GB", "fla_bwd_gb": "fla bwd GB",
               "fla_total_gb": "fla GB", "ours_vs_fla": "ours / fla", "target_met": "≤ 1.0",
               "ours_fit_error": "ours fit error", "fla_fit_error": "fla fit error"}
    dim = int(args.shapes[0].split("x")[3])
    detail = kernel_breakdown(counts, dim, args.fit_lengths[-1])
    write_report(rows, columns, args.output_dir, "kernel_traffic",
                 meta={"args": asdict(args), "fla_error": counts["fla_error"],
                       f"detail_1x{args.fit_lengths[-1]}x1x{dim}": detail})


def compile_report(args: KernelReportArguments) -> None:
    """The compile part: compile, print and write kernel_compile.{md,json}."""
    print("\nCompile for sm_90 (every specialization and autotune config):", flush=True)
    compiled = compile_rows(args)
    spilling = [r for r in compiled if r.get("spill_stores", 0) or r.get("spill_loads", 0)]
    failed = [r for r in compiled if "error" in r]
    columns = {"kernel": "kernel", "modes": "specialization", "config": "config", "registers": "registers",
               "spill_stores": "spill stores B", "spill_loads": "spill loads B", "shared_bytes": "shared B",
               "error": "error"}
    write_report(spilling + failed, columns, args.output_dir, "kernel_compile",
                 meta={"args": asdict(args), "all": compiled})
    print(f"{len(compiled)} kernel configs compiled for sm_90 at head dims {args.compile_dims}: "
          f"{len(spilling)} spill (target 0, listed above), {len(failed)} failed")


def check_arguments(args: KernelReportArguments) -> None:
    """Raise ValueError naming the argument for a report that cannot run, before any work."""
    if len(args.fit_lengths) != 3 or any(t % 64 for t in args.fit_lengths):
        raise InputError(f"--fit_lengths needs three multiples of 64, got {args.fit_lengths}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise InputError("unset TRITON_INTERPRET: the compile part builds real kernels (the traffic part sets it)")
    unknown = sorted(set(args.parts) - {"traffic", "compile"})
    if unknown:
        raise InputError(f"unknown --parts {unknown}: choose from traffic, compile")


def main(argv: list[str] | None = None) -> int:
    (args,) = parse_dataclasses(HfArgumentParser(KernelReportArguments), argv)
    if args.dry:
        args.shapes, args.fit_lengths, args.compile_dims = ["2x256x3x16"], [64, 128, 192], [16]
    with exit_on_bad_input():
        check_arguments(args)
    if "traffic" in args.parts:
        traffic_report(args)
    if "compile" in args.parts:
        compile_report(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
