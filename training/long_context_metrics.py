"""Long-context measurements of causal LMs on the held-out long documents (`training.long_context_data`):
perplexity against context length, passkey retrieval, and cache bytes at each length. `training.evaluation`
(`training/evaluate.py`) runs them on the teacher, its sliding-window baseline and each model.

Perplexity at context L: rows of L consecutive document tokens (row r is window r // D, not overlapping, of
document r % D of the D documents), added until `scored_tokens` tokens are scored and at least `min_rows` rows
are (so that a long context is not decided by one window). Each row scores its second
half, positions L // 2 .. L - 1, every token predicted from all tokens before it in the row: each scored token
has at least L / 2 tokens of context, so a model that uses context can only gain from a longer L. The rows are
the same for every model at a given L (they are different windows at different L: compare models at one L, and
each model's trend over L). Rows of different L that start at the same token share one forward.

Perplexity by position (`perplexity_by_position`): the first N tokens of each of several documents, one forward
each, the losses averaged over bins of positions: where along a context a model falls behind its teacher.

Passkey retrieval at length L: the prompts of `long_context_data.passkey_trials`, each scored teacher-forced
(`key_score`: one forward over the prompt and the key's tokens): the log-probability of the key's tokens, the
share of them that are the argmax, and greedy exact match (every key token the argmax: greedy decoding emits
the key; the tests check this against `greedy_generate`). The lm-eval needle tasks read a greedy continuation
instead and count a trial when its first run of digits is the key (`answer_matches`).

Every model is a `PreTrainedModel` (the teacher, a converted linear-attention checkpoint, ...) or a
`WindowBaseline`: a softmax model restricted by an attention mask to a sliding window plus sink tokens (the
training-free baseline). Each is run on one row at a time, without padding, so linear models take their
chunked path.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.training.long_context_data import LongDocument, PasskeyTrial
from hf_linear_attn.training.measure import cache_bytes_by_context

# --------------------------------------------------------------------------------------------- running models

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


@dataclass
class WindowBaseline:
    """The training-free baseline: a softmax `model` whose every position sees only the last `window` positions
    and the first `sinks` of its document (an attention mask, `document_mask`)."""
    model: PreTrainedModel
    window: int = 64
    sinks: int = 4

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """bool [rows, 1, L, L] for positions [rows, L] (restarting at 0 where a packed document starts)."""
        return document_mask(positions, self.window, self.sinks)


def model_device(model) -> torch.device:
    """Where the weights of a model (or of a `WindowBaseline`'s model) are; rows are moved there."""
    parameter = next((model.model if isinstance(model, WindowBaseline) else model).parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def next_token_logits(model, input_ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
    """Logits [1, T', vocab] of one unpadded row `input_ids` [1, T] (T' = T, or the last `logits_to_keep`)."""
    input_ids = input_ids.to(model_device(model))
    if isinstance(model, WindowBaseline):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return model.model(input_ids=input_ids, attention_mask=model.mask(positions), position_ids=positions,
                           logits_to_keep=logits_to_keep).logits
    return model(input_ids=input_ids, logits_to_keep=logits_to_keep).logits


def greedy_generate(model, input_ids: torch.Tensor, max_new_tokens: int, tokenizer) -> list[int]:
    """Greedy continuation of one row `input_ids` [1, T]: `generate()` for a plain model; for a `WindowBaseline`
    a cached decoding loop whose every step gets its row of the window mask. (What `key_score`'s exact match
    stands for, without generating; the lm-eval needle tasks generate this way.)"""
    input_ids = input_ids.to(model_device(model))
    if not isinstance(model, WindowBaseline):
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
        return out[0, input_ids.shape[1]:].tolist()
    # transformers renamed `past_key_values` to `cache` in 5.24; older releases would silently ignore `cache`.
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    cache = {name: DynamicCache(config=model.model.config)}
    length = input_ids.shape[1]
    positions = torch.arange(length + max_new_tokens, device=input_ids.device)[None]
    mask = model.mask(positions)  # [1, 1, N, N]: row t is what position t sees
    logits = model.model(input_ids=input_ids, attention_mask=mask[:, :, :length, :length],
                         position_ids=positions[:, :length], use_cache=True, logits_to_keep=1, **cache).logits
    generated = []
    for step in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        generated.append(token)
        if token == tokenizer.eos_token_id or step == max_new_tokens - 1:
            break
        t = length + step
        logits = model.model(input_ids=input_ids.new_tensor([[token]]), attention_mask=mask[:, :, t:t + 1, :t + 1],
                             position_ids=positions[:, t:t + 1], use_cache=True, **cache).logits
    return generated


def cache_bytes_at(model, contexts: list[int]) -> list[int]:
    """Bytes of the decoding cache after each of `contexts` tokens (`training.measure.cache_bytes_by_context`,
    from the layout). For a `WindowBaseline`: the KV of at most `window + sinks` tokens, what a ring buffer would
    hold."""
    if isinstance(model, WindowBaseline):
        return cache_bytes_by_context(model.model, [min(n, model.window + model.sinks) for n in contexts])
    return cache_bytes_by_context(model, contexts)


# --------------------------------------------------------------------------------------------- perplexity

def perplexity_spans(documents: list[LongDocument], context: int, scored_tokens: int,
                     min_rows: int = 1) -> list[tuple[int, int]]:
    """(document index, first token) of each row scored at `context`: enough rows to score `scored_tokens` tokens
    (each row scores its last `context - context // 2`), and at least `min_rows`. Row r is window r // D
    (consecutive, not overlapping) of document r % D of the D documents, so the rows spread over every document."""
    if context < 2 or min_rows < 1:
        raise InputError(f"context must be ≥ 2 and min_rows ≥ 1, got {context} and {min_rows}")
    rows = max(math.ceil(scored_tokens / (context - context // 2)), min_rows)
    per_document = min(len(d.input_ids) for d in documents) // context
    if rows > per_document * len(documents):
        raise InputError(f"context {context} needs {rows} rows; the documents hold {per_document * len(documents)} "
                         f"(use longer or more documents, fewer scored_tokens or fewer min_rows)")
    return [(r % len(documents), (r // len(documents)) * context) for r in range(rows)]


def perplexity_windows(documents: list[LongDocument], context: int, scored_tokens: int,
                       min_rows: int = 1) -> list[torch.Tensor]:
    """The rows [1, context] scored at `context` (`perplexity_spans`)."""
    return [documents[d].input_ids[None, start:start + context]
            for d, start in perplexity_spans(documents, context, scored_tokens, min_rows)]


@torch.no_grad()
def token_losses(model, row: torch.Tensor, first: int, positions_per_slice: int = 1024) -> torch.Tensor:
    """float64 [L - first]: the next-token loss of positions `first` .. L - 1 of one row [1, L], each predicted
    from every token before it in the row (the log-softmax taken `positions_per_slice` positions at a time)."""
    logits = next_token_logits(model, row, logits_to_keep=row.shape[1] - first + 1)[0, :-1]
    target = row[0, first:].to(logits.device)
    return torch.cat([F.cross_entropy(logits[i:i + positions_per_slice].float(), target[i:i + positions_per_slice],
                                      reduction="none").double().cpu()
                      for i in range(0, len(target), positions_per_slice)])


def perplexity_by_context(models: dict[str, object], documents: list[LongDocument], contexts: list[int],
                          scored_tokens: int = 8192, min_rows: int = 1,
                          log: Callable[[str], None] = print) -> list[dict]:
    """Held-out perplexity of every model at every context (`perplexity_spans`): the same rows, and so the same
    scored token positions, for every model at a given context. One row per (context, model).

    Rows that start at the same token of a document, at different contexts, are scored from one forward of the
    longest of them: a causal model predicts a position from the tokens before it in its row only, so a shorter
    row's losses are the longer row's at the same positions (the demo's 256-4K, 8 documents: 10K tokens of
    forward a model instead of 18K). The tests check this against one forward per row."""
    spans = {context: perplexity_spans(documents, context, scored_tokens, min_rows) for context in contexts}
    reach: dict[tuple[int, int], tuple[int, int]] = {}  # (document, start) -> (end of the longest row, first scored)
    for context, starts in spans.items():
        for d, start in starts:
            end, first = reach.get((d, start), (0, start + context))
            reach[d, start] = (max(end, start + context), min(first, start + context // 2))
    losses: dict[str, dict[tuple[int, int], torch.Tensor]] = {}  # model -> (document, start) -> losses from first
    for label, model in models.items():
        losses[label] = {(d, start): token_losses(model, documents[d].input_ids[None, start:end], first - start)
                         for (d, start), (end, first) in reach.items()}
    results = []
    for context, starts in spans.items():
        for label in models:
            scored = torch.cat([losses[label][d, start][offset:offset + context - context // 2]
                                for d, start in starts
                                for offset in [start + context // 2 - reach[d, start][1]]])  # from the row's first
            last = torch.cat(list(scored.view(len(starts), -1)[:, -(context // 4):])) if context >= 4 else scored
            results.append({"model": label, "context": context, "rows": len(starts), "scored_tokens": len(scored),
                            "perplexity": math.exp(scored.mean().item()),
                            "last_quarter_perplexity": math.exp(last.mean().item())})
            log(f"  perplexity @{context}: {label} {results[-1]['perplexity']:.2f} (last quarter "
                f"{results[-1]['last_quarter_perplexity']:.2f})")
    return results


def check_position_bins(edges: list[int], document_tokens: int) -> None:
    """ValueError unless `edges` are ≥ 2 strictly increasing positions from 1 to at most `document_tokens`."""
    if len(edges) < 2 or edges[0] < 1 or edges[-1] > document_tokens or any(
            a >= b for a, b in pairwise(edges)):
        raise InputError(f"position_bins {edges}: give at least 2 strictly increasing positions from 1 (position 0 "
                         f"has nothing before it to be predicted from) up to document_tokens={document_tokens}")


def perplexity_by_position(models: dict[str, object], documents: list[LongDocument], edges: list[int],
                           rows: int, log: Callable[[str], None] = print) -> list[dict]:
    """Held-out perplexity of every model at the positions [edges[i], edges[i+1]) of one long row, on the first
    `edges[-1]` tokens of each of the first `rows` documents: each position predicted from every token before it
    in its document (the same positions and tokens for every model). Where `perplexity_by_context` shows what a
    longer context buys, this shows where along one context a model falls behind: a rise past the length a model
    was trained on and a gap that grows with the context read the same at one context, and differently here. One
    row per (model, bin): `first`, `end`, `rows`, `scored_tokens`, `perplexity`."""
    check_position_bins(edges, min((len(d.input_ids) for d in documents), default=0))
    if not 1 <= rows <= len(documents):
        raise InputError(f"position rows {rows}: give 1 .. {len(documents)} (one row per long document)")
    results = []
    for label, model in models.items():
        # losses[r, p - 1]: the loss of position p of row r (predicted from positions 0 .. p - 1)
        losses = torch.stack([token_losses(model, documents[r].input_ids[None, :edges[-1]], 1) for r in range(rows)])
        for first, end in pairwise(edges):
            results.append({"model": label, "first": first, "end": end, "rows": rows,
                            "scored_tokens": rows * (end - first),
                            "perplexity": math.exp(losses[:, first - 1:end - 1].mean().item())})
            log(f"  perplexity at positions {first}-{end - 1}: {label} {results[-1]['perplexity']:.2f}")
    return results


# --------------------------------------------------------------------------------------------- passkey retrieval

def answer_matches(generated: str, answer: str) -> bool:
    """True when the first run of digits in the generated text is exactly the answer."""
    digits = re.search(r"\d+", generated)
    return digits is not None and digits.group() == answer


@dataclass(frozen=True)
class KeyScore:
    """The teacher-forced score of one passkey trial: the model reads the prompt and then the key's tokens."""
    log_prob: float  # summed log-probability of the key's tokens, each given the prompt and the key before it
    tokens: int  # the key's tokens
    argmax_hits: int  # key tokens that are the argmax of the model's distribution at their position
    exact: bool  # every key token is the argmax: greedy decoding emits exactly the key's tokens first


@torch.no_grad()
def key_score(model, trial: PasskeyTrial) -> KeyScore:
    """One forward over the prompt and the key's tokens but the last ([1, length + K - 1]) scores the K key
    tokens (`trial.answer_ids`). Greedy decoding emits the key exactly when each key token is the argmax given
    the prompt and the key tokens before it, which is what `exact` checks (by induction over the K steps)."""
    answer = trial.answer_ids.to(trial.input_ids.device)
    count = answer.shape[1]
    logits = next_token_logits(model, torch.cat([trial.input_ids, answer[:, :-1]], dim=1), logits_to_keep=count)
    logits = logits[0].float()  # [K, vocab]: position t predicts key token t
    target = answer[0].to(logits.device)
    hits = logits.argmax(-1) == target
    log_prob = logits.log_softmax(-1).gather(-1, target[:, None]).sum().item()
    return KeyScore(log_prob, count, int(hits.sum()), bool(hits.all()))


def passkey_scores(model, trials: list[PasskeyTrial]) -> dict[str, float]:
    """The passkey measurements of one model on one set of trials (one forward each, `key_score`):
    `accuracy` (share of trials greedy decoding answers exactly), `key_log_prob` (mean over trials of the key's
    summed log-probability) with `key_log_prob_se` (its standard error over trials; 0 for one trial),
    `key_log_prob_per_token` (mean per key token) and `argmax_accuracy` (share of key tokens that are the
    argmax)."""
    if not trials:
        raise InputError("passkey scores need at least one trial")
    scores = [key_score(model, trial) for trial in tqdm(  # at 8K+ tokens a trial is a minute of CPU
        trials, desc=f"passkey trials of {trials[0].input_ids.shape[1]} tokens", unit="trial", leave=False)]
    log_probs = torch.tensor([s.log_prob for s in scores], dtype=torch.float64)
    tokens = sum(s.tokens for s in scores)
    se = log_probs.std().item() / math.sqrt(len(scores)) if len(scores) > 1 else 0.0
    return {"trials": len(scores), "accuracy": sum(s.exact for s in scores) / len(scores),
            "key_log_prob": log_probs.mean().item(), "key_log_prob_se": se,
            "key_log_prob_per_token": log_probs.sum().item() / tokens,
            "argmax_accuracy": sum(s.argmax_hits for s in scores) / tokens}
