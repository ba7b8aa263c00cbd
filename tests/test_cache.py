"""LinearAttentionCache: every decoding strategy with the cache equals the same without it."""

import pytest
import torch
from helpers import VARIANTS, left_pad, prompts, tiny_config, tiny_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hf_linear_attn import LinearAttentionCache, modeling_linear_attention
from hf_linear_attn.cache_linear_attention import GrowingLayer, appended, state_layer
from hf_linear_attn.modeling_linear_attention import OUTPUT_CACHE_FIELD


def returned_cache(output):
    """The cache an output carries (`cache` since transformers 5.24, `past_key_values` before)."""
    return getattr(output, OUTPUT_CACHE_FIELD)

HYBRID_DECAY_VARIANTS = [f"hedgehog-window-sinks-{decay}-decay" for decay in ("fixed", "scalar", "vector")]
CACHED_VARIANTS = ["elu", "identity-fixed-decay", "t2r-vector-decay", "hedgehog-window-sinks", "qwen3-like-hybrid",
                   "delta", "gated-delta-conv", "gated-delta-window-sinks", *HYBRID_DECAY_VARIANTS]
GREEDY = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}


@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_then_decode_equals_full_forward(name):
    model = tiny_model(**VARIANTS[name])
    ids = torch.randint(3, 128, (2, 45))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :31], use_cache=True)
        cache, steps = returned_cache(out), [out.logits]
        for i in range(31, 45):
            out = model(ids[:, i : i + 1], cache=cache)
            assert returned_cache(out) is cache
            steps.append(out.logits)
    assert cache.get_seq_length() == 45
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", VARIANTS)
def test_chunked_prefill_through_forward_equals_one_shot(name):
    model = tiny_model(**VARIANTS[name])
    ids = torch.randint(3, 128, (1, 100))
    cache = LinearAttentionCache(model.config)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        chunks = [model(ids[:, s : s + 17], cache=cache).logits for s in range(0, 100, 17)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["hedgehog-window-sinks", *HYBRID_DECAY_VARIANTS, "gated-delta-window-sinks"])
def test_token_by_token_decoding_equals_the_forward(name):
    """Every token decoded alone from the cache, in a left-padded batch (pads inside the first windows and, by
    their zero log decay, no step of the decayed state): the no-cache forward's logits at every real position."""
    model = tiny_model(**VARIANTS[name])
    ids, mask = left_pad(prompts([40, 33], seed=7))
    cache = LinearAttentionCache(model.config)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        steps = [model(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], cache=cache).logits
                 for i in range(ids.shape[1])]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["hedgehog-window-sinks", "hedgehog-window-sinks-scalar-decay",
                                  "gated-delta-window-sinks"])
def test_unpadded_decoding_from_one_token_equals_the_forward(name):
    """No mask (the step's unpadded form): one token prefilled, fewer than the sinks, so the sink slots fill during
    decoding; once they are all filled the eager steps skip the sink update. The forward's logits at every position."""
    model = tiny_model(**VARIANTS[name])
    ids = torch.randint(3, 128, (2, 16))
    cache = LinearAttentionCache(model.config)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        steps = [model(ids[:, :1], cache=cache).logits]
        assert not cache.layers[0].sinks_filled
        steps += [model(ids[:, i : i + 1], cache=cache).logits for i in range(1, ids.shape[1])]
    assert all(layer.sinks_filled for layer in cache.layers)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-4)


def test_past_key_values_spelling_in_forward():
    model = tiny_model(**VARIANTS["hedgehog-window-sinks"])
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        a = returned_cache(model(ids[:, :8], use_cache=True))
        b = returned_cache(model(ids[:, :8], use_cache=True))
        via_cache = model(ids[:, 8:], cache=a).logits
        via_pkv = model(ids[:, 8:], past_key_values=b).logits
    torch.testing.assert_close(via_cache, via_pkv, atol=0, rtol=0)


@pytest.mark.parametrize("name", CACHED_VARIANTS)
def test_greedy_generate_with_cache_equals_without(name):
    model = tiny_model(**VARIANTS[name])
    ids = prompts([11])[0][None]
    with_cache = model.generate(ids, max_new_tokens=12, use_cache=True, **GREEDY)
    without = model.generate(ids, max_new_tokens=12, use_cache=False, **GREEDY)
    torch.testing.assert_close(with_cache, without)


@pytest.mark.parametrize("name", ["elu-scalar-decay", "hedgehog-window-sinks", "gated-delta-conv",
                                  "gated-delta-window-sinks"])
