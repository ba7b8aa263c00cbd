"""Op scaling on CPU: our chunked linear attention vs the recurrent oracle vs causal softmax SDPA.

For each sequence length T and decay mode, times the forward and forward+backward of
`linear_attention(backend="torch")`, of `linear_attention(backend="recurrent")` (up to
`--max_recurrent_len`: it is a Python loop over tokens) and of causal
`scaled_dot_product_attention` (up to `--max_sdpa_len`), all fp32 with shape (B, T, H, D) =
(1, T, 8, 64) by default, and the peak RSS each adds. All in one process, side by side.

    python -m benchmarks.bench_ops                              # T = 512 ... 32K
    python -m benchmarks.bench_ops --lengths 512 1024 --decays none --repeats 1   # quick look
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from transformers import HfArgumentParser

from benchmarks.common import machine, measure, return_freed_memory_to_the_os, write_report
from hf_linear_attn import linear_attention
from hf_linear_attn.training.command_line import parse_dataclasses


@dataclass
class OpBenchmarkArguments:
    lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096, 8192, 16384, 32768])
    decays: list[str] = field(default_factory=lambda: ["none", "scalar", "vector"],
                              metadata={"help": "none, scalar ([B,T,H]; also 'fixed') or vector ([B,T,H,K])."})
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    repeats: int = field(default=3, metadata={"help": "Timed runs per cell (median); 1 for the token loop."})
    max_recurrent_len: int = field(default=4096, metadata={"help": "Longest T for the token-loop oracle."})
    max_sdpa_len: int = field(default=16384, metadata={"help": "Longest T for softmax SDPA."})
    output_dir: str = "outputs/bench_ops"


def inputs(args: OpBenchmarkArguments, length: int, decay: str, grad: bool) -> dict:
    g = torch.Generator().manual_seed(length)
    shape = (args.batch, length, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    q, k = F.elu(q) + 1, F.elu(k) + 1  # a feature map's output
    log_decay = None
    if decay == "scalar":
        log_decay = F.logsigmoid(torch.randn(shape[:3], generator=g) + 4)
    elif decay == "vector":
        log_decay = F.logsigmoid(torch.randn(shape, generator=g) + 4)
    tensors = {"q": q, "k": k, "v": v, "log_decay": log_decay}
    return {n: t.requires_grad_(grad) if t is not None else None for n, t in tensors.items()}


def run(method: str, x: dict, backward: bool) -> None:
    if method == "sdpa":
        q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        o, _ = linear_attention(x["q"], x["k"], x["v"], x["log_decay"], normalize=True, backend=method)
    if backward:
        o.sum().backward()


def main(argv: list[str] | None = None) -> int:
    (args,) = parse_dataclasses(HfArgumentParser(OpBenchmarkArguments), argv)
    return_freed_memory_to_the_os()
    print(f"{machine()}; B={args.batch}, H={args.heads}, D={args.head_dim}, fp32")
    rows = []
    for decay in args.decays:
        for length in args.lengths:
            for method in ("torch", "recurrent", "sdpa"):
                if method == "recurrent" and length > args.max_recurrent_len:
                    continue
                if method == "sdpa" and (length > args.max_sdpa_len or decay != "none"):
                    continue  # softmax attention has no decay: one row per length is enough
                row = {"decay": decay if method != "sdpa" else "-", "T": length, "method": method}
                for backward in (False, True):
                    x = inputs(args, length, decay, grad=backward)
                    with torch.set_grad_enabled(backward):
                        run(method, x, backward)  # warm-up
                        repeats = 1 if method == "recurrent" else args.repeats  # the loop is slow and steady
                        seconds, peak = measure(lambda m=method, x=x, b=backward: run(m, x, b), repeats)
                    key = "fwd_bwd" if backward else "fwd"
                    row[f"{key}_ms"], row[f"{key}_peak_mib"] = 1000 * seconds, peak
                rows.append(row)
                print(f"  {row['decay']:>6} T={length:>6} {method:<9} fwd {row['fwd_ms']:9.1f} ms  "
                      f"fwd+bwd {row['fwd_bwd_ms']:9.1f} ms  peak {row['fwd_bwd_peak_mib']:.0f} MiB", flush=True)
    add_speedups(rows)
    columns = {"decay": "decay", "T": "T", "method": "method", "fwd_ms": "fwd ms", "fwd_bwd_ms": "fwd+bwd ms",
               "fwd_peak_mib": "fwd peak MiB", "fwd_bwd_peak_mib": "fwd+bwd peak MiB",
               "fwd_speedup_vs_sdpa": "fwd × vs SDPA", "fwd_bwd_speedup_vs_recurrent": "fwd+bwd × vs loop"}

    def plot(plt):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key in zip(axes, ("fwd_ms", "fwd_bwd_ms"), strict=True):
            for decay in args.decays + ["-"]:
                for method in ("torch", "recurrent", "sdpa"):
                    mine = [r for r in rows if r["decay"] == decay and r["method"] == method]
                    if mine:
                        label = method if method == "sdpa" else f"{method} ({decay})"
                        ax.plot([r["T"] for r in mine], [r[key] for r in mine], "o-", label=label)
            ax.set(xscale="log", yscale="log", xlabel="T", ylabel=key.replace("_", " "))
            ax.legend(fontsize=7)
        fig.tight_layout()
        return fig

    write_report(rows, columns, args.output_dir, "ops", plot, meta={"args": asdict(args)})
    return 0


def add_speedups(rows: list[dict]) -> None:
    """Chunked forward vs SDPA forward, and chunked fwd+bwd vs the token loop, at equal T (and decay)."""
    sdpa = {r["T"]: r for r in rows if r["method"] == "sdpa"}
    loop = {(r["decay"], r["T"]): r for r in rows if r["method"] == "recurrent"}
    for r in rows:
        if r["method"] != "torch":
            continue
        if r["T"] in sdpa:
            r["fwd_speedup_vs_sdpa"] = sdpa[r["T"]]["fwd_ms"] / r["fwd_ms"]
        if (r["decay"], r["T"]) in loop:
            r["fwd_bwd_speedup_vs_recurrent"] = loop[(r["decay"], r["T"])]["fwd_bwd_ms"] / r["fwd_bwd_ms"]


if __name__ == "__main__":
    raise SystemExit(main())
