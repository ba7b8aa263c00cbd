"""Rank the key/value heads of a model by how much they retrieve, and choose which keep exact softmax attention.

Retrieval in a transformer is done by a few heads ("retrieval heads"): when the model copies a fact it read far back,
these heads' queries land on the tokens being copied. A head-level hybrid (`LinearAttentionConfig.softmax_heads`)
spends its exact budget on them. This module measures it on prompts that state an answer somewhere in a long text and
end with a question followed by the answer itself (teacher-forced, `RetrievalPrompt`):

    scores = retrieval_scores(teacher, prompts)      # [L, H_kv]: attention mass on the answer where it was read
    heads = top_heads(scores, n=9)                   # {layer: [kv heads]}, the 9 best, for softmax_heads

`retrieval_scores` works on any transformers model whose attention goes through `AttentionInterface` (Llama,
Mistral, Qwen2, Qwen3: the teachers conversion starts from): for each layer it runs an ordinary SDPA forward and, on
the side, the softmax rows of the queries that predict the answer's tokens, and records the mass they put on the
answer's tokens where the prompt states them. Per KV head the score is the mean over its query group, the predicting
positions and the prompts (a smooth version of Wu et al.'s retrieval score, which counts how often a head's strongest
attention lands on the copied token).

This module is library code for conversion scripts; the model file does not import it, so it does not ship in
checkpoints.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AttentionInterface, PreTrainedModel

from .configuration_linear_attention import InputError

# The name under which the probing attention function is registered with transformers' AttentionInterface.
PROBE_IMPLEMENTATION = "hf_linear_attn_retrieval_probe"


@dataclass(frozen=True)
class RetrievalPrompt:
    """One teacher-forced retrieval prompt: `input_ids` [1, T] state an answer inside a long text and end with a
    question followed by the answer's tokens. `needle` and `answer` are the [start, end) positions of the answer's
    tokens where the text states them and at the end of the prompt; both hold the same tokens."""

    input_ids: torch.Tensor
    needle: tuple[int, int]
    answer: tuple[int, int]

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be one row [1, T], got shape {list(self.input_ids.shape)}")
        length = self.input_ids.shape[1]
        (n0, n1), (a0, a1) = self.needle, self.answer
        if not 0 <= n0 < n1 <= a0 < a1 == length:
            raise ValueError(f"needle {self.needle} must lie before answer {self.answer}, and the answer must end the "
                             f"prompt of {length} tokens")
        if n1 - n0 != a1 - a0 or not torch.equal(self.input_ids[0, n0:n1], self.input_ids[0, a0:a1]):
            raise ValueError(f"the tokens at needle {self.needle} and answer {self.answer} must be the same")


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query [B, H, T, D], key, value [B, H_kv, T, D] -> ([B, T, H, D],
    None). Causal SDPA over one unpadded row; records, in `module._retrieval_probe`, the needle mass of the rows it
    was asked about (see `_probing`)."""
    if key.shape[2] != query.shape[2]:
        raise ValueError("retrieval_scores runs whole prompts without a cache")
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    probe = module._retrieval_probe
    rows, (n0, n1) = probe["rows"], probe["needle"]
    heads, kv_heads = query.shape[1], key.shape[1]
    keys = key.repeat_interleave(heads // kv_heads, dim=1)[:, :, : rows[-1] + 1].float()  # [1, H, S', D]
    scores = query[:, :, rows].float() @ keys.transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)  # [1, H, R, S']
    future = torch.arange(keys.shape[2], device=query.device) > torch.as_tensor(rows, device=query.device)[:, None]
    probabilities = scores.masked_fill(future, float("-inf")).softmax(-1)
    mass = probabilities[..., n0:n1].sum(-1).mean(-1)[0]  # [H]
    probe["mass"] = mass.view(kv_heads, heads // kv_heads).mean(-1)  # [H_kv]
    return out.transpose(1, 2), None


def _not_probed(model: PreTrainedModel) -> str:
    return (f"{type(model).__name__} does not run its attention through transformers' AttentionInterface; "
            "retrieval_scores measures teachers such as Llama, Mistral, Qwen2, Qwen3")


@contextmanager
def _probing(model: PreTrainedModel) -> Iterator[list[torch.nn.Module]]:
    """The model with its attention switched to `_probe_attention`, yielding its attention modules (those with a
    `layer_idx`, in layer order); the implementation it had is set back afterwards."""
    AttentionInterface.register(PROBE_IMPLEMENTATION, _probe_attention)
    modules = sorted((m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")),
                     key=lambda m: m.layer_idx)
    if not modules or not model._can_set_attn_implementation():
        raise InputError(_not_probed(model))
    previous = model.config._attn_implementation
    model.set_attn_implementation(PROBE_IMPLEMENTATION)
    try:
        yield modules
    finally:
        model.set_attn_implementation(previous)
        for module in modules:
            module.__dict__.pop("_retrieval_probe", None)


@torch.no_grad()
def retrieval_scores(model: PreTrainedModel, prompts: Sequence[RetrievalPrompt], progress: bool = True
                     ) -> torch.Tensor:
    """[L, H_kv] fp32: per layer and KV head, the attention mass that the queries predicting the answer's tokens
    (positions answer[0] - 1 … answer[1] - 2) put on the needle, averaged over the head's query group, those
    positions and `prompts`. Higher means the head reads the answer where it was written."""
    if not prompts:
        raise InputError("retrieval_scores needs at least one prompt")
    device = next(model.parameters()).device
    total = None
    with _probing(model) as modules:
        for prompt in tqdm(prompts, desc="retrieval scores", disable=not progress):
            rows = list(range(prompt.answer[0] - 1, prompt.answer[1] - 1))
            for module in modules:
                module._retrieval_probe = {"rows": rows, "needle": prompt.needle}
            model(input_ids=prompt.input_ids.to(device), use_cache=False, logits_to_keep=1)
            if not all("mass" in module._retrieval_probe for module in modules):  # an attention that bypassed it
                raise InputError(_not_probed(model))
            masses = torch.stack([module._retrieval_probe["mass"].cpu() for module in modules])  # [L, H_kv]
            total = masses if total is None else total + masses
    return total / len(prompts)


@dataclass(frozen=True)
class SoftmaxHeadSpec:
    """A parsed `softmax_heads` argument: explicit `heads` ({layer: [kv_head, ...]}), or the `auto_n` KV heads that
    retrieve most (`retrieval_scores`, `top_heads`)."""

    heads: dict[int, list[int]] = field(default_factory=dict)
    auto_n: int | None = None


HEAD_SPEC_FORMS = 'LAYER:HEAD[,HEAD...] items ("17:0,2 20:1"), a dict {layer: [kv_head, ...]} or "auto:N"'


def parse_softmax_heads(spec: str | Sequence[str] | dict | None) -> SoftmaxHeadSpec:
    """Parse a `softmax_heads` argument: None or empty (no head; empty words are skipped, so `--softmax_heads ""`
    unsets a recipe's heads), a dict (as a config holds it), LAYER:HEAD,HEAD items (a string, or the words of a command
    line: `--softmax_heads 17:0,2 20:1`), or "auto:N" alone with N ≥ 1. Only the form is checked here; the indices are
    checked against the model by its config. Raises InputError naming `softmax_heads`."""
    if spec is None or isinstance(spec, dict):
        return SoftmaxHeadSpec(heads=dict(spec or {}))
    words = [word for word in (spec.split() if isinstance(spec, str) else spec) if str(word).strip()]
    if len(words) == 1 and str(words[0]).lower().startswith("auto"):
        match = re.fullmatch(r"auto:(\d+)", str(words[0]).lower())
        if match is None or int(match.group(1)) < 1:
            raise InputError(f"softmax_heads={spec!r}: auto:N needs a number of KV heads N ≥ 1, e.g. auto:9")
        return SoftmaxHeadSpec(auto_n=int(match.group(1)))
    heads: dict[int, list[int]] = {}
    for word in words:
        match = re.fullmatch(r"(\d+):(\d+(?:,\d+)*)", str(word))
        if match is None:
            raise InputError(f"softmax_heads={spec!r}: {word!r} is not a LAYER:HEAD[,HEAD...] item; expected "
                             f"{HEAD_SPEC_FORMS}")
        heads.setdefault(int(match.group(1)), []).extend(int(h) for h in match.group(2).split(","))
    return SoftmaxHeadSpec(heads=heads)


def top_heads(scores: torch.Tensor, n: int, exclude_layers: Sequence[int] = (),
              taken: dict[int, Sequence[int]] | None = None) -> dict[int, list[int]]:
    """The `n` highest-scoring (layer, KV head) pairs of `scores` [L, H_kv], outside `exclude_layers` (e.g. the
    softmax layers, whose heads are all exact already) and the heads of `taken` ({layer: [kv_head, ...]}, heads a
    model keeps exact already), as {layer: sorted heads} (the form of `softmax_heads`)."""
    layers, kv_heads = scores.shape
    skip = {(layer, head) for layer, heads in (taken or {}).items() for head in heads}
    allowed = [(layer, head) for layer in range(layers) if layer not in set(exclude_layers) for head in range(kv_heads)
               if (layer, head) not in skip]
    if not 0 <= n <= len(allowed):
        raise InputError(f"n must be in [0, {len(allowed)}] (the KV heads outside the excluded layers and the heads "
                         f"taken already), got {n}")
    ranked = sorted(allowed, key=lambda lh: (-float(scores[lh]), lh))[:n]
    chosen: dict[int, list[int]] = {}
    for layer, head in sorted(ranked):
        chosen.setdefault(layer, []).append(head)
    return chosen


__all__ = ["RetrievalPrompt", "SoftmaxHeadSpec", "parse_softmax_heads", "retrieval_scores", "top_heads"]