def test_sampled_generate_with_cache_equals_without(name):
    model = tiny_model(**VARIANTS[name])
    ids = prompts([6, 6], seed=1)
    ids = torch.stack(ids)
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(1234)
        outs.append(model.generate(ids, max_new_tokens=10, do_sample=True, top_k=20, temperature=1.3,
                                   use_cache=use_cache, eos_token_id=None, pad_token_id=0))
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("name", CACHED_VARIANTS)
def test_left_padded_batch_generate_equals_each_prompt_alone(name):
    model = tiny_model(**VARIANTS[name])
    seqs = prompts([12, 5, 8], seed=2)
    ids, mask = left_pad(seqs)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GREEDY)
    for row, s in enumerate(seqs):
        alone = model.generate(s[None], max_new_tokens=8, **GREEDY)
        torch.testing.assert_close(batched[row, -8:], alone[0, -8:])


@pytest.mark.parametrize("name", ["elu", "hedgehog-window-sinks", "qwen3-like-hybrid", "gated-delta-conv",
                                  "gated-delta-window-sinks"])
def test_beam_search_with_cache_equals_without(name):
    model = tiny_model(**VARIANTS[name])
    seqs = prompts([7, 4], seed=3)
    ids, mask = left_pad(seqs)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, num_return_sequences=2,
                  return_dict_in_generate=True, output_scores=True, **GREEDY)
    with_cache = model.generate(ids, use_cache=True, **kwargs)
    without = model.generate(ids, use_cache=False, **kwargs)
    assert with_cache.sequences.shape == (4, ids.shape[1] + 6)
    torch.testing.assert_close(with_cache.sequences, without.sequences)
    torch.testing.assert_close(with_cache.sequences_scores, without.sequences_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spelling", ["cache", "past_key_values"])
@pytest.mark.parametrize("name", ["elu-scalar-decay", "hedgehog-window-sinks", "qwen3-like-hybrid",
                                  "gated-delta-conv", "gated-delta-window-sinks"])
def test_reusing_a_returned_cache_equals_a_fresh_run(name, spelling):
    model = tiny_model(**VARIANTS[name])
    prompt = prompts([9], seed=4)[0][None]
    first = model.generate(prompt, max_new_tokens=5, return_dict_in_generate=True, **GREEDY)
    cache = returned_cache(first)
    assert cache.get_seq_length() == prompt.shape[1] + 5 - 1  # the last generated token is not fed yet
    follow_up = torch.cat([first.sequences, torch.tensor([[17, 23, 5]])], dim=1)
    reused = model.generate(follow_up, max_new_tokens=6, **{spelling: cache}, **GREEDY)
    fresh = model.generate(follow_up, max_new_tokens=6, **GREEDY)
    torch.testing.assert_close(reused, fresh)


@pytest.mark.parametrize("name", CACHED_VARIANTS)
def test_generate_chunked_prefill_equals_one_shot(name):
    model = tiny_model(**VARIANTS[name])
    seqs = prompts([40, 27], seed=5)
    ids, mask = left_pad(seqs)
    one_shot = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)
    chunked = model.generate(ids, attention_mask=mask, max_new_tokens=6, prefill_chunk_size=9, **GREEDY)
    torch.testing.assert_close(chunked, one_shot)


@pytest.mark.parametrize("name", ["elu", "t2r-vector-decay", "hedgehog-window-sinks", "gated-delta-conv",
                                  "gated-delta-window-sinks"])
def test_cache_bytes_are_the_same_after_1k_and_64k_tokens(name):
    model = tiny_model(**VARIANTS[name], num_hidden_layers=1, max_position_embeddings=70_000)
    sizes = {}
    with torch.no_grad():
        cache = LinearAttentionCache(model.config)
        seen = 0
        for target in (1024, 65536):
            while seen < target:
                step = min(8192, target - seen)
                model(torch.randint(3, 128, (1, step)), cache=cache, logits_to_keep=1)
                seen += step
            sizes[target] = cache.nbytes()
            assert cache.get_seq_length() == target
    assert sizes[1024] == sizes[65536] > 0


def test_softmax_layers_hold_a_growing_cache():
    model = tiny_model(softmax_layers=[1])
    with torch.no_grad():
        cache = returned_cache(model(torch.randint(3, 128, (1, 10)), use_cache=True))
        small = cache.nbytes()
        model(torch.randint(3, 128, (1, 10)), cache=cache)
    assert cache.nbytes() > small


