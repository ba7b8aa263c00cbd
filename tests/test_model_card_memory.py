"""A model card's memory section (`training.model_card.cache_memory_statement`, printed by
model_cards/model_card.md) against the cache a model really holds: what grows with the context, by how many bytes a
token, what is constant, and the totals, for every layout of tests/helpers.VARIANTS and for softmax heads (in linear,
window and sparse-memory layers), softmax layers and bfloat16 weights."""

import json

import pytest
import torch
from helpers import VARIANTS, tiny_model

import hf_linear_attn
from hf_linear_attn.cache_linear_attention import LinearStateLayer
from hf_linear_attn.training.model_card import cache_memory_statement, exact_bytes, human_bytes, render_model_card

# Two context lengths the cards are rendered at here (a card states 4K and 32K by default): far past the tiny
# layouts' windows (5 positions, 69 with a sparse memory's block) and convolutions.
CONTEXTS = (64, 192)
WINDOW = {"feature_map": "hedgehog", "feature_dim": 8, "window_size": 5, "num_sink_tokens": 2}

LAYOUTS = {
    **{name: (overrides, torch.float32) for name, overrides in VARIANTS.items()},
    "softmax-heads": ({"softmax_heads": {0: [1]}, "rope_position_cap": 256}, torch.float32),
    "window-softmax-heads-and-layer": ({**WINDOW, "softmax_heads": {0: [0, 1]}, "softmax_layers": [1],
                                        "softmax_log_length_scale": 0.4}, torch.float32),
    "sparse-memory-softmax-heads": ({**WINDOW, "decay": "scalar", "sparse_cache_size": 2, "softmax_heads": {1: [0]}},
                                    torch.float32),
    "delta-window-softmax-heads-bfloat16": (
        {**VARIANTS["gated-delta-window-sinks"], "softmax_heads": {0: [1], 1: [0]}}, torch.bfloat16),
}


@torch.no_grad()
def held_bytes(model: hf_linear_attn.LinearAttentionForCausalLM) -> list[tuple[int, int]]:
    """After each of CONTEXTS tokens of one sequence: the cache's bytes (`nbytes`) and those of its full-softmax
    layers' keys and values, read on the way (a prefill of the first context, then a chunk and single-token decode
    steps up to the second)."""
    cache = hf_linear_attn.LinearAttentionCache(model.config)
    ids = torch.randint(3, model.config.vocab_size, (1, CONTEXTS[-1]), generator=torch.Generator().manual_seed(0))
    steps = [(CONTEXTS[0], CONTEXTS[1] - 4), *((t, t + 1) for t in range(CONTEXTS[1] - 4, CONTEXTS[1]))]
    held = []
    for start, end in [(0, CONTEXTS[0]), *steps]:
        model(input_ids=ids[:, start:end], cache=cache, use_cache=True, logits_to_keep=1)
        if end in CONTEXTS:
            softmax_layers = [layer for layer in cache.layers if not isinstance(layer, LinearStateLayer)]
            held.append((cache.nbytes(), sum(t.numel() * t.element_size() for layer in softmax_layers
                                             for t in (layer.keys, layer.values))))
    return held


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_card_states_the_bytes_the_cache_holds(name, tmp_path):
    overrides, dtype = LAYOUTS[name]
    model = tiny_model(**overrides).to(dtype)
    model.save_pretrained(tmp_path)
    (short, layers_short), (long, layers_long) = held_bytes(model)
    grows, remainder = divmod(long - short, CONTEXTS[1] - CONTEXTS[0])
    assert remainder == 0, "the cache grows by a whole number of bytes a token"
    constant = short - CONTEXTS[0] * grows
    has_softmax = bool(model.config.softmax_heads or model.config.softmax_layers)
    assert (grows > 0) == has_softmax  # the layouts: only softmax heads and layers grow

    memory = cache_memory_statement(json.loads((tmp_path / "config.json").read_text()), CONTEXTS)
    assert memory.dtype == str(dtype).removeprefix("torch.")
    assert memory.bytes_per_token == grows and memory.constant_bytes == constant
    assert [row["bytes"] for row in memory.rows] == [short, long]
    assert [memory.total(tokens) for tokens in CONTEXTS] == [short, long]

    card = render_model_card(tmp_path, memory_contexts=CONTEXTS).text
    section = card[card.index("## Memory"):card.index("## Training")]
    assert f"with the weights in {memory.dtype}" in section
    assert ("**Grows with the context**: nothing" in section) == (grows == 0)
    if grows:
        assert f"**Grows with the context**, by {exact_bytes(grows)} a token: " in section
    assert f"**Constant**, {exact_bytes(constant)} at every context length: " in section
    for tokens, held in zip(CONTEXTS, (short, long), strict=True):
        assert f"| {tokens:,} | {human_bytes(held)} |" in section
    heads = sum(len(kv_heads) for kv_heads in model.config.softmax_heads.values())
    assert (f"the keys and values of the {heads} softmax KV head" in section) == (heads > 0)
    softmax_layers = len(model.config.softmax_layers)
    assert (f"the {softmax_layers} full-softmax layer" in section) == (softmax_layers > 0)
    if heads and softmax_layers:  # each growing part's own bytes a token, the softmax layers' read off their layers
        by_layers = (layers_long - layers_short) // (CONTEXTS[1] - CONTEXTS[0])
        assert f"KV heads each ({exact_bytes(by_layers)} a token)" in section
        assert f"(`softmax_heads`) ({exact_bytes(grows - by_layers)} a token)" in section
    cap = model.config.rope_position_cap
    assert ("(`rope_position_cap`)" in card) == bool(cap)
    assert not cap or f"held at position {cap - 1} (`rope_position_cap`)" in card
    beta, trained = model.config.softmax_log_length_scale, model.config.max_position_embeddings
    scaled = f"× (1 + {beta} ln((p + 1) / {trained})) from position {trained - 1} on (`softmax_log_length_scale`)"
    assert (scaled in card) == bool(beta and (heads or softmax_layers))
    assert ("whose key/value cache grows" in card) == has_softmax  # the card's opening says so too


def test_a_statement_needs_positive_contexts_and_a_torch_dtype():
    config = tiny_model().config.to_dict()
    for contexts in ((), (0, 64), (64.0,), (True,)):
        with pytest.raises(ValueError, match="contexts must be positive numbers of tokens"):
            cache_memory_statement(config, contexts)
    with pytest.raises(ValueError, match="'float31' is not a torch dtype"):
        cache_memory_statement({**config, "dtype": "float31"}, CONTEXTS)
