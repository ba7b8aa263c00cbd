"""A softmax checkpoint converted to a linear-attention one, written as a folder (training/convert.py is its command
line): `ConversionArguments` (the source, the output and every attention option, LoLCATs defaults), their checks,
and `convert_checkpoint`, which writes the folder atomically (a temporary sibling renamed at the end, an existing
folder replaced by renames) with the source's tokenizer. With `--softmax_layers auto:K` the output is a stage-1
checkpoint of the same conversion with the K layers that matter most restored to softmax
(`restore_ranked_layers`, also `make demo`'s), ranked on held-out rows of the data pipeline. With `--softmax_heads
auto:N` the N KV heads the teacher retrieves with most keep exact softmax attention (`rank_retrieval_heads`, ranked
on passkey prompts built from the data pipeline's documents); on a `--ranking_model` they are restored training-free.
With `--head_ranking restoration` the heads are those whose restoration alone raises the `--ranking_model`'s own
log-probability of the key most (`rank_restoration_heads`, also `make demo`'s after stage 1), restored on it.
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
from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.conversion import (
    DEFAULT_ATTENTION_OPTIONS,
    convert_to_linear_attention,
    linear_attention_config,
    load_teacher,
    tokenizer_max_length,
)
from hf_linear_attn.head_selection import RetrievalPrompt, parse_softmax_heads, retrieval_scores, top_heads
from hf_linear_attn.layer_selection import (
    check_layer_selection,
    check_same_conversion,
    estimated_restoration_gains,
    parse_softmax_layers,
    recurrent_kv_heads,
    restoration_gains,
    restore_softmax_heads,
    restore_softmax_layers,
    select_softmax_layers,
    write_ranking,
)
from hf_linear_attn.training.command_line import renamed
from hf_linear_attn.training.data import DataArguments, build_datasets, check_data_arguments
from hf_linear_attn.training.long_context_data import RANKING_VARIANT, LongDocument, passkey_trials
from hf_linear_attn.training.recipes import attention_arguments, attention_options

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RANKING_FILE = "softmax_layer_ranking.json"
# What ranks the heads of `--softmax_heads auto:N` and of evaluation head variants (`head_ranking` of both).
HEAD_RANKINGS = ("teacher", "restoration")
HEAD_RANKING_FILE = "softmax_head_ranking.json"
HEAD_MEASURE = ("attention mass that the queries predicting a pass key put on the key where the prompt states it, "
                "per KV head (mean over its query group, the key's tokens and the prompts), on the teacher")
RESTORATION_MEASURE = ("gain in the model's own mean log-probability of a pass key's tokens when the KV head alone is "
                       "restored to exact softmax attention (mean over the prompts; only the heads that the "
                       "first-order estimate ranks best are measured)")
ESTIMATED_RESTORATION_MEASURE = ("first-order estimate of the gain in the model's own mean log-probability of a "
                                 "pass key's tokens when the KV head alone is restored to exact softmax attention "
                                 "(mean over the prompts)")


@renamed(ranking_prompts="head_ranking_prompts", ranking_shortlist="head_ranking_shortlist")
@dataclass
class ConversionArguments(attention_arguments("ConversionAttentionArguments", **DEFAULT_ATTENTION_OPTIONS)):
    """The source, the output and every attention option (`AttentionOptions`, LoLCATs defaults)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Source: local folder or Hub id."})
    output_dir: str | None = field(default=None, metadata={"help": "Where the converted checkpoint is written."})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside model_name_or_path."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Replace an existing output_dir."})
    dtype: str = field(default="float32", metadata={"help": f"Weights dtype of the output, one of {list(DTYPES)}."})
    rope_position_cap: int | None = field(default=None, metadata={
        "help": "Where the slow RoPE rotations stop (LinearAttentionConfig.rope_position_cap), from 2 to the source's "
                "max_position_embeddings (unset: that); docs/results/long-context.md measures lower caps."})
    softmax_layers: list[str] = field(default_factory=list, metadata={
        "help": "Layers kept as full softmax attention: indices (`1 5 7` or `1,5,7`), or `auto:K`, the K layers "
                "whose restoration alone lowers the KL to the teacher most on held-out rows of --ranking_model."})
    ranking_model: str | None = field(default=None, metadata={
        "help": f"With --softmax_layers auto:K: a stage-1 checkpoint (training/distill.py) of this same conversion; "
                f"the output is that checkpoint with the K chosen layers restored, the ranking in {RANKING_FILE}."})
    ranking_rows: int = field(default=4, metadata={"help": "Held-out rows of --block_size tokens the ranking scores."})
    softmax_heads: list[str] = field(default_factory=list, metadata={
        "help": "KV heads that keep exact softmax attention over the whole context, with their query groups: "
                "LAYER:HEAD[,HEAD...] items (`17:0,2 20:1`), or `auto:N`, the N KV heads outside the softmax layers "
                "that the teacher retrieves with most (passkey prompts, hf_linear_attn.head_selection); the ranking "
                f"in {HEAD_RANKING_FILE}. With --ranking_model they are restored on it, training-free."})
    head_ranking_prompts: int = field(default=8, metadata={
        "help": "With --softmax_heads auto:N: passkey prompts of --block_size tokens (haystack: the data pipeline's "
                "documents) the head ranking measures."})
    head_ranking: str = field(default="teacher", metadata={
        "help": "With --softmax_heads auto:N, what ranks the heads: teacher (how much the teacher's attention "
                "retrieves with each head, at conversion) or restoration (the gain in --ranking_model's own "
                "log-probability of the key with each head alone restored; the output is --ranking_model with the N "
                "best restored, training-free)."})
    head_ranking_shortlist: int | None = field(default=None, metadata={
        "help": "With --head_ranking restoration: the heads measured exactly, the best of a first-order estimate "
                "(default 3 × N, at most every recurrent head; 0: the estimate alone ranks, one forward and "
                "backward per prompt)."})