def test_cache_errors():
    model = tiny_model()
    ids = torch.randint(3, 128, (2, 6))
    with pytest.raises(TypeError, match="LinearAttentionCache"):
        model(ids, cache=DynamicCache())
    other = tiny_model(softmax_layers=[0])
    with pytest.raises(ValueError, match="another model"):
        model(ids, cache=LinearAttentionCache(other.config))
    with torch.no_grad():
        cache = returned_cache(model(ids, use_cache=True))
    with pytest.raises(ValueError, match="batch size 2"):
        model(ids[:1, :1], cache=cache)
    with pytest.raises(ValueError, match="both"):
        model(ids[:, :1], cache=cache, past_key_values=LinearAttentionCache(model.config))
    with pytest.raises(ValueError, match="zero tokens"):
        model(ids[:, :0], cache=cache)
    with pytest.raises(ValueError, match="covers the cached positions"):
        model(ids[:, :1], cache=cache, attention_mask=torch.ones(2, 1))
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(3)


def holed(seqs, holes, pad_id=0):
    """Left-padded batch of `seqs` with a pad inserted before each index in holes[row] (0 = none)."""
    rows = []
    for seq, at in zip(seqs, holes, strict=True):
        rows.append(torch.cat([seq[:at], torch.tensor([pad_id]), seq[at:]]) if at else seq)
    ids, mask = left_pad(rows, pad_id)
    for row, at in enumerate(holes):
        if at:
            mask[row, ids.shape[1] - len(rows[row]) + at] = 0
    return ids, mask


@pytest.mark.parametrize("name", CACHED_VARIANTS)
def test_holed_prompt_decodes_with_a_cache_as_without(name):
    """A pad inside a prompt: prefill, chunked prefill and token-by-token decode all equal the no-cache forward."""
    model = tiny_model(**VARIANTS[name])
    ids, mask = holed(prompts([30, 21], seed=6), holes=[12, 3])
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        cache = LinearAttentionCache(model.config)
        stepwise = []
        for start, end in [(0, 9), (9, 10), (10, 23), *((i, i + 1) for i in range(23, ids.shape[1]))]:
            out = model(ids[:, start:end], attention_mask=mask[:, :end], cache=cache)
            stepwise.append(out.logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(stepwise, dim=1)[real], full[real], atol=2e-5, rtol=1e-4)
    with_cache = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GREEDY)
    without = model.generate(ids, attention_mask=mask, max_new_tokens=8, use_cache=False, **GREEDY)
    chunked = model.generate(ids, attention_mask=mask, max_new_tokens=8, prefill_chunk_size=7, **GREEDY)
    torch.testing.assert_close(with_cache, without)
    torch.testing.assert_close(chunked, without)


@pytest.mark.parametrize("name", ["elu", "hedgehog-window-sinks", "qwen3-like-hybrid", "gated-delta-conv",
                                  "gated-delta-window-sinks"])
def test_right_padded_prompt_continues_with_a_cache(name):
    """Right padding is a hole before the next token: a cache continues from it as the no-cache forward does."""
    model = tiny_model(**VARIANTS[name])
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 6:9] = 0  # row 1: six real tokens, three pads, then three more real tokens fed after the pads
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        prefill = model(ids[:, :9], attention_mask=mask[:, :9], use_cache=True)
        rest = model(ids[:, 9:], attention_mask=mask, cache=returned_cache(prefill)).logits
    real = mask.bool()
    torch.testing.assert_close(torch.cat([prefill.logits, rest], dim=1)[real], full[real], atol=2e-5, rtol=1e-4)


def test_right_padded_batch_generates_with_a_cache_as_without():
    model = tiny_model(**VARIANTS["hedgehog-window-sinks"])
    ids = torch.randint(3, 128, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    with_cache = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)
    without = model.generate(ids, attention_mask=mask, max_new_tokens=6, use_cache=False, **GREEDY)
    torch.testing.assert_close(with_cache, without)


WINDOW = {"feature_map": "hedgehog", "feature_dim": 16, "window_size": 5, "num_sink_tokens": 2}
LINEAR = {"feature_map": "elu", "decay": "none"}
PLAIN = {"feature_map": "identity", "normalize": False}
DELTA = {"update_rule": "delta", "feature_map": "identity", "normalize": False, "conv_size": 4}


