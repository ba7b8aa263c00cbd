"""Kernel speed on a GPU, the library behind benchmarks/bench_kernels.py and the kernels stage of
benchmarks/gpu_check.py: our Triton chunked linear attention vs flash-linear-attention vs FlashAttention.

For every shape (B, T, H, D) and decay mode, in bf16, the forward and forward+backward time of
  ours   linear_attention(backend="triton"), decay none / scalar (per head) / vector (per key dim)
  fla    chunk_linear_attn(normalize=False) / chunk_simple_gla / chunk_gla, the matching flash-linear-attention
         ops (skipped when not importable)
  sdpa   scaled_dot_product_attention(is_causal=True) on the flash backend (one row per shape)
with the TFLOP/s achieved and, measured in the same run, the ratios ours / fla (≤ 1: ours faster) and
sdpa / ours (our speed-up over softmax attention). FLOPs counted: chunked linear attention with chunks of C = 64,
forward 2·B·H·T·(2·D² + C·2D) (state and output products, the full C x C intra-chunk block), backward twice the
forward; causal softmax attention, forward 2·B·H·T²·D, backward 2.5 times the forward.

A dry run (tiny shapes on CPU, each call timed once: the torch chunked backend, and the Triton kernels in the
interpreter when triton is installed) needs TRITON_INTERPRET=1 set before this module is imported: the kernels are
defined on import.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from benchmarks.common import KERNEL_DECAYS as DECAYS
from benchmarks.common import KERNEL_SHAPES as SHAPES
from benchmarks.common import machine, write_report
from hf_linear_attn.ops import linear_attention
from hf_linear_attn.ops_triton_common import HAS_TRITON

CHUNK = 64  # chunk size of the FLOP count (ours and fla both use 64)
FLA_OPS = {"none": "chunk_linear_attn", "scalar": "chunk_simple_gla", "vector": "chunk_gla"}


@dataclass
class KernelBenchmarkArguments:
    shapes: list[str] = field(
        default_factory=lambda: list(SHAPES), metadata={"help": "BxTxHxD shapes."},
    )
    sweep_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768, 65536],
                                     metadata={"help": "T of the sweep at (1, T, --sweep_heads, --sweep_dim)."})
    sweep_heads: int = 16
    sweep_dim: int = 128
    decays: list[str] = field(default_factory=lambda: list(DECAYS), metadata={"help": "none, scalar, vector."})
    peak_tflops: float = field(default=989.0, metadata={"help": "The GPU's dense bf16 peak (H100 / H200 SXM: 989)."})
    warmup_ms: int = 25
    repeat_ms: int = 100
    dry_run: bool = field(default=False, metadata={"help": "Tiny shapes on CPU, so the script cannot rot."})
    output_dir: str = "outputs/bench_kernels"


@dataclass
class Setup:
    device: str
    dtype: torch.dtype
    ours: list[str]  # linear_attention backends timed as "ours"
    fla: object | None  # the fla.ops module, or None


def setup(args: KernelBenchmarkArguments) -> Setup:
    """The device, dtype and methods of a run; a dry run also shrinks args' shapes to tiny ones."""
    try:
        import fla.ops as fla
    except Exception as error:  # not installed, or an fla that fails to import with this torch / triton
        print(f"flash-linear-attention is not importable ({type(error).__name__}: {error}): no fla rows", flush=True)
        fla = None
    if args.dry_run:
        args.shapes, args.sweep_lengths, args.sweep_heads, args.sweep_dim = ["1x70x1x16"], [32, 70], 1, 16
        interpreted = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
        return Setup("cpu", torch.float32, ["torch", "triton"] if interpreted else ["torch"], fla)
    if not torch.cuda.is_available() or not HAS_TRITON:
        raise RuntimeError("the kernel benchmark needs a CUDA GPU and triton (or a dry run on CPU)")
    return Setup("cuda", torch.bfloat16, ["triton"], fla)


