"""Evaluate linear-attention models against their softmax teacher (library of `training/evaluate.py`).

`evaluate_models(args, data_args)` measures, for the teacher, the training-free baseline "teacher restricted to
a sliding window of `baseline_window` tokens + `baseline_sinks` sinks" (`long_context_metrics.WindowBaseline`, labelled
`SWA(64)+4 sinks`), and every `label=path` model of `args.models`:
- short held-out perplexity on the validation rows of the data pipeline (`training.data`; documents kept
  apart, the same rows for every model);
- long-context held-out perplexity at each of `long_contexts` tokens (at least `long_scored_tokens` tokens and
  `long_min_rows` rows each), on long public-domain documents that no
  training stage reads (`training.long_context`; prepared once into `long_context_data` by
  `hf-linear-attn-long-context prepare`), and the bytes of the decoding cache after each of those contexts
  (softmax layers counted; computed from the attention layout, `training.measure.cache_bytes_by_context`);
- with `position_bins`, held-out perplexity by position along one row of each of `position_rows` long documents
  (`long_context_metrics.perplexity_by_position`): where along a context a model falls behind the teacher;
- passkey retrieval at each of `passkey_lengths` tokens: `passkey_trials` trials with the needle's depth spread
  over the context, for each haystack (natural text, repeated filler) and variant (`chat`: one key asked for in
  the tokenizer's chat template, which the instruct teacher passes; `single`: one key in plain text; `multi`:
  several keyed doors, one asked for), each trial scored by one teacher-forced forward over the prompt and the
  key (`long_context_metrics.passkey_scores`): greedy accuracy (the key is what greedy decoding emits), the
  key's mean log-probability with its standard error over trials, and the share of its tokens that are the
  argmax; for the models of `passkey_models` (default all), as it is the expensive part;
- decode memory and latency: cache bytes and ms per token after `decode_contexts` tokens of context
  (`training.measure.decode_profile`: a context longer than `decode_prefilled` tokens is a real prefill of about
  that many, extended to its length by shape; the contexts' steps are timed in turns), for the models of
  `decode_models` (default all).
With `sparse_cache_sizes`, the models of `memory_models` (default all; window hybrids) are measured again with a
sparse exact memory of each size switched on (`sparse_cache_size`, training-free), labelled "LABEL + memory M"; with
`softmax_head_counts`, again with N more KV heads restored to softmax (`restore_softmax_heads`, training-free),
"LABEL + N heads": by default the N the teacher retrieves with most (`hf_linear_attn.head_selection.retrieval_scores`
on passkey prompts over the data pipeline's documents); with `head_ranking restoration`, the N whose restoration alone
raises the model's own log-probability of the key most on those prompts (`layer_selection.restoration_gains`,
measured once per model, without the memory, on the `head_ranking_shortlist` heads a first-order estimate ranks best:
`training.checkpoint_conversion.restoration_scores`), and with both, "LABEL + N heads + memory M". The
frontier table and plot (`frontier.{md,json,png}`) put every model's quality at the longest context beside its cache
bytes there, as a share of the teacher's.
It returns the rows (`Evaluation`); `write_evaluation` writes them as tables (Markdown, JSON, plots of
perplexity and cache bytes against context) and, with `update_model_cards`, into every linear-attention
checkpoint evaluated (`evaluation.json`) with a model card (`README.md`) that shows them.

Every argument is checked, and the long texts and the passkey prompts built, before any model is loaded; the
models are then loaded and measured one at a time. The costs grow with `long_scored_tokens` and `long_min_rows`
(tokens and rows scored per context), the passkey grid (lengths × haystacks × variants × trials × models; one
forward of the prompt's length per trial) and the longest context.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import hf_linear_attn
from hf_linear_attn.configuration_linear_attention import InputError, InputNotFoundError
from hf_linear_attn.conversion import load_teacher
from hf_linear_attn.head_selection import retrieval_scores, top_heads
from hf_linear_attn.layer_selection import recurrent_kv_heads, restore_softmax_heads
from hf_linear_attn.training.checkpoint_conversion import (
    HEAD_RANKINGS,
    check_shortlist,
    head_ranking_prompts,
    restoration_scores,
)
from hf_linear_attn.training.command_line import renamed
from hf_linear_attn.training.data import DataArguments, build_datasets, collate_rows
from hf_linear_attn.training.long_context_data import (
    DEFAULT_DATA_DIR,
    DOORS,
    HAYSTACKS,
    PREPARE_COMMAND,
    SOURCES,
    VARIANTS,
    load_texts,
    long_documents,
    passkey_trials,
)
from hf_linear_attn.training.long_context_metrics import (
    WindowBaseline,
    cache_bytes_at,
    check_position_bins,
    document_mask,
    passkey_scores,
    perplexity_by_context,
    perplexity_by_position,
    perplexity_spans,
)
from hf_linear_attn.training.losses import causal_lm_loss, predicted_tokens, token_cross_entropy, weighted_mean
from hf_linear_attn.training.measure import cache_bytes_by_context, cache_memory, decode_profile
from hf_linear_attn.training.model_card import EVALUATION_FILE, long_context_tables, write_model_card
from hf_linear_attn.training.report import format_cell, log_log_plot, machine, write_report


@renamed(teacher="teacher_name_or_path", gguf_file="teacher_gguf_file")
@dataclass
class EvaluateArguments:
    teacher_name_or_path: str | None = field(default=None, metadata={
        "help": "The softmax source checkpoint (folder or Hub id)."})
    teacher_gguf_file: str | None = field(default=None, metadata={
        "help": "GGUF file of the teacher, inside its folder."})
    models: list[str] = field(default_factory=list, metadata={"help": "label=path of each model to evaluate."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Default: the teacher's, else model 1's."})
    max_eval_rows: int = field(default=16, metadata={"help": "Validation rows (of block_size tokens) scored."})
    eval_batch_size: int = 4
    baseline_window: int = field(default=64, metadata={"help": "Window of the sliding-window baseline (0: skip)."})
    baseline_sinks: int = field(default=4, metadata={"help": "Sink tokens of the sliding-window baseline."})
    long_context_data: str = field(default=DEFAULT_DATA_DIR, metadata={
        "help": f"Folder of the held-out long texts, written by `{PREPARE_COMMAND}`."})
    long_contexts: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096],
                                     metadata={"help": "Context lengths of the long-context perplexity."})
    long_scored_tokens: int = field(default=8192, metadata={
        "help": "Tokens scored at least at each long context (the second half of each row)."})
    long_min_rows: int = field(default=8, metadata={
        "help": "Rows (windows of the documents) scored at least at each long context, the longest included."})
    position_bins: list[int] = field(default_factory=list, metadata={
        "help": "Edges of position bins (e.g. 1 1024 2048 4096 8192): perplexity at positions [edge_i, edge_i+1) of "
                "one row of each of position_rows documents (an extra forward of the last edge's length per row and "
                "model); empty: skip."})
    position_rows: int = field(default=8, metadata={"help": "Documents scored by position (≤ the long documents)."})
    document_tokens: int = field(default=8192, metadata={"help": "Tokens per long document (≥ every length)."})
    documents_per_source: int = field(default=4, metadata={"help": "Long documents taken from each text."})
    passkey_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096],
                                       metadata={"help": "Prompt tokens of the passkey trials."})
    passkey_trials: int = field(default=50, metadata={"help": "Trials per length, haystack and variant (0: skip)."})
    passkey_haystacks: list[str] = field(default_factory=lambda: list(HAYSTACKS),
                                         metadata={"help": "natural (long documents) and/or filler."})
    passkey_variants: list[str] = field(default_factory=lambda: list(VARIANTS),
                                        metadata={"help": "chat (one key, asked in the tokenizer's chat template), "
                                                          "single (one key, plain text), multi (keyed doors)."})
    passkey_keys: int = field(default=4, metadata={"help": "Doors of the multi-key variant."})
    sparse_cache_sizes: list[int] = field(default_factory=list, metadata={
        "help": "Also measure the models of memory_models with a sparse exact memory of each size (training-free; "
                "labelled 'LABEL + memory M')."})
    softmax_head_counts: list[int] = field(default_factory=list, metadata={
        "help": "Also measure the models of memory_models with, for each N, the N KV heads the teacher retrieves with "
                "most restored to softmax (training-free, beside those they keep already; labelled 'LABEL + N "
                "heads', and with each of sparse_cache_sizes 'LABEL + N heads + memory M'). Needs "
                "--teacher_name_or_path."})
    head_ranking_prompts: int = field(default=6, metadata={
        "help": "Passkey prompts (haystack: the data pipeline's documents) that rank the teacher's heads."})
    head_ranking_length: int = field(default=2048, metadata={"help": "Tokens of each head-ranking prompt."})
    head_ranking: str = field(default="teacher", metadata={
        "help": "How softmax_head_counts ranks heads: teacher (the teacher's attention on the key, "
                "retrieval_scores) or restoration (each model's own gain in the key's log-probability with one "
                "head restored, restoration_gains: one forward per prompt and shortlisted head, no teacher "
                "needed)."})
    head_ranking_shortlist: int | None = field(default=None, metadata={
        "help": "With head_ranking restoration: the heads of each model measured exactly, the best of a first-order "
                "estimate (one forward and backward per prompt; default 3 × the largest of softmax_head_counts, at "
                "most every recurrent head; 0: the estimate alone ranks)."})
    memory_models: list[str] | None = field(default=None, metadata={
        "help": "Labels of the models measured with each of sparse_cache_sizes (window hybrids) and "
                "softmax_head_counts; default: all."})
    passkey_models: list[str] | None = field(default=None, metadata={
        "help": "Labels that get the passkey trials (teacher, SWA(W)+S sinks, model labels); default: all."})
    decode_contexts: list[int] = field(default_factory=lambda: [1024, 16384])
    decode_models: list[str] | None = field(default=None, metadata={
        "help": "Labels whose decode latency and cache are measured (teacher, model labels); default: all."})
    decode_tokens: int = field(default=32, metadata={"help": "Decode steps timed after each context (the median)."})
    prefill_chunk: int = 1024
    decode_prefilled: int = field(default=1024, metadata={
        "help": "A decode context up to this many tokens is prefilled for real; a longer one prefills about this "
                "many and is extended to its length by shape (training.measure.extend_cache: the decode step does the "
                "same work; a real prefill of 16K tokens is minutes of CPU)."})
    seed: int = field(default=0, metadata={"help": "Seed of the passkey trials (keys, haystack offsets)."})
    output_dir: str = "outputs/evaluate"
    update_model_cards: bool = field(
        default=True, metadata={"help": "Write the results and a model card into each linear-attention checkpoint."}
    )


@dataclass
class Evaluation:
    """What `evaluate_models` measured: rows of dicts, each with its `model` label."""

    quality: list[dict[str, Any]]  # per model (and baseline): short perplexity, vs_teacher
    long_context: list[dict[str, Any]]  # per model and context: perplexity, vs_teacher, scored_tokens, cache_bytes
    passkey: list[dict[str, Any]]  # per model, length, haystack and variant: `passkey_scores`
    decode: list[dict[str, Any]]  # per model and context: cache_bytes, ms_per_token
    models: dict[str, str]  # label -> path of the models given
    linear: list[str]  # the labels of the linear-attention checkpoints among them (not their memory variants)
    eval_rows: int  # short held-out rows scored
    positions: list[dict[str, Any]] = field(default_factory=list)  # per model and position bin: perplexity, vs_teacher


def parse_models(entries: list[str]) -> dict[str, str]:
    """`label=path` entries of `--models` as {label: path}; raises ValueError naming a malformed one."""
    models: dict[str, str] = {}
    for entry in entries:
        label, sep, path = entry.partition("=")
        if not sep or not label or not path:
            raise InputError(f"--models entries are label=path, got {entry!r}")
        if label in models:
            raise InputError(f"--models: label {label!r} given twice")
        models[label] = path
    return models


def baseline_label(args: EvaluateArguments) -> str:
    return f"SWA({args.baseline_window})+{args.baseline_sinks} sinks"


def variant_label(label: str, heads: int, memory: int) -> str:
    """The label of model `label` measured with `heads` more KV heads restored and a sparse exact memory of `memory`
    tokens (0: none of either)."""
    return label + (f" + {heads} heads" if heads else "") + (f" + memory {memory}" if memory else "")


def variants(args: EvaluateArguments, with_variants: dict[str, str]) -> list[tuple[str, str, int, int]]:
    """(variant label, model label, heads, memory) of every variant measured: each model of `with_variants` with each
    head count and memory size of the arguments, and each combination of the two."""
    return [(variant_label(label, heads, memory), label, heads, memory) for label in with_variants
            for heads in [0, *args.softmax_head_counts] for memory in [0, *args.sparse_cache_sizes]
            if heads or memory]


def check_variant_models(models: dict[str, str], args: EvaluateArguments) -> None:
    """ValueError unless each model of `models` (`memory_models`) can be measured with every variant of `args`, read
    from each checkpoint's config before any model is loaded: a window hybrid for `sparse_cache_sizes`, a
    linear-attention checkpoint with at least max(`softmax_head_counts`) (and `head_ranking_shortlist`) KV heads
    left to restore for the head variants."""
    sizes, counts, shortlist = args.sparse_cache_sizes, args.softmax_head_counts, args.head_ranking_shortlist
    if not sizes and not counts:
        return
    if any(size < 1 for size in sizes) or len(set(sizes)) < len(sizes):
        raise InputError(f"sparse_cache_sizes must be distinct sizes ≥ 1, got {sizes}")
    for label, path in models.items():
        config = AutoConfig.from_pretrained(path)
        if sizes and getattr(config, "window_size", 0) < 1:
            raise InputError(f"sparse_cache_sizes: model {label!r} ({path}) is no window hybrid (window_size > 0), "
                             "so it has no sparse memory to switch on; drop the sizes or the model")
        if not counts:
            continue
        if not isinstance(config, hf_linear_attn.LinearAttentionConfig):
            raise InputError(f"softmax_head_counts: model {label!r} ({path}) is a {config.model_type!r} model, not a "
                             "linear-attention checkpoint, so it has no recurrent heads to restore; drop the counts "
                             "or leave it out of memory_models")
        available = len(recurrent_kv_heads(config))
        for name, asked, most in (("softmax_head_counts", counts, max(counts)),
                                  ("head_ranking_shortlist", shortlist, shortlist or 0)):
            if most > available:
                raise InputError(f"{name} {asked}: model {label!r} ({path}) has {available} recurrent KV heads left "
                                 "to restore")


def packed_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (summed next-token loss, tokens) on packed rows, documents kept apart: a linear-attention model
    restarts its state where `position_ids` restart; a softmax model gets an explicit mask (`document_mask`), a
    `WindowBaseline` its window mask."""
    if isinstance(model, hf_linear_attn.LinearAttentionForCausalLM):
        return causal_lm_loss(model, batch)
    positions = batch["position_ids"]
    if isinstance(model, WindowBaseline):
        model, mask = model.model, model.mask(positions)
    else:
        mask = document_mask(positions)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions).logits
    return token_cross_entropy(logits, batch["labels"]).sum(dim=1), predicted_tokens(batch["labels"]).sum(dim=1)