@pytest.mark.parametrize(
    "base, field, value",
    [(LINEAR, "feature_map", "relu"), (LINEAR, "decay", "scalar"), (LINEAR, "normalize", False),
     (WINDOW, "feature_dim", 8), (WINDOW, "window_size", 4), (WINDOW, "num_sink_tokens", 1),
     (LINEAR, "num_key_value_heads", 4), (LINEAR, "softmax_layers", [1]), (PLAIN, "update_rule", "delta"),
     (DELTA, "conv_size", 0), (DELTA, "conv_size", 3), (DELTA, "decay", "scalar"), (DELTA, "window_size", 5)],
)
def test_cache_built_for_another_config_is_refused(base, field, value):
    model = tiny_model(**base)
    other = tiny_model(**{**base, field: value})
    ids = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        cache = returned_cache(other(ids, use_cache=True))
    with pytest.raises(ValueError, match=rf"another model configuration: {field}="):
        model(ids[:, :1], cache=cache)
    with pytest.raises(ValueError, match=rf"another model configuration: {field}="):
        model.generate(ids, cache=LinearAttentionCache(other.config), max_new_tokens=2, **GREEDY)


@pytest.mark.parametrize("chunk", [0, -3, 2.5, "8", True])
def test_bad_prefill_chunk_size_is_refused(chunk):
    model = tiny_model()
    with pytest.raises(ValueError, match=rf"prefill_chunk_size must be None .* an int ≥ 1; got {chunk!r}"):
        model.generate(torch.randint(3, 128, (1, 5)), max_new_tokens=2, prefill_chunk_size=chunk, **GREEDY)


@pytest.mark.parametrize("assistant", ["assistant_model", "prompt_lookup"])
def test_assisted_decoding_is_refused_before_any_forward(assistant, monkeypatch):
    """A recurrent state cannot be rolled back to a draft's accepted prefix: generate() refuses up front."""
    model = tiny_model()
    calls = []
    monkeypatch.setattr(model.model, "forward", lambda *args, **kwargs: calls.append(1))
    kwargs = (dict(assistant_model=tiny_model(seed=1)) if assistant == "assistant_model"
              else dict(prompt_lookup_num_tokens=2))
    with pytest.raises(ValueError, match="assisted generation is not supported with stateful models"):
        model.generate(torch.randint(3, 128, (1, 5)), max_new_tokens=3, **kwargs, **GREEDY)
    assert calls == []


def test_cache_survives_training_mode_switch_and_rejects_checkpointing():
    model = tiny_model().train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(3, 128, (1, 8))
    assert returned_cache(model(ids)) is None  # training defaults to no cache
    with pytest.raises(ValueError, match="gradient checkpointing"):
        model(ids, use_cache=True)


def test_delta_cache_holds_the_state_and_the_last_conv_inputs():
    """Per layer: the delta state fp32 [B, H, K, V] and the convolution's last conv_size - 1 inputs [B, 3, C]
    (C = (H + 2 H_kv) D), pads entering as zeros; the same after 5 tokens as after 50."""
    model = tiny_model(**VARIANTS["gated-delta-conv"])
    ids, mask = left_pad(prompts([50, 2], seed=9))
    with torch.no_grad():
        cache = returned_cache(model(ids, attention_mask=mask, use_cache=True))
        short = returned_cache(model(ids[:, -5:], use_cache=True))
    layer = cache.layers[0]
    assert layer.state.shape == (2, 4, 16, 16) and layer.state.dtype == torch.float32
    assert layer.conv_inputs.shape == (2, 3, (4 + 2 * 2) * 16) and layer.conv_inputs.dtype == torch.float32
    assert cache.nbytes() == short.nbytes() == 2 * 2 * (4 * 16 * 16 * 4 + 3 * 128 * 4)  # 2 layers, fp32
    # Row 1 holds two real tokens after 48 pads: of its last three inputs the first is a (zeroed) pad.
    assert torch.equal(layer.conv_inputs[1, 0], torch.zeros_like(layer.conv_inputs[1, 0]))
    assert layer.conv_inputs[1, 1:].abs().sum() > 0
    layer.reset()
    assert layer.conv_inputs is None and layer.state is None