def check_conversion_arguments(args: ConversionArguments) -> None:
    """Raise ValueError naming the argument for a conversion that cannot run, before anything is read."""
    for name in ("model_name_or_path", "output_dir"):
        if getattr(args, name) is None:
            raise InputError(f"--{name} is required (on the command line or in the recipe)")
    if args.dtype not in DTYPES:
        raise InputError(f"--dtype {args.dtype!r}: choose one of {list(DTYPES)}")
    if args.head_ranking not in HEAD_RANKINGS:
        raise InputError(f"--head_ranking {args.head_ranking!r}: choose one of {list(HEAD_RANKINGS)}")
    output = Path(args.output_dir).resolve()
    source = Path(args.model_name_or_path)
    if source.exists():
        source = source.resolve()
        if output == source or source in output.parents or output in source.parents:
            relation = "is" if output == source else "is inside" if source in output.parents else "contains"
            raise InputError(f"--output_dir {args.output_dir} {relation} --model_name_or_path "
                             f"{args.model_name_or_path}: writing the conversion there would replace its source; "
                             "choose another folder.")
    if output.exists() and any(output.iterdir()) and not args.overwrite_output_dir:
        raise InputError(f"--output_dir {output} exists and is not empty; pass --overwrite_output_dir to replace it.")


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


@dataclass
class RankedHeads:
    """The KV heads of a teacher ranked by retrieval (`rank_retrieval_heads`) and the `heads` chosen."""

    heads: dict[int, list[int]]  # {layer: [kv_head, ...]}, for softmax_heads
    scores: torch.Tensor  # [L, H_kv]: `retrieval_scores`, or `restoration_gains` (−inf: not measured)
    prompts: int
    prompt_tokens: int  # tokens of each prompt before its answer
    measure: str = HEAD_MEASURE

    def write_ranking(self, folder: str | Path, **details: Any) -> Path:
        """`folder/HEAD_RANKING_FILE`: the chosen heads, `details`, the prompts' count and length, and every KV head
        measured, by score."""
        layers, kv_heads = self.scores.shape
        ranking = sorted(({"layer": layer, "kv_head": head, "score": round(float(self.scores[layer, head]), 6)}
                          for layer in range(layers) for head in range(kv_heads)
                          if self.scores[layer, head] != float("-inf")),
                         key=lambda entry: (-entry["score"], entry["layer"], entry["kv_head"]))
        return write_ranking(Path(folder) / HEAD_RANKING_FILE, ranking, measure=self.measure,
                             selected={str(layer): heads for layer, heads in self.heads.items()}, **details,
                             prompts=self.prompts, prompt_tokens=self.prompt_tokens)


def head_ranking_prompts(tokenizer: Any, data_args: DataArguments, prompts: int) -> list[RetrievalPrompt]:
    """`prompts` teacher-forced passkey prompts of `data_args.block_size` tokens for `retrieval_scores`, whose
    haystacks are windows of the data pipeline's documents (held-out rows first, then training rows). They are worded
    as no evaluated passkey variant is (`RANKING_VARIANT`: a code stated once, asked for in plain text and, when the
    tokenizer has one, in its chat template), so that retrieval is judged on phrasings the heads were not chosen on."""
    length = data_args.block_size
    rows = build_datasets(data_args, tokenizer)
    tokens = [token for split in ("validation", "train") if split in rows
              for row in rows[split]["input_ids"] for token in row][: (prompts + 1) * length]
    if len(tokens) < 2 * length:
        raise InputError(f"the data pipeline holds {len(tokens)} tokens, too few for passkey prompts of "
                         f"{length} tokens that rank heads; give more documents or a shorter length")
    trials = passkey_trials(tokenizer, [LongDocument("data", 0, torch.tensor(tokens))], length, prompts, "natural",
                            RANKING_VARIANT)
    return [trial.retrieval_prompt() for trial in trials]


