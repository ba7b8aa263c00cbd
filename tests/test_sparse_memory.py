"""The window hybrid's sparse exact memory (`sparse_cache_size`, `ops_sparse_memory`): the fast path against the
rule's literal oracle, the model's chunked prefill / decode / generate against its full forward, the cache, the
config checks."""

import pytest
import torch
import torch.nn.functional as F
from helpers import left_pad, prompts, tiny_model

from hf_linear_attn import (
    LinearAttentionCache,
    LinearAttentionConfig,
    cache_linear_attention,
    modeling_linear_attention,
    ops,
)
from hf_linear_attn.cache_linear_attention import SparseWindowStateLayer
from hf_linear_attn.ops_sparse_memory import reference_sparse_window_attention, sparse_window_attention

BLOCK = 4  # R in the tests: block ends at lengths the oracle and the tiny model can afford
WINDOW = dict(feature_map="hedgehog", feature_dim=8, window_size=5, num_sink_tokens=2, decay_low_rank_dim=4)


HEADS = 4  # H of the op's test inputs (H_kv = 2)


def key_map(k):
    """A key feature map for the op: k [B, T, H_kv, 8] -> positive φ_h [B, T, H, 6], distinct per query head h
    (elementwise, so it gives the same features for a key whatever the shape it comes in)."""
    k = k.repeat_interleave(HEADS // k.shape[2], dim=2)[..., :6]
    h = torch.arange(HEADS, dtype=k.dtype)[:, None]
    return (k * (1 + h / 2) + h / 10).sigmoid()


def op_inputs(length, *, batch=2, kv_heads=2, decay=None, dtype=torch.float32, seed=0):
    """q [B, T, H, 8], k [B, T, H_kv, 8], v [B, T, H_kv, 5], positive features [·, 6] (k_feat = key_map(k)), a log
    decay a ≈ 0.7 .. 1."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    tensors = {
        "q": randn(batch, length, HEADS, 8), "k": randn(batch, length, kv_heads, 8),
        "v": randn(batch, length, kv_heads, 5), "q_feat": randn(batch, length, HEADS, 6).sigmoid(),
        "window_gate": randn(HEADS),
    }
    if decay is not None:
        shape = {"scalar": (batch, length, HEADS), "vector": (batch, length, HEADS, 6)}[decay]
        tensors["log_decay"] = F.logsigmoid(randn(*shape) * 2 + 3)
    tensors = {name: x.to(dtype) for name, x in tensors.items()}
    return {**tensors, "k_feat": key_map(tensors["k"])}


def held_positions(memory):
    """[B, H_kv, m] positions held, ascending, −1 in empty slots (the oracle's layout)."""
    positions = torch.where(memory.mask, memory.positions, torch.iinfo(torch.long).max).sort(-1).values
    return torch.where(positions == torch.iinfo(torch.long).max, -1, positions)


@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 3])
def test_fast_path_matches_the_rule(decay, sinks, dtype, start):
    # 23 inputs: five block ends and a partial last block (blocks cut at start + index multiples of 4).
    inputs = op_inputs(23, decay=decay, dtype=dtype)
    mask = torch.ones(2, 23, dtype=torch.bool)
    mask[1, :6] = False  # left padding
    options = dict(window_size=4, num_sink_tokens=sinks, memory_size=3, scale=0.4, key_padding_mask=mask,
                   block_size=BLOCK, start_position=start)
    expected, positions = reference_sparse_window_attention(**inputs, **options)
    o, state, memory = sparse_window_attention(**inputs, key_feature_map=key_map, output_final_state=True,
                                               **options)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o, expected, atol=tolerance, rtol=tolerance)
    assert o.dtype == dtype and (o[1, :6] == 0).all()  # pad queries output 0
    assert torch.equal(held_positions(memory), torch.where(positions >= 0, positions + start, -1))
    assert (positions >= 0).all()  # every slot used: the memory matters here