def test_delta_window_cache_holds_the_ring_with_the_beta_each_token_enters_with():
    """Per layer: the delta state fp32 [B, H, K, V] and the window hybrid's ring (S sink slots + W positions: raw keys,
    values and mask, no k̂), plus each slot's β (fp32 [B, S + W, H], 0 in the sink slots); after 50 tokens as after
    5. A sink never enters the state: its slot holds no β."""
    model = tiny_model(**VARIANTS["gated-delta-window-sinks"])
    ids, mask = left_pad(prompts([50, 6], seed=9))
    with torch.no_grad():
        cache = returned_cache(model(ids, attention_mask=mask, use_cache=True))
        short = returned_cache(model(ids[:, -5:], use_cache=True))
    layer = cache.layers[0]
    assert set(layer.tensors()) == {"state", "window_keys", "window_values", "window_mask", "window_beta",
                                    "conv_inputs"}
    assert layer.state.shape == (2, 4, 16, 16) and layer.state.dtype == torch.float32
    assert layer.window_keys.shape == (2, 2 + 5, 2, 16) and layer.window_beta.shape == (2, 2 + 5, 4)
    assert layer.window_beta.dtype == torch.float32
    assert cache.nbytes() == short.nbytes()
    assert not layer.window_beta[:, :2].any()
    ring = layer.window_mask[:, 2:]
    assert ((layer.window_beta[:, 2:][ring] > 0) & (layer.window_beta[:, 2:][ring] < 1)).all()


@pytest.mark.parametrize("prefill", [3, 12])  # shorter and longer than the window (5)
@pytest.mark.parametrize("name", ["elu", "identity-fixed-decay", "t2r-vector-decay", "hedgehog-window-sinks",
                                  *HYBRID_DECAY_VARIANTS, "gated-delta-window-sinks"])
def test_lean_decode_step_equals_the_op_path(name, prefill, monkeypatch):
    """The fixed-shape one-token step (backend "auto") against the same step through the ops ("torch" backend, the
    retained window in sequence order in front of the token): the same logits and the same cache, slot for slot,
    through sinks filling (the short row is all pads until after the prefill), the window wrapping, left padding and
    a hole decoded after real tokens (a pad step, while a real token leaves the window). The lean steps call none of
    the ops; the twin's call them at every step."""
    calls = []
    for op in ("linear_attention", "window_attention", "delta_rule_attention"):
        run = getattr(modeling_linear_attention, op)
        monkeypatch.setattr(modeling_linear_attention, op,
                            lambda *args, _run=run, _op=op, **kwargs: calls.append(_op) or _run(*args, **kwargs))
    lean = tiny_model(**VARIANTS[name])
    ops = tiny_model(**VARIANTS[name], linear_attention_backend="torch")
    ids, mask = left_pad(prompts([19, 6], seed=8))
    mask[0, 15] = 0
    caches = [LinearAttentionCache(m.config) for m in (lean, ops)]
    with torch.no_grad():
        for model, cache in zip((lean, ops), caches, strict=True):
            model(ids[:, :prefill], attention_mask=mask[:, :prefill], cache=cache)
        for i in range(prefill, ids.shape[1]):
            logits = []
            for model, cache in zip((lean, ops), caches, strict=True):
                calls.clear()
                logits.append(model(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], cache=cache).logits)
                assert bool(calls) == (model is ops), calls
            torch.testing.assert_close(*logits, atol=2e-5, rtol=1e-4)
    for mine, theirs in zip(caches[0].layers, caches[1].layers, strict=True):
        assert mine.tensors().keys() == theirs.tensors().keys()
        for key, tensor in mine.tensors().items():
            torch.testing.assert_close(tensor, theirs.tensors()[key], atol=1e-5, rtol=1e-4, msg=key)
        assert mine.get_seq_length() == theirs.get_seq_length() == ids.shape[1]


@pytest.mark.parametrize("name, buffers", [
    ("hedgehog-window-sinks-scalar-decay", set()),
    ("gated-delta-window-sinks", {"window_beta", "conv_inputs"}),
])
def test_decode_steps_update_the_cache_in_place(name, buffers):
    """After the first call, a decode step writes every buffer in place: same tensors, same addresses."""
    model = tiny_model(**VARIANTS[name])
    ids = torch.randint(3, 128, (2, 12))
    cache = LinearAttentionCache(model.config)
    with torch.no_grad():
        model(ids[:, :4], cache=cache)
        before = [{k: t.data_ptr() for k, t in layer.tensors().items()} for layer in cache.layers]
        for i in range(4, 12):
            model(ids[:, i : i + 1], cache=cache)
    assert [{k: t.data_ptr() for k, t in layer.tensors().items()} for layer in cache.layers] == before
    assert set(before[0]) == {"state", "window_keys", "window_values", "window_mask", *buffers}


