"""Evaluate linear-attention models against their softmax teacher (library of `training/evaluate.py`).

`evaluate_models(args, data_args)` measures, for the teacher, the training-free baseline "teacher
restricted to a sliding window of `baseline_window` tokens + `baseline_sinks` sinks", and every
`label=path` model of `args.models`:
- held-out perplexity on the validation rows of the data pipeline (`training.data`; documents kept
  apart, the same rows for every model);
- synthetic passkey retrieval: a 5-digit key hidden in filler text at a random depth, at each of
  `passkey_lengths` tokens, `passkey_trials` trials, greedy decoding;
- decode memory and latency: cache bytes and ms per token after `decode_contexts` tokens of context
  (`training.measure`).
It returns the rows (`Evaluation`); `write_evaluation` writes them as tables (Markdown, JSON, a plot)
and, with `update_model_cards`, into every linear-attention checkpoint evaluated (`evaluation.json`)
with a model card (`README.md`) that shows them.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import hf_linear_attn
from hf_linear_attn.conversion import load_teacher
from training.data import DataArguments, build_datasets, collate_rows
from training.losses import LossFn, causal_lm_loss, predicted_tokens, token_cross_entropy, weighted_mean
from training.measure import cache_memory, decode_profile
from training.model_card import EVALUATION_FILE, write_model_card
from training.report import log_log_plot, machine, write_report

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


@dataclass
class EvaluateArguments:
    teacher: str | None = field(default=None, metadata={"help": "The softmax source checkpoint (folder or Hub id)."})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file of the teacher, inside its folder."})
    models: list[str] = field(default_factory=list, metadata={"help": "label=path of each model to evaluate."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Default: the teacher's, else model 1's."})
    max_eval_rows: int = field(default=16, metadata={"help": "Validation rows (of block_size tokens) scored."})
    eval_batch_size: int = 4
    baseline_window: int = field(default=64, metadata={"help": "Window of the sliding-window baseline (0: skip)."})
    baseline_sinks: int = field(default=4, metadata={"help": "Sink tokens of the sliding-window baseline."})
    passkey_lengths: list[int] = field(default_factory=lambda: [256, 1024], metadata={"help": "Prompt tokens."})
    passkey_trials: int = 4
    decode_contexts: list[int] = field(default_factory=lambda: [1024, 16384])
    decode_tokens: int = field(default=8, metadata={"help": "Decode steps timed after each context."})
    prefill_chunk: int = 1024
    seed: int = field(default=0, metadata={"help": "Seed of the passkey trials (keys, depths)."})
    output_dir: str = "outputs/evaluate"
    update_model_cards: bool = field(
        default=True, metadata={"help": "Write the results and a model card into each linear-attention checkpoint."}
    )


@dataclass
class Evaluation:
    """What `evaluate_models` measured."""

    quality: list[dict[str, Any]]  # per model (and baseline): perplexity, vs_teacher, passkey@N
    decode: list[dict[str, Any]]  # per model and context: cache_bytes, ms_per_token
    models: dict[str, str]  # label -> path of the models given
    linear: list[str]  # the labels of the linear-attention checkpoints among them
    eval_rows: int  # held-out rows scored


def parse_models(entries: list[str]) -> dict[str, str]:
    """`label=path` entries of `--models` as {label: path}; raises ValueError naming a malformed one."""
    models: dict[str, str] = {}
    for entry in entries:
        label, sep, path = entry.partition("=")
        if not sep or not path:
            raise ValueError(f"--models entries are label=path, got {entry!r}")
        models[label] = path
    return models


def document_mask(position_ids: torch.Tensor, window: int = 0, sinks: int = 0) -> torch.Tensor:
    """bool [rows, 1, L, L] for packed rows: causal, within each document (position_ids restart at 0), and with
    `window` > 0 only the last `window` positions of the document plus its first `sinks`."""
    length = position_ids.shape[1]
    document = (position_ids == 0).cumsum(-1)  # [rows, L]
    index = torch.arange(length, device=position_ids.device)
    allowed = (index[None, :, None] >= index[None, None, :]) & (document[:, :, None] == document[:, None, :])
    if window > 0:
        distance = position_ids[:, :, None] - position_ids[:, None, :]
        allowed &= (distance < window) | (position_ids[:, None, :] < sinks)
    return allowed[:, None]


def masked_lm_loss(model: PreTrainedModel, batch: dict[str, torch.Tensor], window: int = 0, sinks: int = 0):
    """Per-row (summed next-token loss, tokens) of a softmax model on packed rows, documents kept apart by an
    explicit mask (`document_mask`), optionally restricted to a sliding window with sinks."""
    mask = document_mask(batch["position_ids"], window, sinks)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"]).logits
    return token_cross_entropy(logits, batch["labels"]).sum(dim=1), predicted_tokens(batch["labels"]).sum(dim=1)


@torch.no_grad()
def perplexity(model: PreTrainedModel, loss_fn: LossFn, rows: list[dict], batch_size: int) -> float:
    """exp of the token-weighted mean `loss_fn` over `rows`, in batches of `batch_size`."""
    batches = (collate_rows(rows[start:start + batch_size]) for start in range(0, len(rows), batch_size))
    return math.exp(weighted_mean(loss_fn(model, batch) for batch in batches))


def passkey_prompt(tokenizer, length: int, key: int, rng: random.Random) -> torch.Tensor:
    """Token ids of about `length` tokens: filler with the key sentence at a random depth, then the question."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = " What is the pass key? The pass key is"
    budget = length - len(tokenizer(needle + question).input_ids)
    filler_ids = tokenizer(FILLER * (budget // 8 + 2)).input_ids[:max(budget, 0)]
    depth = rng.randint(0, len(filler_ids))
    text = tokenizer.decode(filler_ids[:depth]) + needle + tokenizer.decode(filler_ids[depth:]) + question
    return tokenizer(text, return_tensors="pt").input_ids


@torch.no_grad()
def passkey_accuracy(model: PreTrainedModel, tokenizer, length: int, trials: int, seed: int) -> float:
    rng = random.Random(seed + length)
    hits = 0
    for _ in range(trials):
        key = rng.randint(10000, 99999)
        ids = passkey_prompt(tokenizer, length, key, rng)
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        hits += str(key) in tokenizer.decode(out[0, ids.shape[1]:])
    return hits / trials


def evaluate_models(args: EvaluateArguments, data_args: DataArguments) -> Evaluation:
    """Measure the teacher, its sliding-window baseline and every model of `args.models` (see the module
    docstring); prints progress. Raises ValueError for bad arguments before loading anything."""
    if not args.teacher and not args.models:
        raise ValueError("give --teacher and/or --models label=path ...")
    models = parse_models(args.models)
    load_kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tokenizer_source = args.tokenizer_name or args.teacher or next(iter(models.values()))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, **(load_kwargs if tokenizer_source == args.teacher
                                                                   else {}))
    rows = list(build_datasets(data_args, tokenizer)["validation"])[: args.max_eval_rows]
    print(f"Evaluating on {len(rows)} held-out rows of {data_args.block_size} tokens")

    candidates: list[tuple[str, Callable[[], PreTrainedModel]]] = []
    if args.teacher:
        candidates.append(("teacher", lambda: load_teacher(args.teacher, **load_kwargs)))
    candidates += [(label, lambda p=path: AutoModelForCausalLM.from_pretrained(p)) for label, path in models.items()]

    quality, decode = [], []
    linear_labels = []
    for label, load in candidates:
        start = time.perf_counter()
        model = load().eval()
        variants = [(label, 0)]
        if label == "teacher" and args.baseline_window > 0:
            variants.append((f"teacher, window {args.baseline_window} + {args.baseline_sinks} sinks",
                             args.baseline_window))
        is_linear = isinstance(model, hf_linear_attn.LinearAttentionForCausalLM)
        if is_linear:
            linear_labels.append(label)
        for name, window in variants:
            if is_linear:
                loss_fn = causal_lm_loss
            else:
                def loss_fn(model, batch, window=window):
                    return masked_lm_loss(model, batch, window, args.baseline_sinks)
            row = {"model": name, "perplexity": perplexity(model, loss_fn, rows, args.eval_batch_size)}
            if window == 0:
                for length in args.passkey_lengths:
                    row[f"passkey@{length}"] = passkey_accuracy(model, tokenizer, length, args.passkey_trials,
                                                                args.seed)
            quality.append(row)
            print(f"  {name}: perplexity {row['perplexity']:.2f}", flush=True)
        for entry in decode_profile(model, args.decode_contexts, args.decode_tokens, args.prefill_chunk):
            decode.append({"model": label, **entry})
        print(f"  {label}: done in {time.perf_counter() - start:.0f} s", flush=True)
        del model

    reference = next((r["perplexity"] for r in quality if r["model"] == "teacher"), None)
    for r in quality:
        r["vs_teacher"] = r["perplexity"] / reference if reference else None
    return Evaluation(quality, decode, models, linear_labels, len(rows))


def write_evaluation(evaluation: Evaluation, args: EvaluateArguments, data_args: DataArguments) -> tuple[str, str]:
    """Print and write `evaluation.{md,json}` and `decode.{md,json,png}` to `args.output_dir` and, with
    `args.update_model_cards`, the record and model card of every linear-attention checkpoint evaluated.
    Returns the quality and the decode table (Markdown)."""
    quality, decode = evaluation.quality, evaluation.decode
    columns = {"model": "model", "perplexity": "perplexity", "vs_teacher": "× teacher",
               **{f"passkey@{n}": f"passkey @{n}" for n in args.passkey_lengths}}
    quality_table = write_report(quality, columns, args.output_dir, "evaluation",
                                 meta={"args": asdict(args), "data": asdict(data_args), "decode": decode})

    plot = log_log_plot(decode, "context", "context tokens", [(lambda r: r["cache_bytes"] / 2**20, "decode cache MiB")])
    decode_table = write_report(decode, {"model": "model", "context": "context", "cache_bytes": "cache bytes",
                                         "ms_per_token": "ms/token"}, args.output_dir, "decode", plot)
    if args.update_model_cards:
        for label in evaluation.linear:
            path = Path(evaluation.models[label])
            config = json.loads((path / "config.json").read_text())
            record = {"label": label, "machine": machine(), "eval_rows": evaluation.eval_rows,
                      "block_size": data_args.block_size, "passkey_trials": args.passkey_trials, "rows": quality,
                      "decode": decode, "cache_memory": cache_memory(config)}
            (path / EVALUATION_FILE).write_text(json.dumps(record, indent=2))
            write_model_card(path)
            print(f"  model card with these numbers: {path / 'README.md'}")
    return quality_table, decode_table