@torch.no_grad()
def perplexity(model, rows: list[dict], batch_size: int) -> float:
    """exp of the token-weighted mean `packed_loss` over `rows`, in batches of `batch_size`."""
    batches = (collate_rows(rows[start:start + batch_size]) for start in range(0, len(rows), batch_size))
    return math.exp(weighted_mean(packed_loss(model, batch) for batch in batches))


def check_arguments(args: EvaluateArguments) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """ValueError naming the first bad argument, reading no file (the checkpoints' configs are
    `check_variant_models`'). Returns the models {label: path}, those measured with each of `sparse_cache_sizes`,
    and the labels of every model measured (teacher, baseline, models, memory variants)."""
    if not args.teacher_name_or_path and not args.models:
        raise InputError("give --teacher_name_or_path and/or --models label=path ...")
    models = parse_models(args.models)
    unknown = sorted(set(args.memory_models or []) - set(models))
    if unknown:
        raise InputError(f"memory_models {unknown} are not among --models {list(models)}")
    with_memory = {label: models[label] for label in (models if args.memory_models is None else args.memory_models)}
    labels = [*(["teacher"] if args.teacher_name_or_path else []),
              *([baseline_label(args)] if args.teacher_name_or_path and args.baseline_window > 0 else []), *models,
              *(name for name, *_ in variants(args, with_memory))]
    if args.head_ranking not in HEAD_RANKINGS:
        raise InputError(f"head_ranking {args.head_ranking!r}: choose one of {list(HEAD_RANKINGS)}")
    counts = args.softmax_head_counts
    if counts and (any(n < 1 for n in counts) or len(set(counts)) < len(counts)):
        raise InputError(f"softmax_head_counts must be distinct counts ≥ 1, got {counts}")
    shortlist = args.head_ranking_shortlist
    if shortlist is not None and not (counts and args.head_ranking == "restoration"):
        raise InputError(f"head_ranking_shortlist {shortlist} applies to head variants ranked by restoration: give "
                         "softmax_head_counts and head_ranking restoration, or drop it")
    if shortlist is not None:
        check_shortlist("head_ranking_shortlist", shortlist, max(counts))
    if counts and args.head_ranking == "teacher" and not args.teacher_name_or_path:
        raise InputError("softmax_head_counts with head_ranking teacher needs --teacher_name_or_path, whose heads are "
                         "ranked; give it or rank with --head_ranking restoration")
    for name in ("max_eval_rows", "eval_batch_size", "document_tokens", "documents_per_source",
                 "long_scored_tokens", "long_min_rows", "decode_tokens", "prefill_chunk", "decode_prefilled",
                 "head_ranking_prompts"):
        if getattr(args, name) < 1:
            raise InputError(f"{name} must be ≥ 1, got {getattr(args, name)}")
    if args.baseline_window < 0 or args.baseline_sinks < 0 or args.passkey_trials < 0:
        raise InputError("baseline_window, baseline_sinks and passkey_trials must be ≥ 0, got "
                         f"{args.baseline_window}, {args.baseline_sinks} and {args.passkey_trials}")
    if any(c < 2 for c in args.long_contexts):
        raise InputError(f"long_contexts must be ≥ 2 tokens each, got {args.long_contexts}")
    if any(n < 1 for n in [*args.passkey_lengths, *args.decode_contexts]):
        raise InputError(f"passkey_lengths and decode_contexts must be ≥ 1 each, got {args.passkey_lengths} and "
                         f"{args.decode_contexts}")
    longest = max([*args.long_contexts, *args.passkey_lengths], default=0)
    if longest > args.document_tokens:
        raise InputError(f"long_contexts / passkey_lengths go up to {longest} tokens, more than document_tokens="
                         f"{args.document_tokens}: raise document_tokens")
    if args.position_bins:
        check_position_bins(args.position_bins, args.document_tokens)
        documents = args.documents_per_source * len(SOURCES)
        if not 1 <= args.position_rows <= documents:
            raise InputError(f"position_rows must be in [1, {documents}] (documents_per_source × {len(SOURCES)} "
                             f"texts), got {args.position_rows}")
    for name, given, allowed in (("passkey_haystacks", args.passkey_haystacks, HAYSTACKS),
                                 ("passkey_variants", args.passkey_variants, VARIANTS)):
        if not given or any(value not in allowed for value in given):
            raise InputError(f"{name} must be a non-empty list of {list(allowed)}, got {given}")
    if "multi" in args.passkey_variants and not 2 <= args.passkey_keys <= len(DOORS):
        raise InputError(f"passkey_keys must be in [2, {len(DOORS)}] for the multi variant, got {args.passkey_keys}")
    for name in ("passkey_models", "decode_models"):
        unknown = sorted(set(getattr(args, name) or []) - set(labels))
        if unknown:
            raise InputError(f"{name} {unknown} are not evaluated; the labels are {labels}")
    if len(set(labels)) < len(labels):
        raise InputError(f"--models labels must differ from each other, from 'teacher' and from the baseline's "
                         f"({baseline_label(args)!r}); the labels are {labels}")
    return models, with_memory, labels