def test_initial_state_and_a_memory_larger_than_the_tokens_that_left():
    inputs = op_inputs(11, decay="scalar", seed=3)
    state = torch.rand(2, 4, 6, 6)
    options = dict(window_size=4, num_sink_tokens=1, memory_size=20, scale=0.4, initial_state=state,
                   block_size=BLOCK)
    expected, positions = reference_sparse_window_attention(**inputs, **options)
    o, _, memory = sparse_window_attention(**inputs, key_feature_map=key_map, output_final_state=True,
                                           **options)
    torch.testing.assert_close(o, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(held_positions(memory), positions)
    # Block ends after queries 3 and 7: tokens 0 .. 3 have left by the second, token 0 is the sink.
    assert memory.mask.sum(-1).eq(3).all()


def test_a_memory_holding_everything_is_causal_softmax_attention():
    """No initial state and m ≥ T: nothing stays in the linear part, and γ cancels: exact softmax attention."""
    inputs = op_inputs(70, decay="vector", seed=1)
    o, _, _ = sparse_window_attention(**inputs, key_feature_map=key_map, window_size=6, num_sink_tokens=2,
                                      memory_size=70, scale=0.3, block_size=BLOCK)
    q, k, v = (x.transpose(1, 2) for x in (inputs["q"], inputs["k"], inputs["v"]))
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              is_causal=True, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(o, expected, atol=1e-5, rtol=1e-5)


def test_full_resets_match_the_rule_and_gradients_stay_finite():
    inputs = op_inputs(23, decay="vector", seed=2)
    inputs["log_decay"][:, 12] = -torch.inf  # a full reset of the linear part (the memory keeps its tokens)
    options = dict(window_size=4, num_sink_tokens=1, memory_size=3, scale=0.4, block_size=BLOCK)
    expected, _ = reference_sparse_window_attention(**inputs, **options)
    for x in inputs.values():
        x.requires_grad_()
    o, _, _ = sparse_window_attention(**inputs, key_feature_map=key_map, **options)
    torch.testing.assert_close(o, expected, atol=1e-5, rtol=1e-5)
    o.square().sum().backward()
    for name, x in inputs.items():
        assert x.grad is not None and x.grad.isfinite().all(), name


def test_op_refuses_bad_memory_and_block_sizes():
    inputs = op_inputs(8)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="memory_size"):
            sparse_window_attention(**inputs, key_feature_map=key_map, window_size=4, num_sink_tokens=0,
                                    memory_size=bad, scale=0.4)
        with pytest.raises(ValueError, match="block_size"):
            sparse_window_attention(**inputs, key_feature_map=key_map, window_size=4, num_sink_tokens=0,
                                    memory_size=2, scale=0.4, block_size=bad)
    with pytest.raises(TypeError, match="key_feature_map must be a callable"):
        sparse_window_attention(**inputs, key_feature_map=inputs["k_feat"], window_size=4, num_sink_tokens=0,
                                memory_size=2, scale=0.4)


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """The model runs with R = BLOCK: its tiny prompts then cross several block ends."""
    for module in (modeling_linear_attention, cache_linear_attention, ops):
        monkeypatch.setattr(module, "MEMORY_BLOCK_SIZE", BLOCK)


def memories(cache):
    """Per linear layer: (held positions ascending, their scores) — what the memory holds."""
    out = []
    for layer in cache.layers:
        memory = layer.memory()
        order = torch.where(memory.mask, memory.positions, torch.iinfo(torch.long).max).argsort(-1)
        out.append((held_positions(memory), memory.scores.gather(-1, order) * memory.mask.gather(-1, order)))
    return out


@pytest.mark.parametrize("decay", ["none", "scalar", "vector"])
def test_chunked_prefill_and_decode_match_the_full_forward(decay):
    model = tiny_model(**WINDOW, decay=decay, sparse_cache_size=3)
    ids, mask = left_pad(prompts([30, 23]))
    with torch.no_grad():
        whole = LinearAttentionCache(model.config)
        full = model(ids, attention_mask=mask, cache=whole).logits
        for chunk in (1, 3, 17, 70):  # chunk 1: the one-token decode step after the first token
            cache = LinearAttentionCache(model.config)
            logits = torch.cat([model(ids[:, s : s + chunk], attention_mask=mask[:, : s + chunk], cache=cache).logits
                                for s in range(0, ids.shape[1], chunk)], dim=1)
            torch.testing.assert_close(logits, full, atol=2e-5, rtol=2e-5)
            for layer, whole_layer in zip(cache.layers, whole.layers, strict=True):
                torch.testing.assert_close(layer.state, whole_layer.state, atol=1e-5, rtol=1e-5)
            pairs = zip(memories(cache), memories(whole), strict=True)
            for (positions, scores), (expected_positions, expected_scores) in pairs:
                assert torch.equal(positions, expected_positions)
                torch.testing.assert_close(scores, expected_scores, atol=1e-5, rtol=1e-5)
    assert (memories(whole)[0][0] >= 0).all()  # the memory is full: it took part


def test_the_memory_changes_the_outputs_and_m_zero_never_reaches_it(monkeypatch):
    ids, mask = left_pad(prompts([30, 23]))
    with torch.no_grad():
        sparse = tiny_model(**WINDOW, decay="scalar", sparse_cache_size=3)(ids, attention_mask=mask).logits
        model = tiny_model(**WINDOW, decay="scalar")

        def unreachable(*args, **kwargs):
            raise AssertionError("the sparse memory ran with sparse_cache_size = 0")

        monkeypatch.setattr(ops, "sparse_window_attention", unreachable)
        monkeypatch.setattr(modeling_linear_attention, "block_end", unreachable)
        monkeypatch.setattr(SparseWindowStateLayer, "store_memory", unreachable)
        cache = LinearAttentionCache(model.config)
        plain = model(ids, attention_mask=mask, cache=cache).logits
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert not any(name.startswith("memory_") or name == "window_log_decay"
                   for layer in cache.layers for name in layer.tensors())
    assert cache.layers[0].window_keys.shape[1] == WINDOW["window_size"] + WINDOW["num_sink_tokens"]
    assert not torch.allclose(sparse, plain, atol=1e-3)