def make_inputs(shape: tuple[int, int, int, int], decay: str, s: Setup) -> dict:
    batch, length, heads, dim = shape
    g = torch.Generator(device=s.device).manual_seed(length)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=g, device=s.device)

    x = {name: randn(batch, length, heads, dim).to(s.dtype).requires_grad_() for name in ("q", "k", "v")}
    gate_shape = {"none": None, "scalar": (batch, length, heads), "vector": (batch, length, heads, dim)}[decay]
    x["log_decay"] = None if gate_shape is None else F.logsigmoid(randn(*gate_shape) + 4).requires_grad_()
    return x


def method_fn(method: str, decay: str, x: dict, s: Setup) -> Callable[[], torch.Tensor]:
    """A function returning the output of `method` on inputs `x`."""
    q, k, v, g = x["q"], x["k"], x["v"], x["log_decay"]
    scale = q.shape[-1] ** -0.5
    if method == "sdpa":
        def sdpa():
            q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
            if s.device != "cuda":
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
        return sdpa
    if method == "fla":
        op = getattr(s.fla, FLA_OPS[decay])
        if decay == "none":
            return lambda: op(q, k, v, scale=scale, normalize=False)[0]
        return lambda: op(q, k, v, g, scale=scale)[0]
    backend = method.split(":")[1]
    return lambda: linear_attention(q, k, v, g, scale=scale, backend=backend)[0]


def time_ms(fn: Callable[[], object], args: KernelBenchmarkArguments, s: Setup) -> float:
    """Median milliseconds per call (on CPU, a dry run: one call, its first: what it measures is that it runs)."""
    if s.device == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.repeat_ms, return_mode="median")
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def forward_flops(method: str, shape: tuple[int, int, int, int]) -> float:
    batch, length, heads, dim = shape
    if method == "sdpa":
        return 2.0 * batch * heads * length * length * dim
    return 2.0 * batch * heads * length * (2 * dim * dim + CHUNK * 2 * dim)


def measure_row(method: str, decay: str, shape: tuple[int, int, int, int], args, s: Setup) -> dict:
    x = make_inputs(shape, decay, s)
    forward = method_fn(method, decay, x, s)
    leaves = [t for t in x.values() if t is not None]

    def forward_backward():
        for t in leaves:
            t.grad = None
        forward().float().sum().backward()

    with torch.no_grad():
        fwd_ms = time_ms(forward, args, s)
    fwd_bwd_ms = time_ms(forward_backward, args, s)
    flops = forward_flops(method, shape)
    total = flops * (3.5 if method == "sdpa" else 3.0)
    row = {"shape": "x".join(map(str, shape)), "T": shape[1], "decay": "-" if method == "sdpa" else decay,
           "method": method, "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
           "fwd_tflops": flops / fwd_ms / 1e9, "fwd_bwd_tflops": total / fwd_bwd_ms / 1e9}
    row["fwd_bwd_peak_pct"] = 100 * row["fwd_bwd_tflops"] / args.peak_tflops
    return row


def add_ratios(rows: list[dict]) -> None:
    """ours / fla and sdpa / ours, from rows of the same shape (and decay), i.e. measured in the same run."""
    by_key = {(r["shape"], r["decay"], r["method"]): r for r in rows if "error" not in r}
    for r in rows:
        if not r["method"].startswith("ours") or "error" in r:
            continue
        fla = by_key.get((r["shape"], r["decay"], "fla"))
        sdpa = by_key.get((r["shape"], "-", "sdpa"))
        for phase in ("fwd", "fwd_bwd"):
            if fla is not None:
                r[f"{phase}_vs_fla"] = r[f"{phase}_ms"] / fla[f"{phase}_ms"]
            if sdpa is not None:
                r[f"{phase}_speedup_vs_sdpa"] = sdpa[f"{phase}_ms"] / r[f"{phase}_ms"]