def with_heads(model: PreTrainedModel, head_scores: torch.Tensor | None, n: int) -> PreTrainedModel:
    """`model` with the `n` KV heads that rank highest in `head_scores` [L, H_kv] restored to softmax, outside its
    softmax layers and the heads it keeps already (`model` itself for n = 0, when no scores are needed)."""
    if n == 0:
        return model
    config = model.config
    heads = top_heads(head_scores, n, exclude_layers=config.softmax_layers, taken=config.softmax_heads)
    return restore_softmax_heads(model, heads, inplace=True)


def evaluate_models(args: EvaluateArguments, data_args: DataArguments,
                    log: Callable[[str], None] = lambda line: print(line, flush=True)) -> Evaluation:
    """Measure the teacher, its sliding-window baseline and every model of `args.models` (see the module
    docstring), printing progress through `log`. Raises ValueError (bad arguments) or FileNotFoundError (no
    long texts in `args.long_context_data`: the message names the prepare command) before loading any model."""
    models, with_memory, labels = check_arguments(args)
    check_variant_models(with_memory, args)
    passkey_settings = [(length, haystack, variant) for length in args.passkey_lengths
                        for haystack in args.passkey_haystacks for variant in args.passkey_variants
                        ] if args.passkey_trials else []
    texts = None
    if args.long_contexts or args.position_bins or any(haystack == "natural" for _, haystack, _ in passkey_settings):
        try:
            texts = load_texts(args.long_context_data)
        except FileNotFoundError as error:
            raise InputNotFoundError(f"long_context_data: {error}") from None

    load_kwargs = {"gguf_file": args.teacher_gguf_file} if args.teacher_gguf_file else {}
    tokenizer_source = args.tokenizer_name or args.teacher_name_or_path or next(iter(models.values()))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, **(
        load_kwargs if tokenizer_source == args.teacher_name_or_path else {}))
    rows = list(build_datasets(data_args, tokenizer)["validation"])[: args.max_eval_rows]
    documents = [] if texts is None else long_documents(tokenizer, texts, args.document_tokens,
                                                           args.documents_per_source)
    for context in args.long_contexts:  # raises now, not after the first models, when the documents are too few
        perplexity_spans(documents, context, args.long_scored_tokens, args.long_min_rows)
    passkey_sets = {(length, haystack, variant): passkey_trials(
        tokenizer, documents, length, args.passkey_trials, haystack, variant, args.seed, args.passkey_keys)
        for length, haystack, variant in passkey_settings}
    passkey_models = set(labels if args.passkey_models is None else args.passkey_models)
    decode_models = set(labels if args.decode_models is None else args.decode_models)
    ranking_prompts = head_ranking_prompts(tokenizer, replace(data_args, block_size=args.head_ranking_length),
                                           args.head_ranking_prompts) if args.softmax_head_counts else []
    # [L, H_kv] head scores by ranking source: the teacher's, or each model's own (head_ranking restoration), measured
    # when that model is loaded, before its variants.
    head_scores: dict[str, torch.Tensor] = {}
    head_variants = {name for name, _, heads, _ in variants(args, with_memory) if heads}
    log(f"Evaluating {len(labels)} models: {len(rows)} held-out rows of {data_args.block_size} tokens; "
        f"long-context perplexity at {args.long_contexts} (≥ {args.long_scored_tokens} tokens and "
        f"≥ {args.long_min_rows} rows each); "
        f"{len(passkey_sets)} passkey settings x {args.passkey_trials} trials for {sorted(passkey_models)}")

    candidates: list[tuple[str, Callable[[], PreTrainedModel]]] = []
    if args.teacher_name_or_path:
        candidates.append(("teacher", lambda: load_teacher(args.teacher_name_or_path, **load_kwargs)))
    for label, path in models.items():
        candidates.append((label, lambda p=path: AutoModelForCausalLM.from_pretrained(p)))
        source = "teacher" if args.head_ranking == "teacher" else label
        candidates += [(name, lambda p=path, n=heads, m=memory, source=source: with_heads(
            AutoModelForCausalLM.from_pretrained(p, sparse_cache_size=m), head_scores.get(source), n))
            for name, model_label, heads, memory in variants(args, with_memory) if model_label == label]

    start = time.perf_counter()
    progress = lambda line: log(f"  [{time.perf_counter() - start:5.0f} s] {line}")  # noqa: E731
    quality, long_rows, by_position, passkey, decode, linear_labels = [], [], [], [], [], []
    for label, load in candidates:
        model = load().eval()
        if label == "teacher" and ranking_prompts and args.head_ranking == "teacher":
            head_scores["teacher"] = retrieval_scores(model, ranking_prompts, progress=False)
            progress(f"teacher: KV heads ranked by retrieval on {len(ranking_prompts)} prompts")
        if label in with_memory and ranking_prompts and args.head_ranking == "restoration":
            head_scores[label] = restoration_scores(model, ranking_prompts, max(args.softmax_head_counts),
                                                    args.head_ranking_shortlist)[0]
            progress(f"{label}: KV heads ranked by restoration gain on {len(ranking_prompts)} prompts")
        measured: list[tuple[str, Any]] = [(label, model)]
        if label == "teacher" and args.baseline_window > 0:
            measured.append((baseline_label(args), WindowBaseline(model, args.baseline_window, args.baseline_sinks)))
        if label in models and isinstance(model, hf_linear_attn.LinearAttentionForCausalLM):
            linear_labels.append(label)  # a checkpoint: it gets the record and model card
        for name, candidate in measured:
            quality.append({"model": name, "perplexity": perplexity(candidate, rows, args.eval_batch_size)})
            progress(f"{name}: short perplexity {quality[-1]['perplexity']:.2f}")
            cache_bytes = dict(zip(args.long_contexts, cache_bytes_at(candidate, args.long_contexts), strict=True))
            for row in perplexity_by_context({name: candidate}, documents, args.long_contexts,
                                                args.long_scored_tokens, args.long_min_rows, log=progress):
                long_rows.append({**row, "cache_bytes": cache_bytes[row["context"]]})
            if args.position_bins:
                by_position += perplexity_by_position({name: candidate}, documents, args.position_bins,
                                                      args.position_rows, log=progress)
            if name in passkey_models:
                for (length, haystack, variant), setting_trials in passkey_sets.items():
                    scores = passkey_scores(candidate, setting_trials)
                    passkey.append({"model": name, "length": length, "haystack": haystack, "variant": variant,
                                    **scores})
                    progress(f"{name}: passkey @{length} {haystack}/{variant} {scores['accuracy']:.0%}, key "
                             f"log-prob {scores['key_log_prob']:.2f} ± {scores['key_log_prob_se']:.2f}")
        if label in head_variants or label not in decode_models:  # a head variant decodes as its model does
            progress(f"{label}: done")
            continue
        profile = decode_profile(model, args.decode_contexts, args.decode_tokens, args.prefill_chunk,
                                 args.decode_prefilled)
        for entry, cache_bytes in zip(profile, cache_bytes_by_context(model, args.decode_contexts), strict=True):
            decode.append({"model": label, "context": entry["context"], "cache_bytes": cache_bytes,
                           "ms_per_token": entry["ms_per_token"]})
        progress(f"{label}: done")
        del model, measured

    reference = next((r["perplexity"] for r in quality if r["model"] == "teacher"), None)
    for r in quality:
        r["vs_teacher"] = r["perplexity"] / reference if reference else None
    by_context = {r["context"]: r["perplexity"] for r in long_rows if r["model"] == "teacher"}
    for r in long_rows:
        r["vs_teacher"] = r["perplexity"] / by_context[r["context"]] if r["context"] in by_context else None
    by_bin = {r["first"]: r["perplexity"] for r in by_position if r["model"] == "teacher"}
    for r in by_position:
        r["vs_teacher"] = r["perplexity"] / by_bin[r["first"]] if r["first"] in by_bin else None
    return Evaluation(quality, long_rows, passkey, decode, models, linear_labels, len(rows), by_position)


