"""A softmax checkpoint converted to a linear-attention one, written as a folder (training/convert.py is its command
line): `ConversionArguments` (the source, the output and every attention option, LoLCATs defaults), their checks,
and `convert_checkpoint`, which writes the folder atomically (a temporary sibling renamed at the end, an existing
folder replaced by renames) with the source's tokenizer. With `--softmax_layers auto:K` the output is a stage-1
checkpoint of the same conversion with the K layers that matter most restored to softmax
(`restore_ranked_layers`, also `make demo`'s), ranked on held-out rows of the data pipeline.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel

from hf_linear_attn import LinearAttentionForCausalLM
from hf_linear_attn.conversion import (
    DEFAULT_ATTENTION_OPTIONS,
    convert_to_linear_attention,
    linear_attention_config,
    load_teacher,
    tokenizer_max_length,
)
from hf_linear_attn.layer_selection import (
    check_layer_selection,
    check_same_conversion,
    parse_softmax_layers,
    restore_softmax_layers,
    select_softmax_layers,
    write_ranking,
)
from training.data import DataArguments, build_datasets, check_data_arguments
from training.recipes import attention_arguments, attention_options

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RANKING_FILE = "softmax_layer_ranking.json"


@dataclass
class ConversionArguments(attention_arguments("ConversionAttentionArguments", **DEFAULT_ATTENTION_OPTIONS)):
    """The source, the output and every attention option (`AttentionOptions`, LoLCATs defaults)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Source: local folder or Hub id."})
    output_dir: str | None = field(default=None, metadata={"help": "Where the converted checkpoint is written."})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside model_name_or_path."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Replace an existing output_dir."})
    dtype: str = field(default="float32", metadata={"help": f"Weights dtype of the output, one of {list(DTYPES)}."})
    softmax_layers: list[str] = field(default_factory=list, metadata={
        "help": "Layers kept as full softmax attention: indices (`1 5 7` or `1,5,7`), or `auto:K`, the K layers "
                "whose restoration alone lowers the KL to the teacher most on held-out rows of --ranking_model."})
    ranking_model: str | None = field(default=None, metadata={
        "help": f"With --softmax_layers auto:K: a stage-1 checkpoint (training/distill.py) of this same conversion; "
                f"the output is that checkpoint with the K chosen layers restored, the ranking in {RANKING_FILE}."})
    ranking_rows: int = field(default=4, metadata={"help": "Held-out rows of --block_size tokens the ranking scores."})


def check_conversion_arguments(args: ConversionArguments) -> None:
    """Raise ValueError naming the argument for a conversion that cannot run, before anything is read."""
    for name in ("model_name_or_path", "output_dir"):
        if getattr(args, name) is None:
            raise ValueError(f"--{name} is required (on the command line or in the recipe)")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype {args.dtype!r}: choose one of {list(DTYPES)}")
    output = Path(args.output_dir).resolve()
    source = Path(args.model_name_or_path)
    if source.exists():
        source = source.resolve()
        if output == source or source in output.parents or output in source.parents:
            relation = "is" if output == source else "is inside" if source in output.parents else "contains"
            raise ValueError(f"--output_dir {args.output_dir} {relation} --model_name_or_path "
                             f"{args.model_name_or_path}: writing the conversion there would replace its source; "
                             "choose another folder.")
    if output.exists() and any(output.iterdir()) and not args.overwrite_output_dir:
        raise ValueError(f"--output_dir {output} exists and is not empty; pass --overwrite_output_dir to replace it.")


