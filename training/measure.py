"""Inference measurements shared by `benchmarks/bench_decode.py`, `training/evaluate.py` and the training
scripts: per-token decode latency after a context, for a linear-attention model or any transformers causal LM
with a `DynamicCache`, and cache bytes by context. The bytes come from the attention layout (`cache_memory`,
`cache_bytes_by_context`): exactly what a prefilled cache holds (tests/test_long_context.py checks it), at a
fraction of the cost of a prefill of the model.

They live in the installed package (not in `benchmarks/`) because the evaluation and the training runs
record them too; they need only torch, transformers and `hf_linear_attn`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import hf_linear_attn
from hf_linear_attn.cache_linear_attention import (
    GrowingLayer,
    LinearStateLayer,
    SoftmaxHeadsState,
    SparseWindowStateLayer,
    WindowStateLayer,
)
from hf_linear_attn.ops_sparse_memory import MEMORY_BLOCK_SIZE

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
def timed_decode_step(model: PreTrainedModel, cache, logits: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One greedy decode step with the cache after `logits`: its seconds and the new logits."""
    next_id = logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    logits = model(input_ids=next_id, cache=cache, use_cache=True).logits
    return time.perf_counter() - start, logits


def decode_times(model: PreTrainedModel, cache, logits: torch.Tensor, steps: int) -> list[float]:
    """Seconds of each of `steps` greedy decode steps with the cache, starting from `logits`."""
    times = []
    for _ in range(steps):
        seconds, logits = timed_decode_step(model, cache, logits)
        times.append(seconds)
    return times


def extension_period(cache) -> int:
    """The positions by which a cache's bookkeeping repeats: every window layer's ring slot (position mod its ring
    size) and, with a sparse memory, the block that ends (position mod MEMORY_BLOCK_SIZE) are the same after any
    multiple of it (1 for a cache without windows)."""
    sizes = [layer.ring_size for layer in cache.layers if isinstance(layer, WindowStateLayer)]
    sizes += [MEMORY_BLOCK_SIZE for layer in cache.layers if isinstance(layer, SparseWindowStateLayer)]
    return math.lcm(1, *sizes)


