"""Convert a Llama / Mistral / Qwen2 / Qwen3 checkpoint into a linear-attention checkpoint.

    python training/convert.py --model_name_or_path SRC --output_dir DST [--config RECIPE.yaml] \
        [--feature_map hedgehog --feature_dim 64 --window_size 64 --num_sink_tokens 4 ...]

SRC is a local folder or a Hub id (`--gguf_file` for a GGUF checkpoint in that folder). Every
attention option (`AttentionOptions`: feature map, decay, window, ...) is a flag, with the LoLCATs
defaults of `DEFAULT_ATTENTION_OPTIONS`; a YAML recipe gives defaults that the command line
overrides. The output folder is written atomically (a temporary sibling renamed at the end), so
a failed conversion leaves nothing behind; it holds safetensors weights, the model code (loads with
`trust_remote_code=True` without this package) and the source's tokenizer.
"""

# ruff: noqa: E402 - the imports follow the sys.path set-up for running as a script
from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `training` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import AutoConfig, AutoTokenizer

from hf_linear_attn.conversion import (
    DEFAULT_ATTENTION_OPTIONS,
    convert_to_linear_attention,
    linear_attention_config,
    load_teacher,
)
from training.recipes import attention_arguments, attention_options, parse_recipe_args

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ConversionArguments(attention_arguments("ConversionAttentionArguments", **DEFAULT_ATTENTION_OPTIONS)):
    """The source, the output and every attention option (`AttentionOptions`, LoLCATs defaults)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Source: local folder or Hub id."})
    output_dir: str | None = field(default=None, metadata={"help": "Where the converted checkpoint is written."})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside model_name_or_path."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Replace an existing output_dir."})
    dtype: str = field(default="float32", metadata={"help": f"Weights dtype of the output, one of {list(DTYPES)}."})


def parse_args(argv: list[str]) -> ConversionArguments:
    """Command-line flags over an optional YAML recipe (`--config FILE`)."""
    args = parse_recipe_args(ConversionArguments, argv)
    for name in ("model_name_or_path", "output_dir"):
        if getattr(args, name) is None:
            raise SystemExit(f"error: --{name} is required (on the command line or in the recipe)")
    if args.dtype not in DTYPES:
        raise SystemExit(f"error: --dtype {args.dtype!r}: choose one of {list(DTYPES)}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    output = Path(args.output_dir)
    if output.exists() and any(output.iterdir()) and not args.overwrite_output_dir:
        raise SystemExit(f"error: {output} exists and is not empty; pass --overwrite_output_dir to replace it.")
    options = attention_options(args)
    load_kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}

    # Everything that can fail cheaply fails before the weights are read or anything is written.
    source_config = AutoConfig.from_pretrained(args.model_name_or_path, **load_kwargs)
    try:
        linear_attention_config(source_config, **options)
    except (TypeError, ValueError) as error:  # a bad option, or one that does not fit the source
        raise SystemExit(f"error: {error}") from error
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, **load_kwargs)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: no tokenizer could be loaded from {args.model_name_or_path}: {error}") from error
    if 2 * len(tokenizer) < source_config.vocab_size:
        # Some transformers releases build an empty placeholder tokenizer when a folder has none.
        raise SystemExit(f"error: no tokenizer found in {args.model_name_or_path} (what loads has {len(tokenizer)} "
                         f"tokens for a model with {source_config.vocab_size} embeddings).")

    teacher = load_teacher(args.model_name_or_path, **load_kwargs)
    student = convert_to_linear_attention(teacher, dtype=DTYPES[args.dtype], **options)
    student.config.base_model_name_or_path = args.model_name_or_path

    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if output.exists():
            shutil.rmtree(output)
        staging.rename(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    params = sum(p.numel() for p in student.parameters())
    new = sum(p.numel() for n, p in student.named_parameters() if "feature_map" in n or "window_gate" in n)
    print(f"Converted {args.model_name_or_path} ({source_config.model_type}) -> {output}: {params:,} parameters, "
          f"{new:,} new (feature maps, window gates); attention {options}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
