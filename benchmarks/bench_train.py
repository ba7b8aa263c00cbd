"""Training-step throughput (tokens/s) on CPU: a small LinearAttentionForCausalLM vs a Llama of the same size.

Each step is forward + backward + AdamW on a batch of `--batch` × `--seq_len` random tokens; the median
of `--steps` timed steps (after one warm-up step) gives tokens/s. Both models run in the same process.

    python -m benchmarks.bench_train                          # seq_len 512, 2048
    python -m benchmarks.bench_train --seq_lens 4096 --feature_maps elu hedgehog
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM

import hf_linear_attn
from benchmarks.common import measure, return_freed_memory_to_the_os
from hf_linear_attn.training.command_line import parse_dataclasses
from hf_linear_attn.training.report import log_log_plot, machine, write_report


@dataclass
class TrainBenchmarkArguments:
    seq_lens: list[int] = field(default_factory=lambda: [512, 2048])
    batch: int = 1
    steps: int = 3
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 688
    vocab_size: int = 8192
    feature_maps: list[str] = field(default_factory=lambda: ["elu"], metadata={"help": "Linear variants to run."})
    window_size: int = field(default=0, metadata={"help": "Window of the linear models (0 = pure linear)."})
    output_dir: str = "outputs/bench_train"


def build(name: str, args: TrainBenchmarkArguments, max_len: int) -> torch.nn.Module:
    torch.manual_seed(0)
    dims = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
                max_position_embeddings=max_len)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**dims, attn_implementation="sdpa")).train()
    config = hf_linear_attn.LinearAttentionConfig(**dims, feature_map=name, window_size=args.window_size)
    return hf_linear_attn.LinearAttentionForCausalLM(config).train()


def main(argv: list[str] | None = None) -> int:
    (args,) = parse_dataclasses(HfArgumentParser(TrainBenchmarkArguments), argv)
    return_freed_memory_to_the_os()
    print(f"{machine()}; {args.num_hidden_layers} layers, hidden {args.hidden_size}, batch {args.batch}")
    rows = []
    for name in [*args.feature_maps, "llama"]:
        model = build(name, args, max(args.seq_lens))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for seq_len in args.seq_lens:
            ids = torch.randint(0, args.vocab_size, (args.batch, seq_len), generator=torch.Generator().manual_seed(0))

            def step(model=model, optimizer=optimizer, ids=ids):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            step()  # warm-up
            seconds, peak = measure(step, args.steps)
            row = {"model": name, "seq_len": seq_len, "step_s": seconds,
                   "tokens_per_s": args.batch * seq_len / seconds, "peak_mib": peak}
            rows.append(row)
            print(f"  {name:<9} seq_len {seq_len:>6}: {row['tokens_per_s']:8.0f} tokens/s", flush=True)
    llama = {r["seq_len"]: r["tokens_per_s"] for r in rows if r["model"] == "llama"}
    for r in rows:
        r["vs_llama"] = r["tokens_per_s"] / llama[r["seq_len"]]
    columns = {"model": "model", "seq_len": "seq len", "tokens_per_s": "tokens/s", "vs_llama": "× Llama",
               "step_s": "s/step", "peak_mib": "peak MiB"}

    plot = log_log_plot(rows, "seq_len", "sequence length", [("tokens_per_s", "training tokens/s")])
    write_report(rows, columns, args.output_dir, "train", plot, meta={"args": asdict(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