def replace_folder(new: Path, target: Path) -> None:
    """Put the folder `new` at `target` (a sibling path), replacing what is there by renames only: the old
    folder is moved aside, the new one renamed in, and only then is the old one deleted. Interrupted at any
    point, `target` is either the old folder or the new one (the old one may remain beside it as
    `.NAME.replaced-*`)."""
    if not target.exists():
        new.rename(target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.replaced-", dir=target.parent))
    aside.rmdir()
    target.rename(aside)
    try:
        new.rename(target)
    except BaseException:
        aside.rename(target)
        raise
    shutil.rmtree(aside)


@dataclass
class RestoredLayers:
    """A stage-1 checkpoint with the layers that matter most to softmax restored (`restore_ranked_layers`)."""

    model: LinearAttentionForCausalLM
    ranking: list[dict[str, Any]]  # every linear layer, by KL reduction (`select_softmax_layers`)
    rows: torch.Tensor  # [N, T]: the held-out rows that ranked the layers

    def write_ranking(self, folder: str | Path, **details: Any) -> Path:
        """`folder/RANKING_FILE`: the model's softmax layers (`selected`), `details`, the rows' count and length,
        and the ranking."""
        return write_ranking(Path(folder) / RANKING_FILE, self.ranking, selected=self.model.config.softmax_layers,
                             **details, rows=len(self.rows), row_tokens=int(self.rows.shape[1]))


def restore_ranked_layers(ranking_model: str | Path, teacher: PreTrainedModel, tokenizer: Any,
                          data_args: DataArguments, k: int, rows: int) -> RestoredLayers:
    """Load the stage-1 checkpoint `ranking_model` (refusing missing or unexpected weights), rank its layers
    against `teacher` on the first `rows` held-out rows of the data pipeline (`data_args`, tokenized by
    `tokenizer`) and restore the `k` whose restoration alone brings it closest to the teacher, in place."""
    held_out = torch.tensor(build_datasets(data_args, tokenizer)["validation"]["input_ids"][:rows])
    student = load_teacher(str(ranking_model))
    layers, ranking = select_softmax_layers(student, teacher.eval(), held_out, k)
    return RestoredLayers(restore_softmax_layers(student, layers, inplace=True), ranking, held_out)


def convert_checkpoint(args: ConversionArguments, data_args: DataArguments | None = None) -> None:
    """Check `args`, then write the converted checkpoint (see the module docstring)."""
    check_conversion_arguments(args)
    data_args = data_args or DataArguments()
    output = Path(args.output_dir)
    options = attention_options(args)
    load_kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}

    # Everything that can fail cheaply fails before the weights are read or anything is written.
    source_config = AutoConfig.from_pretrained(args.model_name_or_path, **load_kwargs)
    selection = parse_softmax_layers(args.softmax_layers, source_config.num_hidden_layers)
    check_layer_selection(selection, teacher=args.model_name_or_path, ranking_model=args.ranking_model)
    options["softmax_layers"] = list(selection.layers)
    try:
        conversion_config = linear_attention_config(source_config, **options)
    except TypeError as error:  # an option of the wrong type is bad input like any other
        raise ValueError(str(error)) from None
    if selection.auto_k is not None:
        check_data_arguments(data_args)
        if args.ranking_rows < 1:
            raise ValueError(f"--ranking_rows {args.ranking_rows}: rank on at least one held-out row.")
        try:
            ranking_config = AutoConfig.from_pretrained(args.ranking_model)
        except OSError as error:
            raise ValueError(f"--ranking_model {args.ranking_model}: {error}") from None
        check_same_conversion(ranking_config, conversion_config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, **load_kwargs)
    except (OSError, ValueError) as error:
        raise ValueError(f"--model_name_or_path {args.model_name_or_path}: no tokenizer could be loaded: "
                         f"{error}") from error
    if 2 * len(tokenizer) < source_config.vocab_size:
        # Some transformers releases build an empty placeholder tokenizer when a folder has none.
        raise ValueError(f"--model_name_or_path {args.model_name_or_path}: no tokenizer found (what loads has "
                         f"{len(tokenizer)} tokens for a model with {source_config.vocab_size} embeddings).")

    teacher = load_teacher(args.model_name_or_path, **load_kwargs)
    restored = None
    if selection.auto_k is None:
        student = convert_to_linear_attention(teacher, dtype=DTYPES[args.dtype], **options)
    else:
        restored = restore_ranked_layers(args.ranking_model, teacher, tokenizer, data_args, selection.auto_k,
                                         args.ranking_rows)
        student = restored.model.to(DTYPES[args.dtype])
        print(f"Softmax layers {student.config.softmax_layers}: chosen on {len(restored.rows)} held-out rows of "
              f"{restored.rows.shape[1]} tokens (ranking in {RANKING_FILE})")
    student.config.base_model_name_or_path = args.model_name_or_path

    output.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.model_max_length = tokenizer_max_length(tokenizer, source_config.max_position_embeddings)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if restored is not None:
            restored.write_ranking(staging, ranking_model=args.ranking_model)
        replace_folder(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    params = sum(p.numel() for p in student.parameters())
    new = sum(p.numel() for n, p in student.named_parameters() if "feature_map" in n or "window_gate" in n)
    print(f"Converted {args.model_name_or_path} ({source_config.model_type}) -> {output}: {params:,} parameters, "
          f"{new:,} new (feature maps, window gates); attention {attention_options(student.config)}")