def test_greedy_generate_matches_the_full_forward():
    model = tiny_model(**WINDOW, decay="scalar", sparse_cache_size=2)
    ids, mask = left_pad(prompts([14, 9]))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
        full_mask = torch.cat([mask, torch.ones(2, 12, dtype=mask.dtype)], dim=1)
        logits = model(out[:, :-1], attention_mask=full_mask[:, :-1], use_cache=False).logits
    assert torch.equal(out[:, ids.shape[1] :], logits[:, ids.shape[1] - 1 :].argmax(-1))


def test_decode_is_fixed_shape_and_the_cache_constant_in_length():
    model = tiny_model(**WINDOW, decay="vector", sparse_cache_size=3)
    sizes = []
    for length in (12, 40):
        cache = LinearAttentionCache(model.config)
        with torch.no_grad():
            model(prompts([length])[0][None], cache=cache)
            buffers = {name: x.data_ptr() for name, x in cache.layers[0].tensors().items()}
            for token in range(3):
                model(torch.tensor([[5 + token]]), cache=cache)
        assert {name: x.data_ptr() for name, x in cache.layers[0].tensors().items()} == buffers
        assert {"memory_keys", "memory_log_decay", "memory_mask", "window_log_decay"} <= set(buffers)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1]
    assert SparseWindowStateLayer.is_compileable


@pytest.mark.parametrize("decay", ["none", "vector"])
def test_memory_slots_hold_keys_not_features(decay):
    """The memory's bytes are its keys, values, scores, positions, log decays and mask (plus R more ring positions
    and the ring's log decays): no per-query-head features for its slots."""
    size, sinks, window = 8, WINDOW["num_sink_tokens"], WINDOW["window_size"]
    caches = {}
    for m in (0, size):
        model = tiny_model(**WINDOW, decay=decay, sparse_cache_size=m)
        caches[m] = LinearAttentionCache(model.config)
        with torch.no_grad():
            model(prompts([3 * BLOCK + 1])[0][None], cache=caches[m])
    config, layer = model.config, caches[size].layers[0]
    item = layer.window_keys.element_size()
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    features = layer.state.shape[2]  # [B, H, F, V + 1]
    decay_dim = {"none": 0, "vector": features}[decay]
    ring_slot = 2 * kv_heads * head_dim * item + 1  # key, value, mask (no φ: recomputed from the key)
    memory_slot = kv_heads * (2 * head_dim * item + 4 + 8 + 1) + heads * decay_dim * 4  # ..., scores, pos, mask
    per_layer = BLOCK * ring_slot + (sinks + window + BLOCK) * heads * decay_dim * 4 + size * memory_slot
    assert caches[size].nbytes() - caches[0].nbytes() == len(caches[size].layers) * per_layer
    assert layer.memory().keys.shape == (1, kv_heads, size, head_dim)


def test_set_on_a_loaded_config_it_takes_effect_and_old_caches_are_refused(tmp_path):
    tiny_model(**WINDOW, decay="scalar").save_pretrained(tmp_path)
    model = type(tiny_model(**WINDOW)).from_pretrained(tmp_path).eval()
    ids = prompts([25])[0][None]
    with torch.no_grad():
        old_cache = LinearAttentionCache(model.config)
        model(ids, cache=old_cache)
        model.config.sparse_cache_size = 3
        switched = model(ids, use_cache=False).logits
        expected = tiny_model(**WINDOW, decay="scalar", sparse_cache_size=3)(ids, use_cache=False).logits
        torch.testing.assert_close(switched, expected)
        at_load = type(model).from_pretrained(tmp_path, sparse_cache_size=3).eval()
        torch.testing.assert_close(at_load(ids, use_cache=False).logits, expected)
        with pytest.raises(ValueError, match="sparse_cache_size=0 .model: 3"):
            model(ids[:, :1], cache=old_cache)
        model.config.sparse_cache_size = -2
        with pytest.raises(ValueError, match="sparse_cache_size"):
            model(ids)


@pytest.mark.parametrize("options, message", [
    ({"window_size": 4, "sparse_cache_size": -1}, "integer >= 0"),
    ({"sparse_cache_size": 4}, "needs the window hybrid"),
    ({"update_rule": "delta", "normalize": False, "feature_map": "identity", "sparse_cache_size": 4},
     "pass sparse_cache_size=0 with update_rule='delta'"),
])
def test_config_refuses_bad_sparse_cache_sizes(options, message):
    with pytest.raises(ValueError, match=message):
        LinearAttentionConfig(**options)
    with pytest.raises(TypeError, match="sparse_cache_size"):
        LinearAttentionConfig(window_size=4, sparse_cache_size=2.5)
