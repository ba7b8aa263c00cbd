"""Decode scaling: per-token latency and cache bytes after growing contexts, linear attention vs Llama.

Both models have identical dimensions (default: 4 layers, hidden 256, 4 heads, SwiGLU 688, vocab
32000) and run in the same process, one after the other, so their ratios are measured side by
side. For every context length the context is prefilled in chunks (so prefill memory stays
bounded), then `--new_tokens` tokens are decoded one at a time with the cache and the median
time per token is reported. Peak RSS added by the prefill is measured in a child process per model
and length (`--peak_memory`, Linux /proc).

    python benchmarks/bench_decode.py                                # 256, 1K, 8K
    python benchmarks/bench_decode.py --contexts 256 1024 8192 65536 --peak_memory
    python benchmarks/bench_decode.py --layout smollm2 --contexts 1024 16384   # converted SmolLM2-135M shape

Prints a table, writes JSON (and a PNG when matplotlib is installed) to --output_dir.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from common import reset_peak_rss, rss_kib
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM

import hf_linear_attn
from training.measure import cache_bytes, decode_times, new_cache, prefill
from training.report import log_log_plot, machine, write_report


@dataclass
class DecodeBenchmarkArguments:
    contexts: list[int] = field(default_factory=lambda: [256, 1024, 8192], metadata={"help": "Context lengths."})
    new_tokens: int = field(default=48, metadata={"help": "Decode steps timed after each context."})
    warmup_tokens: int = field(default=4, metadata={"help": "Decode steps run before timing."})
    prefill_chunk: int = field(default=2048, metadata={"help": "Tokens per prefill forward."})
    layout: str = field(default="", metadata={
        "help": "'smollm2': the converted SmolLM2-135M shape (30 layers, hidden 576, 9 / 3 heads, hedgehog F = 32, "
                "window 64 + 4 sinks), overriding the size and attention fields below."})
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 0  # 0: as many as query heads
    intermediate_size: int = 688
    vocab_size: int = 32000
    feature_map: str = field(default="elu", metadata={"help": "Feature map of the linear model."})
    feature_dim: int = 0  # 0: the head dimension
    window_size: int = field(default=0, metadata={"help": "Sliding window of the hybrid (0: pure linear)."})
    num_sink_tokens: int = 0
    models: list[str] = field(default_factory=lambda: ["linear", "llama"], metadata={"help": "linear and/or llama."})
    peak_memory: bool = field(default=False, metadata={"help": "Also measure prefill peak RSS (child processes)."})
    output_dir: str = "outputs/bench_decode"
    child: str = field(default="", metadata={"help": "Internal: 'MODEL:LENGTH' runs one prefill and prints JSON."})


# The converted SmolLM2-135M (`make demo`'s model) with random weights: what a chat on the CPU decodes with.
LAYOUTS = {
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, feature_map="hedgehog", feature_dim=32, window_size=64,
                    num_sink_tokens=4),
}


def apply_layout(args: DecodeBenchmarkArguments) -> None:
    if args.layout and args.layout not in LAYOUTS:
        raise ValueError(f"--layout must be one of {sorted(LAYOUTS)} or empty; got {args.layout!r}")
    for name, value in LAYOUTS.get(args.layout, {}).items():
        setattr(args, name, value)


def build(kind: str, args: DecodeBenchmarkArguments) -> torch.nn.Module:
    torch.manual_seed(0)
    dims = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
                num_key_value_heads=args.num_key_value_heads or args.num_attention_heads,
                max_position_embeddings=max(args.contexts) + args.new_tokens + args.warmup_tokens + 16)
    if kind == "linear":
        config = hf_linear_attn.LinearAttentionConfig(
            **dims, feature_map=args.feature_map, feature_dim=args.feature_dim or None,
            window_size=args.window_size, num_sink_tokens=args.num_sink_tokens)
        return hf_linear_attn.LinearAttentionForCausalLM(config).eval()
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**dims, attn_implementation="sdpa")).eval()
    raise ValueError(f"unknown model {kind!r}; choose linear or llama")


def peak_prefill_rss(kind: str, length: int, args: DecodeBenchmarkArguments) -> float:
    """MiB of peak RSS added by prefilling `length` tokens, measured in a fresh child process."""
    cmd = [sys.executable, __file__, "--child", f"{kind}:{length}"]
    for name, value in asdict(args).items():
        if name in ("child", "peak_memory", "contexts", "models"):
            continue
        cmd += [f"--{name}", str(value)]
    cmd += ["--contexts", str(length)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def run_child(args: DecodeBenchmarkArguments) -> None:
    kind, length = args.child.split(":")
    model = build(kind, args)
    baseline = reset_peak_rss()
    prefill(model, new_cache(model), int(length), args.prefill_chunk)
    print(json.dumps({"peak_mib": (rss_kib("VmHWM") - baseline) / 1024}))


def main(argv: list[str]) -> int:
    (args,) = HfArgumentParser(DecodeBenchmarkArguments).parse_args_into_dataclasses(argv)
    apply_layout(args)
    if args.child:
        run_child(args)
        return 0
    print(f"{machine()}; {args.num_hidden_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads")
    rows = []
    for kind in args.models:
        model = build(kind, args)
        for length in args.contexts:
            cache = new_cache(model)
            start = time.perf_counter()
            logits = prefill(model, cache, length, args.prefill_chunk)
            prefill_s = time.perf_counter() - start
            decode_times(model, cache, logits, args.warmup_tokens)
            before = cache_bytes(cache)
            times = decode_times(model, cache, logits, args.new_tokens)
            row = {"model": kind, "context": length, "prefill_s": prefill_s,
                   "ms_per_token": 1000 * statistics.median(times), "cache_bytes": before}
            if args.peak_memory:
                row["prefill_peak_mib"] = peak_prefill_rss(kind, length, args)
            rows.append(row)
            print(f"  {kind:<6} context {length:>6}: {row['ms_per_token']:.2f} ms/token, "
                  f"cache {before / 2**20:.2f} MiB, prefill {prefill_s:.1f} s", flush=True)
    report(rows, args)
    return 0


def report(rows: list[dict], args: DecodeBenchmarkArguments) -> None:
    first = {r["model"]: r["ms_per_token"] for r in rows if r["context"] == args.contexts[0]}
    for r in rows:
        r["latency_ratio"] = r["ms_per_token"] / first[r["model"]]
        r["cache_mib"] = r["cache_bytes"] / 2**20
    columns = {"model": "model", "context": "context", "ms_per_token": "ms/token",
               "latency_ratio": f"÷ at {args.contexts[0]}", "cache_mib": "cache MiB", "cache_bytes": "cache bytes",
               "prefill_s": "prefill s"}
    if args.peak_memory:
        columns["prefill_peak_mib"] = "prefill peak MiB"

    plot = log_log_plot(rows, "context", "context tokens",
                        [("ms_per_token", "ms per decoded token"), ("cache_mib", "cache MiB")])
    write_report(rows, columns, args.output_dir, "decode", plot, meta={"args": asdict(args)})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
