"""torch.compile of the decode step: no graph breaks, one graph for every step, the eager tokens.

Compiling on the CPU is slow (inductor generates and builds C++), so most tests trace with dynamo's "eager" /
"aot_eager" backends, which check the same graph capture (breaks, shapes, guards) in seconds; one test runs
inductor itself on the smallest hybrids, which takes tens of seconds and cannot be made shorter.
"""

import pytest
import torch
from helpers import VARIANTS, left_pad, prompts, tiny_model
from transformers import CompileConfig

from hf_linear_attn import LinearAttentionCache, cache_linear_attention, modeling_linear_attention, ops

GREEDY = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
# Linear, decayed linear, every kind of hybrid and the delta rule with its convolution (alone and with the window).
COMPILED_VARIANTS = ["elu", "identity-fixed-decay", "hedgehog-window-sinks", "hedgehog-window-sinks-vector-decay",
                     "gated-delta-conv", "gated-delta-window-sinks"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def prefilled(model, batch=2):
    """A left-padded batch prefilled eagerly: (cache, next token ids [B, 1], mask over past + next [B, T + 1])."""
    ids, mask = left_pad(prompts([9, 5][:batch], seed=1))
    cache = LinearAttentionCache(model.config)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, cache=cache).logits
    return cache, logits[:, -1:].argmax(-1), torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)


def test_cache_is_compileable_unless_a_layer_is_softmax():
    for name in ("elu", "hedgehog-window-sinks", "gated-delta-conv"):
        assert LinearAttentionCache(tiny_model(**VARIANTS[name]).config).is_compileable
    assert not LinearAttentionCache(tiny_model(**VARIANTS["qwen3-like-hybrid"]).config).is_compileable


@pytest.mark.parametrize("name", COMPILED_VARIANTS)
def test_decode_step_has_no_graph_breaks(name):
    model = tiny_model(**VARIANTS[name])
    cache, next_ids, mask = prefilled(model)
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(next_ids, attention_mask=mask, cache=cache)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    assert cache.get_seq_length() == mask.shape[1]  # the traced step ran and advanced the cache once


@pytest.mark.parametrize("name", ["elu", "hedgehog-window-sinks-scalar-decay", "gated-delta-window-sinks"])
def test_every_decode_step_runs_the_same_graph(name):
    """The position counter is a tensor and every buffer keeps its shape: no recompilation from step to step."""
    model = tiny_model(**VARIANTS[name])
    ids = torch.randint(3, 128, (2, 7))
    cache = LinearAttentionCache(model.config)
    step = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad():
        next_ids = model(ids, cache=cache).logits[:, -1:].argmax(-1)
        for _ in range(6):
            next_ids = step(next_ids, cache=cache).logits[:, -1:].argmax(-1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert cache.get_seq_length() == 13


@pytest.mark.parametrize("name", COMPILED_VARIANTS)
def test_generate_with_a_compiled_forward_gives_the_eager_tokens(name):
    """generate() compiles its decode steps when the cache is compileable and a compile_config asks for it on the
    CPU (fullgraph: a graph break would raise); a left-padded batch decodes the same tokens as eager."""
    model = tiny_model(**VARIANTS[name])
    ids, mask = left_pad(prompts([9, 5], seed=1))
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode="default")
    config._compile_all_devices = True  # generate() compiles only on accelerators unless told otherwise
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)
    compiled = model.generate(ids, attention_mask=mask, max_new_tokens=6, compile_config=config, **GREEDY)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    torch.testing.assert_close(compiled, eager)


def test_compiled_decode_with_a_sparse_memory_gives_the_eager_logits(monkeypatch):
    """Traced, the memory's block end runs at every step and is kept only where a block ends (no branch on a
    value): compiled steps through several block ends (blocks of 4 here) give the eager logits, in one graph."""
    for module in (modeling_linear_attention, cache_linear_attention, ops):
        monkeypatch.setattr(module, "MEMORY_BLOCK_SIZE", 4)
    model = tiny_model(**VARIANTS["hedgehog-window-sinks-scalar-decay-sparse-memory"])
    ids, feed = torch.randint(3, 128, (2, 11)), torch.randint(3, 128, (2, 10))
    logits = {}
    for compiled in (False, True):
        step = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False) if compiled else model
        cache = LinearAttentionCache(model.config)
        with torch.no_grad():
            model(ids, cache=cache)
            logits[compiled] = torch.cat([step(feed[:, i : i + 1], cache=cache).logits for i in range(10)], dim=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(logits[True], logits[False])


@pytest.mark.parametrize("name", ["hedgehog-window-sinks", "gated-delta-window-sinks"])
def test_inductor_compiled_decode_gives_the_eager_tokens(name):
    """The real compiler (inductor, C++ on the CPU: tens of seconds, the one unavoidable cost here) on the hybrids."""
    model = tiny_model(**VARIANTS[name], num_hidden_layers=1)
    ids = torch.randint(3, 128, (1, 8))
    tokens = {}
    for compiled in (False, True):
        step = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
        cache = LinearAttentionCache(model.config)
        with torch.no_grad():
            next_ids = model(ids, cache=cache).logits[:, -1:].argmax(-1)
            out = [next_ids]
            for _ in range(4):
                out.append(step(out[-1], cache=cache).logits[:, -1:].argmax(-1))
        tokens[compiled] = torch.cat(out, dim=1)
    torch.testing.assert_close(tokens[True], tokens[False])