def rank_retrieval_heads(teacher: PreTrainedModel, prompts: list[RetrievalPrompt], n: int,
                         exclude_layers: list[int]) -> RankedHeads:
    """Rank the KV heads of `teacher` by `retrieval_scores` on `prompts` (`head_ranking_prompts`) and choose the `n`
    best outside `exclude_layers` (`top_heads`)."""
    scores = retrieval_scores(teacher, prompts)
    return RankedHeads(top_heads(scores, n, exclude_layers), scores, len(prompts), prompts[0].answer[0])


def check_shortlist(name: str, shortlist: int | None, n: int) -> None:
    """ValueError unless the `shortlist` given as `name` (None: the default) measures at least the `n` heads asked
    for or is 0 (the first-order estimate alone ranks): the argument check of `restoration_scores`' shortlist."""
    if shortlist is not None and not (shortlist == 0 or n <= shortlist):
        raise InputError(f"{name} {shortlist}: measure at least the {n} heads asked for, or give 0 (the first-order "
                         "estimate alone ranks).")


def restoration_scores(model: LinearAttentionForCausalLM, prompts: list[RetrievalPrompt], n: int,
                       shortlist: int | None = None) -> tuple[torch.Tensor, str]:
    """The [L, H_kv] scores that choose the `n` recurrent KV heads of a trained (or converted) `model` to restore,
    and what they measure: its own `restoration_gains` on `prompts` (`head_ranking_prompts`), measured exactly on the
    `shortlist` heads that the first-order estimate ranks best (None: 3 × n, at most every recurrent head; 0: the
    estimate alone ranks, `estimated_restoration_gains`); −inf where not measured. Checked before any forward:
    1 ≤ n ≤ the model's recurrent KV heads, and n ≤ shortlist ≤ that number unless shortlist is 0."""
    available = len(recurrent_kv_heads(model))
    shortlist = min(3 * n, available) if shortlist is None else shortlist
    if not (1 <= n <= available and (shortlist == 0 or n <= shortlist <= available)):
        raise InputError(f"{n} restored heads from a shortlist of {shortlist}: need 1 ≤ heads ≤ {available} (the "
                         "model's recurrent KV heads) and a shortlist of 0 (the first-order estimate alone) or "
                         f"between the heads and {available}")
    if shortlist == 0:
        return estimated_restoration_gains(model, prompts), ESTIMATED_RESTORATION_MEASURE
    return restoration_gains(model, prompts, shortlist=shortlist), RESTORATION_MEASURE


def rank_restoration_heads(model: LinearAttentionForCausalLM, prompts: list[RetrievalPrompt], n: int,
                           shortlist: int | None = None) -> RankedHeads:
    """Rank the recurrent KV heads of `model` by `restoration_scores` (`shortlist` as there) and choose the `n`
    best."""
    scores, measure = restoration_scores(model, prompts, n, shortlist)
    unmeasured: dict[int, list[int]] = {}  # exact already, or outside the shortlist
    for layer, head in (scores == float("-inf")).nonzero().tolist():
        unmeasured.setdefault(layer, []).append(head)
    return RankedHeads(top_heads(scores, n, taken=unmeasured), scores, len(prompts), prompts[0].answer[0], measure)


