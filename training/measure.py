"""Inference measurements shared by `benchmarks/bench_decode.py`, `training/evaluate.py` and the training
scripts: cache bytes and per-token decode latency after a context, for a linear-attention model or any
transformers causal LM with a `DynamicCache`, and the cache memory of a linear-attention layout.

They live in the installed package (not in `benchmarks/`) because the evaluation and the training runs
record them too; they need only torch, transformers and `hf_linear_attn`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

import hf_linear_attn

CACHE_CONTEXTS = (512, 4096)


def new_cache(model: PreTrainedModel) -> hf_linear_attn.LinearAttentionCache | DynamicCache:
    """An empty cache of the kind `generate()` would build for `model`."""
    if isinstance(model, hf_linear_attn.LinearAttentionForCausalLM):
        return hf_linear_attn.LinearAttentionCache(model.config)
    return DynamicCache(config=model.config)


def cache_bytes(cache: hf_linear_attn.LinearAttentionCache | DynamicCache) -> int:
    """Bytes held by the tensors of `cache`."""
    if isinstance(cache, hf_linear_attn.LinearAttentionCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def prefill(model: PreTrainedModel, cache, length: int, chunk: int) -> torch.Tensor:
    """Feed `length` random tokens (seeded by `length`) through the cache in chunks of `chunk` tokens;
    returns the last position's logits `[1, 1, V]`."""
    generator = torch.Generator().manual_seed(length)
    logits = None
    for start in range(0, length, chunk):
        ids = torch.randint(3, model.config.vocab_size, (1, min(chunk, length - start)), generator=generator)
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    return logits


@torch.no_grad()
def decode_times(model: PreTrainedModel, cache, logits: torch.Tensor, steps: int) -> list[float]:
    """Seconds of each of `steps` greedy decode steps with the cache, starting from `logits`."""
    times = []
    for _ in range(steps):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        logits = model(input_ids=next_id, cache=cache, use_cache=True).logits
        times.append(time.perf_counter() - start)
    return times


def decode_profile(model: PreTrainedModel, contexts: list[int], steps: int, chunk: int) -> list[dict[str, Any]]:
    """Per context length: the cache bytes after prefilling it and the median ms of `steps` decode steps."""
    rows = []
    for context in contexts:
        cache = new_cache(model)
        logits = prefill(model, cache, context, chunk)
        bytes_after_prefill = cache_bytes(cache)
        ms = 1000 * sorted(decode_times(model, cache, logits, steps))[steps // 2]
        rows.append({"context": context, "cache_bytes": bytes_after_prefill, "ms_per_token": ms})
    return rows


def cache_memory(config: dict[str, Any], contexts: tuple[int, ...] = CACHE_CONTEXTS) -> list[dict[str, int]]:
    """Per context length, measured: `linear_bytes`, the cache bytes of one sequence with the attention
    layout of `config` (a linear-attention config as a dict), and `softmax_bytes`, those of the key/value
    cache of a softmax model of the same shape (2 x layers x KV heads x head_dim x tokens).

    The layout (heads, head and feature dimensions, window, decay, softmax layers) runs with tiny
    embeddings and MLPs, so this costs little whatever the model's size."""
    dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    layout = hf_linear_attn.LinearAttentionConfig.from_dict(
        {**config, "vocab_size": 16, "hidden_size": 16, "intermediate_size": 16, "tie_word_embeddings": False}
    )
    model = hf_linear_attn.LinearAttentionForCausalLM(layout).to(dtype).eval()
    item = torch.empty((), dtype=dtype).element_size()
    rows = []
    for tokens in contexts:
        cache = hf_linear_attn.LinearAttentionCache(layout)
        with torch.no_grad():
            model(torch.zeros(1, tokens, dtype=torch.long), cache=cache, use_cache=True)
        softmax = 2 * layout.num_hidden_layers * layout.num_key_value_heads * layout.head_dim * tokens * item
        rows.append({"tokens": tokens, "linear_bytes": cache.nbytes(), "softmax_bytes": softmax})
    return rows