QUALITY_COLUMNS = {"model": "model", "perplexity": "perplexity", "vs_teacher": "× teacher"}


def frontier_rows(evaluation: Evaluation) -> list[dict[str, Any]]:
    """Quality against cache bytes at the longest long context, one row per model measured there (variants
    included), when the teacher is: `cache_bytes`, `cache_share` (of the teacher's), `vs_teacher` (perplexity
    × the teacher's) and, from the first passkey setting measured (haystack and variant), `passkey_N` ("accuracy,
    key log-prob") at each length N. Empty without the teacher or long contexts."""
    if not evaluation.long_context:
        return []
    longest = max(r["context"] for r in evaluation.long_context)
    at_longest = [r for r in evaluation.long_context if r["context"] == longest]
    teacher_bytes = next((r["cache_bytes"] for r in at_longest if r["model"] == "teacher"), None)
    if not teacher_bytes:
        return []
    setting = next(((p["haystack"], p["variant"]) for p in evaluation.passkey), None)
    rows = []
    for r in at_longest:
        row = {"model": r["model"], "context": longest, "cache_bytes": r["cache_bytes"],
               "cache_share": r["cache_bytes"] / teacher_bytes, "vs_teacher": r["vs_teacher"]}
        for p in evaluation.passkey:
            if p["model"] == r["model"] and (p["haystack"], p["variant"]) == setting:
                row[f"passkey_{p['length']}"] = f"{p['accuracy']:.0%}, {p['key_log_prob']:.2f}"
                row[f"key_log_prob_{p['length']}"] = p["key_log_prob"]
        rows.append(row)
    return rows