def check_head_count(n: int, num_layers: int, kv_heads: int, softmax_layers: int) -> None:
    """`--softmax_heads auto:N` asks for at most the KV heads outside the softmax layers."""
    available = (num_layers - softmax_layers) * kv_heads
    if not 1 <= n <= available:
        raise InputError(f"--softmax_heads auto:{n}: N must be in [1, {available}], the KV heads of the "
                         f"{num_layers - softmax_layers} layers that are not softmax layers ({kv_heads} each)")


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
    head_spec = parse_softmax_heads(args.softmax_heads or None)
    by_restoration = args.head_ranking == "restoration"
    if by_restoration and (head_spec.auto_n is None or args.ranking_model is None):
        raise InputError("--head_ranking restoration ranks heads on a trained checkpoint: give --softmax_heads auto:N "
                         "and --ranking_model (a stage-1 or stage-2 checkpoint of this conversion)")
    check_layer_selection(selection, teacher=args.model_name_or_path,
                          ranking_model=args.ranking_model if selection.auto_k is not None or not by_restoration
                          else None)
    options["softmax_layers"] = list(selection.layers)
    conversion_config = linear_attention_config(source_config, softmax_heads=head_spec.heads,
                                                rope_position_cap=args.rope_position_cap, **options)
    if head_spec.auto_n is not None:
        check_head_count(head_spec.auto_n, conversion_config.num_hidden_layers, conversion_config.num_key_value_heads,
                         len(selection.layers) + (selection.auto_k or 0))
        check_data_arguments(data_args)
        if args.head_ranking_prompts < 1:
            raise InputError(f"--head_ranking_prompts {args.head_ranking_prompts}: rank on at least one prompt.")
        if by_restoration:
            check_shortlist("--head_ranking_shortlist", args.head_ranking_shortlist, head_spec.auto_n)
    if selection.auto_k is not None or by_restoration:
        check_data_arguments(data_args)
        if args.ranking_rows < 1:
            raise InputError(f"--ranking_rows {args.ranking_rows}: rank on at least one held-out row.")
        try:
            ranking_config = AutoConfig.from_pretrained(args.ranking_model)
        except OSError as error:
            raise InputError(f"--ranking_model {args.ranking_model}: {error}") from None
        check_same_conversion(ranking_config, conversion_config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, **load_kwargs)
    except (OSError, ValueError) as error:
        raise InputError(f"--model_name_or_path {args.model_name_or_path}: no tokenizer could be loaded: "
                         f"{error}") from error
    if 2 * len(tokenizer) < source_config.vocab_size:
        # Some transformers releases build an empty placeholder tokenizer when a folder has none.
        raise InputError(f"--model_name_or_path {args.model_name_or_path}: no tokenizer found (what loads has "
                         f"{len(tokenizer)} tokens for a model with {source_config.vocab_size} embeddings).")

    teacher = load_teacher(args.model_name_or_path, **load_kwargs)
    restored = ranked_heads = trained = None
    if selection.auto_k is not None:
        restored = restore_ranked_layers(args.ranking_model, teacher, tokenizer, data_args, selection.auto_k,
                                         args.ranking_rows)
        trained = restored.model
        print(f"Softmax layers {restored.model.config.softmax_layers}: chosen on {len(restored.rows)} held-out rows "
              f"of {restored.rows.shape[1]} tokens (ranking in {RANKING_FILE})")
    elif by_restoration:
        trained = load_teacher(args.ranking_model)
    heads = head_spec.heads
    if head_spec.auto_n is not None:
        prompts = head_ranking_prompts(tokenizer, data_args, args.head_ranking_prompts)
        if by_restoration:
            ranked_heads = rank_restoration_heads(trained, prompts, head_spec.auto_n, args.head_ranking_shortlist)
            source = "the KV heads whose restoration alone raises --ranking_model's log-probability of the key most"
        else:
            layers = list(selection.layers) if restored is None else restored.model.config.softmax_layers
            ranked_heads = rank_retrieval_heads(teacher, prompts, head_spec.auto_n, layers)
            source = "the teacher's best retrieving KV heads"
        heads = ranked_heads.heads
        print(f"Softmax heads {heads}: {source} on {args.head_ranking_prompts} passkey prompts of "
              f"{data_args.block_size} tokens (ranking in {HEAD_RANKING_FILE})")
    if trained is None:
        student = convert_to_linear_attention(teacher, dtype=DTYPES[args.dtype], softmax_heads=heads,
                                              rope_position_cap=args.rope_position_cap, **options)
    else:
        student = restore_softmax_heads(trained, heads, inplace=True).to(DTYPES[args.dtype])
    student.config.base_model_name_or_path = args.model_name_or_path

    output.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.model_max_length = tokenizer_max_length(tokenizer, source_config.max_position_embeddings)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if restored is not None:
            restored.write_ranking(staging, ranking_model=args.ranking_model)
        if ranked_heads is not None:
            ranked_heads.write_ranking(staging, teacher=args.model_name_or_path,
                                       **({"ranking_model": args.ranking_model} if by_restoration else {}))
        replace_folder(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    params = sum(p.numel() for p in student.parameters())
    new = sum(p.numel() for n, p in student.named_parameters() if "feature_map" in n or "window_gate" in n)
    print(f"Converted {args.model_name_or_path} ({source_config.model_type}) -> {output}: {params:,} parameters, "
          f"{new:,} new (feature maps, window gates); attention {attention_options(student.config)}")
