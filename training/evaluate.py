"""Evaluate converted linear-attention models against their softmax teacher.

    python training/evaluate.py --teacher SRC --models converted=DIR stage1=DIR2 [--gguf_file F] \
        [--config RECIPE.yaml] [--block_size 512 --max_eval_rows 16 ...]

Reports, for the teacher, the training-free baseline "teacher restricted to a sliding window of
`baseline_window` tokens + `baseline_sinks` sinks", and every `label=path` model:
- held-out perplexity on the validation rows of the data pipeline (`training.data`; documents kept
  apart, the same rows for every model);
- synthetic passkey retrieval: a 5-digit key hidden in filler text at a random depth, at each of
  `passkey_lengths` tokens, `passkey_trials` trials, greedy decoding;
- decode memory and latency: cache bytes and ms per token after `decode_contexts` tokens of context.
Writes `evaluation.md`, `evaluation.json` and `evaluation.png` to `--output_dir` and prints the tables.
Unless `--update_model_cards false`, every linear-attention checkpoint evaluated also gets the numbers in
its folder (`evaluation.json`) and a model card (`README.md`) that shows them.
"""

# ruff: noqa: E402 - the imports follow the sys.path set-up for running as a script
from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make the `training` package importable
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # the decode measurements are the benchmark's

import torch
import torch.nn.functional as F
from bench_decode import cache_bytes, decode_times, new_cache, prefill
from common import machine, write_report
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import hf_linear_attn
from hf_linear_attn.conversion import load_teacher
from training.data import IGNORE_INDEX, DataArguments, build_datasets, collate_rows
from training.loop import causal_lm_loss
from training.model_card import EVALUATION_FILE, write_model_card
from training.recipes import parse_recipe_args

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
    """Per-row (summed next-token loss, tokens) of a softmax model on packed rows, documents kept apart."""
    mask = document_mask(batch["position_ids"], window, sinks)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"]).logits
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return loss.sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1)


@torch.no_grad()
def perplexity(loss_fn, rows: list[dict], batch_size: int) -> float:
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        loss_sum, tokens = loss_fn(collate_rows(rows[start:start + batch_size]))
        total, count = total + loss_sum.sum().item(), count + tokens.sum().item()
    return math.exp(total / count)


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


def decode_profile(model: PreTrainedModel, contexts: list[int], steps: int, chunk: int) -> list[dict]:
    rows = []
    for context in contexts:
        cache = new_cache(model)
        logits = prefill(model, cache, context, chunk)
        bytes_after_prefill = cache_bytes(cache)
        ms = 1000 * sorted(decode_times(model, cache, logits, steps))[steps // 2]
        rows.append({"context": context, "cache_bytes": bytes_after_prefill, "ms_per_token": ms})
    return rows


def main(argv: list[str]) -> int:
    args, data_args = parse_recipe_args((EvaluateArguments, DataArguments), argv)
    if not args.teacher and not args.models:
        raise SystemExit("error: give --teacher and/or --models label=path ...")
    models: dict[str, str] = {}
    for entry in args.models:
        label, sep, path = entry.partition("=")
        if not sep or not path:
            raise SystemExit(f"error: --models entries are label=path, got {entry!r}")
        models[label] = path
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
    linear_labels = []  # the checkpoints whose model cards get the results
    for label, load in candidates:
        start = time.perf_counter()
        model = load().eval()
        variants = [(label, 0)]
        if label == "teacher" and args.baseline_window > 0:
            variants.append((f"teacher, window {args.baseline_window} + {args.baseline_sinks} sinks",
                             args.baseline_window))
        if isinstance(model, hf_linear_attn.LinearAttentionForCausalLM):
            linear_labels.append(label)
        for name, window in variants:
            if isinstance(model, hf_linear_attn.LinearAttentionForCausalLM):
                def loss_fn(batch, model=model):
                    return causal_lm_loss(model, batch)
            else:
                def loss_fn(batch, model=model, window=window):
                    return masked_lm_loss(model, batch, window, args.baseline_sinks)
            row = {"model": name, "perplexity": perplexity(loss_fn, rows, args.eval_batch_size)}
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
    columns = {"model": "model", "perplexity": "perplexity", "vs_teacher": "× teacher",
               **{f"passkey@{n}": f"passkey @{n}" for n in args.passkey_lengths}}
    write_report(quality, columns, args.output_dir, "evaluation", meta={"args": asdict(args),
                                                                         "data": asdict(data_args), "decode": decode})

    def plot(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label in dict.fromkeys(r["model"] for r in decode):
            mine = [r for r in decode if r["model"] == label]
            ax.plot([r["context"] for r in mine], [r["cache_bytes"] / 2**20 for r in mine], "o-", label=label)
        ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="decode cache MiB")
        ax.legend()
        fig.tight_layout()
        return fig

    write_report(decode, {"model": "model", "context": "context", "cache_bytes": "cache bytes",
                          "ms_per_token": "ms/token"}, args.output_dir, "decode", plot)
    if args.update_model_cards:
        for label in linear_labels:
            path = Path(models[label])
            record = {"label": label, "machine": machine(), "eval_rows": len(rows), "block_size": data_args.block_size,
                      "passkey_trials": args.passkey_trials, "rows": quality, "decode": decode}
            (path / EVALUATION_FILE).write_text(json.dumps(record, indent=2))
            write_model_card(path)
            print(f"  model card with these numbers: {path / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