def repeated(x: torch.Tensor, positions: int) -> torch.Tensor:
    """`positions` positions of keys or values `x` [B, H, T, D]: its own T positions over and over."""
    return x.repeat(1, 1, -(-positions // x.shape[2]), 1)[:, :, :positions]


def extendable(cache) -> bool:
    """Whether `extend_cache` knows the bookkeeping of every layer of `cache`: this package's state layers and
    transformers' growing `DynamicLayer` (not, for one, a sliding-window layer, which drops old positions)."""
    return all(isinstance(layer, LinearStateLayer) or type(layer) in (DynamicLayer, GrowingLayer)
               for layer in cache.layers)


def extend_cache(cache, positions: int) -> None:
    """Make a prefilled `cache` (`new_cache`) hold `positions` more positions, by shape: every growing key/value
    tensor (softmax layers, softmax heads) gets `positions` more of its own positions repeated, and every
    position counter advances by as many (`positions` a multiple of `extension_period`, so each ring slot and
    memory block stays where a real prefill would leave it). The values are not those a real prefill of the
    longer context would leave, the shapes, positions and bookkeeping are: a decode step does the same work on
    it. Raises, before changing anything, ValueError for another number of positions and TypeError for a cache
    with a layer of another kind (`extendable`)."""
    period = extension_period(cache)
    if positions % period:
        raise ValueError(f"a cache is extended by a multiple of its period {period} positions, got {positions}")
    if not extendable(cache):
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        raise TypeError(f"extend_cache knows this package's state layers and DynamicLayer, not all of {kinds}")
    for layer in cache.layers:
        if isinstance(layer, LinearStateLayer):
            if isinstance(layer, SoftmaxHeadsState):
                layer.update_softmax_heads(repeated(layer.head_keys, positions),
                                           repeated(layer.head_values, positions))
            layer.seen.add_(positions)
        else:
            layer.update(repeated(layer.keys, positions), repeated(layer.values, positions))


def decode_profile(model: PreTrainedModel, contexts: list[int], steps: int, chunk: int,
                   prefilled: int) -> list[dict[str, Any]]:
    """Per context length: the median ms of `steps` decode steps with a cache of that many positions, every
    context's cache held at once and their steps taken in turns after one untimed step each (the cache bytes at a
    context are `cache_bytes_by_context`'s, from the layout, without a prefill). A context up to
    `prefilled` tokens is prefilled for real (in chunks of `chunk`); a longer one prefills about `prefilled` and
    extends the cache to the context by shape (`extend_cache`; a cache it cannot extend is prefilled for real):
    a decode step's cost depends on the cache's shapes, not its values, and a real prefill of 16K tokens took
    SmolLM2-135M about 2 minutes on 2 CPU cores (its attention alone is ~9 TFLOP), for decode steps that time the
    same on either cache (docs/design.md, "Decode after a long context, measured by shape")."""
    caches, last_logits = [], []
    for context in contexts:
        cache = new_cache(model)
        period = extension_period(cache)
        extra = max(0, context - prefilled) // period * period if extendable(cache) else 0
        logits = prefill(model, cache, context - extra, chunk)
        if extra:
            extend_cache(cache, extra)
        caches.append(cache)
        last_logits.append(timed_decode_step(model, cache, logits)[1])  # untimed: the first step allocates
    # One step of each context in turn, so that a change in the machine's speed during the run (other processes,
    # clocks) reaches every context alike and their ratio holds: timed one context after the other, the same
    # model's 1K time read 47 ms in one run and 71 ms in the next (docs/design.md).
    times = [[] for _ in contexts]
    for _ in range(steps):
        for i, cache in enumerate(caches):
            seconds, last_logits[i] = timed_decode_step(model, cache, last_logits[i])
            times[i].append(seconds)
    return [{"context": context, "ms_per_token": 1000 * sorted(steps_times)[steps // 2]}
            for context, steps_times in zip(contexts, times, strict=True)]


def softmax_cache_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of the key/value cache that `DynamicCache(config=config)` holds after `tokens` tokens of one
    sequence: per layer 2 x KV heads x head_dim x the tokens it keeps (all of them; at most `sliding_window - 1`,
    the most transformers' `DynamicSlidingWindowLayer` keeps, in a sliding-window layer) x bytes per value."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_key_value_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return sum(per_token * (min(tokens, layer.sliding_window - 1) if isinstance(layer, DynamicSlidingWindowLayer)
                            else tokens) for layer in DynamicCache(config=config).layers)


def layout_model(config: dict[str, Any], dtype: torch.dtype) -> hf_linear_attn.LinearAttentionForCausalLM:
    """A model with the attention layout of `config` (a linear-attention config as a dict: heads, head and feature
    dimensions, window, sinks, decay, convolution, softmax layers and heads) and tiny embeddings and MLPs, which the
    cache does not depend on, in `dtype`: its cache holds what the checkpoint's would, at a fraction of the cost."""
    layout = hf_linear_attn.LinearAttentionConfig.from_dict(
        {**config, "vocab_size": 16, "hidden_size": 16, "intermediate_size": 16, "tie_word_embeddings": False}
    )
    return hf_linear_attn.LinearAttentionForCausalLM(layout).to(dtype).eval()


def layout_cache(model: hf_linear_attn.LinearAttentionForCausalLM, tokens: int) -> hf_linear_attn.LinearAttentionCache:
    """The cache of one sequence after `tokens` tokens through `model` (a `layout_model`)."""
    cache = hf_linear_attn.LinearAttentionCache(model.config)
    prefill(model, cache, tokens, chunk=tokens)
    return cache


def layout_probe(config: hf_linear_attn.LinearAttentionConfig) -> int:
    """A context past which every part of a cache with `config`'s layout is constant or grows by the same bytes a
    token: it covers the window, the sinks and the convolution inputs."""
    return config.window_size + config.num_sink_tokens + config.conv_size + 1


def linear_cache_bytes(config: dict[str, Any], contexts: Iterable[int], dtype: torch.dtype) -> list[int]:
    """Per context length, the bytes of a `LinearAttentionCache` of one sequence for the attention layout of
    `config` (a linear-attention config as a dict) with values of `dtype`, from its `layout_model`.

    A linear layer's cache has one size once its window ring, sinks and convolution inputs are allocated, and a
    softmax layer's grows by one key and value a token, so the bytes are affine in the context beyond a short one:
    the layout runs at `p` and `2p` tokens (`layout_probe`) and longer contexts are extended from those two, so the
    cost does not grow with the context."""
    model = layout_model(config, dtype)
    probe = layout_probe(model.config)
    base = layout_cache(model, probe).nbytes()
    per_token = (layout_cache(model, 2 * probe).nbytes() - base) // probe
    return [layout_cache(model, tokens).nbytes() if tokens < probe else base + (tokens - probe) * per_token
            for tokens in contexts]


def cache_bytes_by_context(model: PreTrainedModel, contexts: Iterable[int]) -> list[int]:
    """Per context length, the bytes of the decoding cache (`new_cache(model)`) after that many tokens of one
    sequence, computed from the model's attention layout and dtype rather than by a prefill of the model."""
    contexts = list(contexts)
    if isinstance(model, hf_linear_attn.LinearAttentionForCausalLM):
        return linear_cache_bytes(model.config.to_dict(), contexts, model.dtype)
    return [softmax_cache_bytes(model.config, tokens, model.dtype) for tokens in contexts]


def checkpoint_dtype(config: dict[str, Any]) -> torch.dtype:
    """The dtype of a checkpoint's weights, from its config (a dict; float32 when it names none)."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the config's dtype {name!r} is not a torch dtype (e.g. float32, bfloat16, float16)")
    return dtype


def cache_memory(config: dict[str, Any], contexts: tuple[int, ...] = CACHE_CONTEXTS) -> list[dict[str, int]]:
    """Per context length: `linear_bytes`, the cache bytes of one sequence with the attention layout of `config`
    (a linear-attention config as a dict, in its own dtype; `linear_cache_bytes`), and `softmax_bytes`, those of
    the key/value cache of a softmax model of the same shape (2 x layers x KV heads x head_dim x tokens)."""
    dtype = checkpoint_dtype(config)
    shape = hf_linear_attn.LinearAttentionConfig.from_dict(config)
    return [{"tokens": tokens, "linear_bytes": linear, "softmax_bytes": softmax_cache_bytes(shape, tokens, dtype)}
            for tokens, linear in zip(contexts, linear_cache_bytes(config, contexts, dtype), strict=True)]
