"""Tour: build small linear-attention models, check them against the oracle, save, reload, generate.

Runs offline on CPU in well under a minute. Configured by `configs/tour.yaml` (or `--config FILE`);
any field can be overridden on the command line, e.g. `python training/tour.py --seq_len 1024 --variants elu gla`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import hf_linear_attn
from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.training.command_line import exit_on_bad_input, offline_by_default
from hf_linear_attn.training.recipes import SHIPPED_RECIPES, parse_recipe_args

# Attention variants by name: the config fields that select them.
VARIANTS = {
    "elu": {"feature_map": "elu"},
    "retnet": {"feature_map": "identity", "normalize": False, "decay": "fixed", "output_norm": True},
    "mamba2": {"feature_map": "identity", "normalize": False, "decay": "scalar", "output_norm": True},
    "gla": {"feature_map": "identity", "normalize": False, "decay": "vector", "output_norm": True},
    "lolcats": {"feature_map": "hedgehog", "window_size": 64, "num_sink_tokens": 4},
    "hybrid": {"feature_map": "elu", "softmax_layers": [0]},
    "heads": {"feature_map": "hedgehog", "window_size": 64, "num_sink_tokens": 4, "softmax_heads": {1: [0]}},
}
DEFAULT_CONFIG = SHIPPED_RECIPES / "tour.yaml"


@dataclass
class TourArguments:
    hidden_size: int = field(default=128, metadata={"help": "Model width."})
    num_hidden_layers: int = field(default=2, metadata={"help": "Decoder layers."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads."})
    seq_len: int = field(default=300, metadata={"help": "Tokens in the random prompt."})
    max_new_tokens: int = field(default=8, metadata={"help": "Tokens generated greedily."})
    output_dir: str = field(default="outputs/tour", metadata={"help": "Where checkpoints are saved."})
    variants: list[str] = field(default_factory=lambda: list(VARIANTS), metadata={"help": f"Of {list(VARIANTS)}."})


def parse_args(argv: list[str] | None = None) -> TourArguments:
    """The tour's settings: configs/tour.yaml (or `--config FILE`) under the command-line flags."""
    args = parse_recipe_args(TourArguments, argv, default_recipe=DEFAULT_CONFIG)
    with exit_on_bad_input():
        unknown = [v for v in args.variants if v not in VARIANTS]
        if unknown:
            raise InputError(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    return args


def run_variant(name: str, args: TourArguments) -> dict:
    torch.manual_seed(0)
    config = hf_linear_attn.LinearAttentionConfig(
        vocab_size=1024, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=max(1, args.num_attention_heads // 2), **VARIANTS[name],
    )
    model = hf_linear_attn.LinearAttentionForCausalLM(config).eval()
    ids = torch.randint(3, config.vocab_size, (1, args.seq_len))
    with torch.no_grad():
        start = time.perf_counter()
        fast = model(ids).logits
        fast_s = time.perf_counter() - start
        model.config.linear_attention_backend = "recurrent"
        start = time.perf_counter()
        slow = model(ids).logits
        slow_s = time.perf_counter() - start
        model.config.linear_attention_backend = "auto"
    out_dir = Path(args.output_dir) / name
    model.save_pretrained(out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    with torch.no_grad():
        identical = torch.equal(reloaded(ids).logits, fast)
    generated = reloaded.generate(ids[:, :32], max_new_tokens=args.max_new_tokens, do_sample=False,
                                  use_cache=False, eos_token_id=None)
    return {
        "variant": name,
        "params": sum(p.numel() for p in model.parameters()),
        "max|chunked-oracle|": (fast - slow).abs().max().item(),
        "chunked ms": 1000 * fast_s,
        "oracle ms": 1000 * slow_s,
        "reload identical": identical,
        "generated": generated[0, 32:].tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    offline_by_default()
    args = parse_args(argv)
    hf_logging.disable_progress_bar()
    print(f"hf-linear-attn {hf_linear_attn.__version__} tour: {len(args.variants)} variants, "
          f"prompt of {args.seq_len} tokens, checkpoints in {args.output_dir}/")
    rows = [run_variant(name, args) for name in args.variants]
    header = f"{'variant':<9} {'params':>8} {'max|chunked-oracle|':>20} {'chunked ms':>11} {'oracle ms':>10} " \
             f"{'reload==':>8}  greedy continuation"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['variant']:<9} {r['params']:>8} {r['max|chunked-oracle|']:>20.2e} {r['chunked ms']:>11.1f} "
              f"{r['oracle ms']:>10.1f} {str(r['reload identical']):>8}  {r['generated']}")
    failed = [r["variant"] for r in rows if r["max|chunked-oracle|"] > 1e-3 or not r["reload identical"]]
    if failed:
        print(f"FAILED: {failed}")
        return 1
    print("All variants agree with the oracle and reload bit-identically.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