@pytest.mark.parametrize("name", ["hedgehog-window-sinks-scalar-decay", "gated-delta-window-sinks"])
def test_window_cache_holds_no_key_features(name):
    """A window-hybrid layer's cache keeps the raw keys and no φ(k) (k̂ with the delta rule) of them: the layer
    recomputes the features of the keys it folds. Its bytes are exactly those of the state, the ring's keys, values
    and mask (and β, convolution inputs) by their shapes: B · R · H · K features per layer fewer than a ring that
    also stored them, and the decode steps still give the full forward's logits."""
    model = tiny_model(**VARIANTS[name])
    config, layer_module = model.config, model.model.layers[0].self_attn
    ids = prompts([17], seed=3)[0][None].expand(2, -1)
    cache = LinearAttentionCache(config)
    with torch.no_grad():
        model(ids[:, :9], cache=cache)
        decoded = torch.cat([model(ids[:, i : i + 1], cache=cache).logits for i in range(9, 17)], dim=1)
        full = model(ids).logits[:, 9:]
    torch.testing.assert_close(decoded, full, atol=2e-5, rtol=1e-4)
    batch, slots = 2, config.num_sink_tokens + config.window_size
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    item = model.dtype.itemsize
    delta = config.update_rule == "delta"
    state = batch * heads * layer_module.key_dim * (head_dim + (0 if delta else 1)) * 4
    ring = batch * slots * (2 * kv_heads * head_dim * item + 1 + (heads * 4 if delta else 0))  # k, v, mask (, β)
    conv = batch * (config.conv_size - 1) * (heads + 2 * kv_heads) * head_dim * item if config.conv_size else 0
    for layer in cache.layers:
        assert not any("feature" in name for name in layer.tensors()), set(layer.tensors())
        assert layer.nbytes() == state + ring + conv
    assert cache.nbytes() == config.num_hidden_layers * (state + ring + conv)


def test_appended_equals_concatenation_and_writes_in_place_until_full():
    """`appended` (softmax layers' and softmax heads' growing K/V): every result equals torch.cat of what came
    before; steps write into one buffer until it is full; a past that is not the buffer's prefix (a beam reorder
    replaced it) gets a new buffer; under autograd it concatenates, and gradients flow."""
    torch.manual_seed(0)
    past, buffer, expected = None, None, torch.zeros(2, 3, 0, 4)
    addresses = set()
    for t in (5, 1, 1, 300, 1, 1):
        new = torch.randn(2, 3, t, 4)
        past, buffer = appended(past, new, buffer)
        expected = torch.cat([expected, new], dim=2)
        assert torch.equal(past, expected)
        addresses.add(buffer.data_ptr())
    assert len(addresses) == 2  # one buffer for the first 7 positions and more, a second once 307 > 256 + 5
    assert buffer.shape[2] >= past.shape[2] + 1
    reordered = past.index_select(0, torch.tensor([1, 0]))
    grown, new_buffer = appended(reordered, torch.ones(2, 3, 1, 4), buffer)
    assert new_buffer is not buffer and torch.equal(grown[:, :, :-1], expected.flip(0))
    leaf = torch.randn(2, 3, 1, 4, requires_grad=True)
    joined, no_buffer = appended(past, leaf, buffer)
    assert no_buffer is None and torch.equal(joined[:, :, :-1], expected)
    joined.sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(leaf))
    with torch.no_grad():  # the buffer did not change under autograd
        assert torch.equal(appended(past, torch.zeros(2, 3, 1, 4), buffer)[0][:, :, :-1], expected)


def test_softmax_layers_decode_into_a_growing_buffer():
    """A softmax layer's cache (`GrowingLayer`) holds what transformers' `DynamicLayer` holds, keeping its keys in one
    buffer over decode steps; reset drops the buffers and otherwise does what the installed DynamicLayer's does."""
    layer, reference = state_layer(tiny_config(softmax_layers=[0]), 0), DynamicLayer()
    assert isinstance(layer, GrowingLayer)
    steps = [(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8))] + [(torch.randn(1, 2, 1, 8),) * 2] * 5
    buffers = set()
    for k, v in steps:
        keys, values = layer.update(k, v)
        expected_keys, expected_values = reference.update(k, v)
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
        buffers.add(layer.key_buffer.data_ptr())
    assert len(buffers) == 1 and layer.get_seq_length() == 15
    layer.reset()
    reference.reset()
    assert layer.key_buffer is None and layer.get_seq_length() == reference.get_seq_length()