def benchmark(args: KernelBenchmarkArguments, on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every row of the benchmark (the shapes, then the T sweep) with their ratios, each printed as measured and,
    with `on_row`, handed to it with the rows so far (a caller that may be stopped keeps what was measured)."""
    s = setup(args)
    device_name = torch.cuda.get_device_name() if s.device == "cuda" else machine()
    print(f"{device_name}; {s.dtype}; ours = linear_attention backend(s) {s.ours}", flush=True)
    shapes = [tuple(int(n) for n in text.split("x")) for text in args.shapes]
    shapes += [(1, length, args.sweep_heads, args.sweep_dim) for length in args.sweep_lengths]
    rows = []
    for shape in dict.fromkeys(shapes):  # in order, without repeats
        methods = [(f"ours:{backend}", decay) for decay in args.decays for backend in s.ours]
        methods += [("fla", decay) for decay in args.decays if s.fla is not None]
        methods.append(("sdpa", "none"))
        for method, decay in methods:
            try:
                row = measure_row(method, decay, shape, args, s)
                print(f"  {row['shape']:>16} {row['decay']:>6} {method:<12} fwd {row['fwd_ms']:8.3f} ms, "
                      f"fwd+bwd {row['fwd_bwd_ms']:8.3f} ms ({row['fwd_bwd_tflops']:.1f} TFLOP/s)", flush=True)
            except Exception as error:  # out of memory, an op that fails on this GPU: recorded, the next one runs
                row = {"shape": "x".join(map(str, shape)), "T": shape[1], "decay": "-" if method == "sdpa" else decay,
                       "method": method, "error": f"{type(error).__name__}: {str(error).strip()[:300]}"}
                print(f"  {row['shape']:>16} {row['decay']:>6} {method:<12} FAILED {row['error']}", flush=True)
            rows.append(row)
            if s.device == "cuda":
                torch.cuda.empty_cache()
            add_ratios(rows)  # after every row: a caller stopped part-way keeps what was measured
            if on_row is not None:
                on_row(rows)
    return rows


def report(rows: list[dict], args: KernelBenchmarkArguments) -> None:
    """The table (printed), kernels.json and, with matplotlib, kernels.png of the T sweep in args.output_dir."""
    columns = {"shape": "B x T x H x D", "decay": "decay", "method": "method", "fwd_ms": "fwd ms",
               "fwd_bwd_ms": "fwd+bwd ms", "fwd_bwd_tflops": "fwd+bwd TFLOP/s", "fwd_bwd_peak_pct": "% of peak",
               "fwd_vs_fla": "fwd ours/fla", "fwd_bwd_vs_fla": "fwd+bwd ours/fla",
               "fwd_bwd_speedup_vs_sdpa": "fwd+bwd sdpa/ours", "error": "error"}
    sweep = {(1, length, args.sweep_heads, args.sweep_dim) for length in args.sweep_lengths}
    sweep_shapes = {"x".join(map(str, shape)) for shape in sweep}

    def plot(plt):
        fig, (ax_time, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
        for method, decay in dict.fromkeys((r["method"], r["decay"]) for r in rows):
            mine = [r for r in rows if (r["method"], r["decay"]) == (method, decay) and r["shape"] in sweep_shapes
                    and "error" not in r]
            label = method if method == "sdpa" else f"{method} {decay}"
            ax_time.plot([r["T"] for r in mine], [r["fwd_bwd_ms"] for r in mine], "o-", label=label)
            ax_rate.plot([r["T"] for r in mine], [r["fwd_bwd_tflops"] for r in mine], "o-", label=label)
        ax_time.set(xscale="log", yscale="log", xlabel="T", ylabel="fwd+bwd ms")
        ax_rate.set(xscale="log", xlabel="T", ylabel="fwd+bwd TFLOP/s")
        ax_rate.legend(fontsize=7)
        fig.suptitle(f"(1, T, {args.sweep_heads}, {args.sweep_dim})")
        fig.tight_layout()
        return fig

    write_report(rows, columns, args.output_dir, "kernels", plot, meta={"args": asdict(args)})