def frontier_plot(rows: list[dict[str, Any]], lengths: list[int]) -> Callable:
    """A `plot` for `write_report`: the key's log-probability at the longest passkey length measured, and the
    perplexity against the teacher's, each against the share of the teacher's cache, one labelled point per model."""
    key = f"key_log_prob_{max(lengths)}" if lengths else None

    def plot(plt):
        panels = [("vs_teacher", "perplexity × teacher")] + ([(key, f"key log-prob at {max(lengths)}")]
                                                               if any(key in r for r in rows) else [])
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
        for ax, (y, ylabel) in zip(axes[0], panels, strict=True):
            for r in rows:
                if r.get(y) is not None:
                    ax.plot(r["cache_share"], r[y], "o")
                    ax.annotate(r["model"], (r["cache_share"], r[y]), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
            ax.set(xscale="log", xlabel=f"cache at {format_cell(rows[0]['context'])} tokens, × teacher's",
                   ylabel=ylabel)
        fig.tight_layout()
        return fig

    return plot


def write_evaluation(evaluation: Evaluation, args: EvaluateArguments, data_args: DataArguments) -> tuple[str, str]:
    """Print and write `evaluation.{md,json,png}` (short perplexity; long-context perplexity, passkey and cache
    bytes by context; the plot of perplexity and cache bytes against context), `positions.{md,json}` (perplexity by
    position, when measured), `frontier.{md,json,png}` and `decode.{md,json,png}` to
    `args.output_dir` and, with `args.update_model_cards`, the record and model card of every linear-attention
    checkpoint evaluated. Returns the evaluation's and the decode table (Markdown)."""
    record = {"machine": machine(), "eval_rows": evaluation.eval_rows, "block_size": data_args.block_size,
              "rows": evaluation.quality,
              "long_context": evaluation.long_context, "passkey": evaluation.passkey, "decode": evaluation.decode}
    plot = None
    if evaluation.long_context:
        plot = log_log_plot(evaluation.long_context, "context", "context tokens",
                            [("perplexity", "held-out perplexity"),
                             (lambda r: r["cache_bytes"] / 2**20, "decoding cache MiB")])
    evaluation_tables = write_report(
        evaluation.quality, QUALITY_COLUMNS, args.output_dir, "evaluation", plot,
        meta={"args": asdict(args), "data": asdict(data_args), "long_context": evaluation.long_context,
              "passkey": evaluation.passkey}, sections=long_context_tables(record))

    if evaluation.positions:
        write_report(evaluation.positions, {"model": "model", "first": "from position", "end": "to (excl.)",
                                            "perplexity": "perplexity", "vs_teacher": "× teacher"},
                     args.output_dir, "positions")

    frontier = frontier_rows(evaluation)
    if frontier:
        columns = {"model": "model", "cache_share": "cache × teacher's", "vs_teacher": "perplexity × teacher",
                   **{f"passkey_{n}": f"passkey {format_cell(n)}" for n in args.passkey_lengths}}
        write_report(frontier, columns, args.output_dir, "frontier", frontier_plot(frontier, args.passkey_lengths))

    plot = log_log_plot(evaluation.decode, "context", "context tokens",
                        [(lambda r: r["cache_bytes"] / 2**20, "decode cache MiB")])
    decode_table = write_report(evaluation.decode, {"model": "model", "context": "context",
                                                    "cache_bytes": "cache bytes", "ms_per_token": "ms/token"},
                                args.output_dir, "decode", plot)
    if args.update_model_cards:
        for label in evaluation.linear:
            path = Path(evaluation.models[label])
            config = json.loads((path / "config.json").read_text())
            mine = {"label": label, **record, "cache_memory": cache_memory(config)}
            (path / EVALUATION_FILE).write_text(json.dumps(mine, indent=2))
            write_model_card(path)
            print(f"  model card with these numbers: {path / 'README.md'}")
    return evaluation_tables, decode_table
