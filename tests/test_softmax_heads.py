"""The head-level hybrid (`softmax_heads`): some KV heads of a layer keep exact causal softmax attention beside the
layer's kind. Oracles: a restored head computes its teacher's attention, every head restored is the teacher, none is
the model as it was; every path (cache, padding and holes, packing, generate modes, backends, gradients, training,
save and load) agrees with its reference as for the kinds alone; bad input is refused before any work."""

import pytest
import torch
from helpers import SOURCES, VARIANTS, left_pad, prompts, teacher, tiny_config, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from hf_linear_attn import LinearAttentionCache, LinearAttentionConfig, convert_to_linear_attention
from hf_linear_attn.cache_linear_attention import SoftmaxHeadsState, WindowStateLayer
from hf_linear_attn.conversion import GATED_DELTANET_OPTIONS, GATED_DELTANET_WINDOW_OPTIONS
from hf_linear_attn.layer_selection import restore_softmax_heads, restore_softmax_layers
from hf_linear_attn.modeling_linear_attention import (
    OUTPUT_CACHE_FIELD,
    SoftmaxHeadsMixin,
    WindowHybridAttention,
    WindowHybridAttentionWithSoftmaxHeads,
    one_query_attention,
)
from hf_linear_attn.training.attention_transfer import AttentionTransfer

# Every variant with KV head 1 of layer 1 (and its query group: query heads 2, 3) kept as softmax attention.
MIXED = {name: {**overrides, "softmax_heads": {1: [1]}} for name, overrides in VARIANTS.items()}
GREEDY = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
# Conversion options of every recurrent kind (the window one is the demo's); with the sparse memory too.
KINDS = {
    "linear": {"feature_map": "hedgehog", "window_size": 0, "num_sink_tokens": 0},
    "window": {},
    "window-sparse-memory": {"decay": "scalar", "sparse_cache_size": 4},
    "delta": GATED_DELTANET_OPTIONS,
    "delta_window": GATED_DELTANET_WINDOW_OPTIONS,
}


@pytest.mark.parametrize("heads", [(9, 3), (3, 1), (4, 4)], ids=["groups-of-3", "one-kv-head", "no-groups"])
def test_one_query_attention_is_softmax_over_the_keys_of_its_group(heads):
    """A decode step's attention (`one_query_attention`) against the definition: each query head's KV head repeated
    for its group, softmax of q·k / sqrt(D) over the real keys (the query's own always among them), weights times v;
    a row whose keys are all padding but its own attends to itself alone."""
    h, h_kv = heads
    torch.manual_seed(0)
    q, k, v = torch.randn(3, h, 1, 16), torch.randn(3, h_kv, 37, 16), torch.randn(3, h_kv, 37, 16)
    mask = torch.rand(3, 37) > 0.3
    mask[1, :] = False
    k_all, v_all = (x.repeat_interleave(h // h_kv, dim=1) for x in (k, v))  # [B, H, S, D]
    for key_mask in (None, mask):
        seen = torch.ones(3, 37, dtype=torch.bool) if key_mask is None else key_mask.clone()
        seen[:, -1] = True
        scores = (q @ k_all.transpose(2, 3) / 4.0).masked_fill(~seen[:, None, None, :], float("-inf"))
        expected = scores.softmax(-1) @ v_all
        torch.testing.assert_close(one_query_attention(q, k, v, key_mask), expected)
    torch.testing.assert_close(one_query_attention(q, k, v, mask)[1], v_all[1, :, -1:])


def o_proj_inputs(model, ids, layer):
    """The per-head outputs [B, T, H·D] o_proj receives in `layer` of `model` (a linear-attention or softmax model)."""
    seen = {}
    o_proj = model.model.layers[layer].self_attn.o_proj
    handle = o_proj.register_forward_pre_hook(lambda m, a: seen.update(o=a[0].reshape(*ids.shape, -1)))
    with torch.no_grad():
        model(ids, use_cache=False) if hasattr(model.config, "softmax_heads") else model(ids)
    handle.remove()
    return seen["o"]


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("heads, extra, error, message", [
    ({1: [2]}, {}, ValueError, r"layer 1: KV head indices must lie in \[0, 1\]"),
    ({2: [0]}, {}, ValueError, r"layer indices must lie in \[0, 1\]"),
    ({1: [0, 0]}, {}, ValueError, r"layer 1 lists KV head\(s\) \[0\] more than once"),
    ({1: [0], "1": [1]}, {}, ValueError, "layer 1 is given twice"),
    ({0: [1]}, {"softmax_layers": [0]}, ValueError, r"layer 0 is in softmax_layers=\[0\]"),
    ({0: [0]}, {"softmax_layers": [0, 1]}, ValueError, "softmax_layers"),  # a model without linear heads
    ({1: [-1]}, {}, ValueError, ">= 0"),
    ({-1: [0]}, {}, ValueError, ">= 0"),
    ([1], {}, TypeError, "must be a dict"),
    ({1: 0}, {}, TypeError, "must be a dict"),
    ({"one": [0]}, {}, TypeError, "must be a dict"),
    ({1: [True]}, {}, TypeError, "must be a dict"),
])
def test_bad_softmax_heads_raise_naming_the_field(heads, extra, error, message):
    with pytest.raises(error, match=r"invalid `softmax_heads`.*" + message):
        tiny_config(softmax_heads=heads, **extra)


def test_bad_softmax_heads_fail_a_conversion_before_any_weight_is_read(tmp_path):
    source = teacher("llama")
    source.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # reading the weights would fail otherwise
    with pytest.raises(ValueError, match="softmax_heads"):
        convert_to_linear_attention(str(tmp_path), softmax_heads={0: [5]})


def test_a_cache_for_another_head_layout_is_refused_before_any_work():
    model = tiny_model(softmax_heads={1: [1]})
    cache = LinearAttentionCache(tiny_config(softmax_heads={1: [0]}))
    with pytest.raises(ValueError, match=r"another model configuration: softmax_heads=\(\(1, \(0,\)\),\)"):
        model(torch.randint(3, 128, (1, 5)), cache=cache)
    assert cache.get_seq_length() == 0 and cache.batch_size == -1
    with pytest.raises(ValueError, match="softmax_heads"):
        tiny_model()(torch.randint(3, 128, (1, 5)), cache=LinearAttentionCache(model.config))


@pytest.mark.parametrize("heads, overrides, error, message", [
    ({2: [0]}, {}, ValueError, r"layer indices must lie in \[0, 1\]"),
    ({1: [0, 0]}, {}, ValueError, "more than once"),
    ({1: [0]}, {"softmax_heads": {1: [0]}}, ValueError, "more than once"),  # restored already
    ({1: [3]}, {}, ValueError, r"KV head indices must lie in \[0, 1\]"),
    ({0: [1]}, {"softmax_layers": [0]}, ValueError, "is in softmax_layers"),
    ([1], {}, TypeError, "must be a dict"),
])
def test_bad_heads_to_restore_raise_before_anything_changes(heads, overrides, error, message):
    model = tiny_model(**overrides)
    classes = [type(layer.self_attn) for layer in model.model.layers]
    with pytest.raises(error, match=message):
        restore_softmax_heads(model, heads, inplace=True)
    assert [type(layer.self_attn) for layer in model.model.layers] == classes
    assert model.config.softmax_heads == overrides.get("softmax_heads", {})
    with pytest.raises(TypeError, match="LinearAttentionForCausalLM"):
        restore_softmax_heads(teacher("llama"), {0: [0]})


# ----------------------------------------------------------------------------------------------- the config
def test_softmax_heads_survive_a_json_round_trip(tmp_path):
    config = tiny_config(softmax_heads={"1": [1], 0: (1, 0), 2: []}, num_hidden_layers=3)  # JSON gives string keys
    assert config.softmax_heads == {0: [0, 1], 1: [1]}  # sorted, the empty layer dropped
    assert config.softmax_heads_of(0) == (0, 1) and config.softmax_heads_of(2) == ()
    config.save_pretrained(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(reloaded, LinearAttentionConfig) and reloaded.softmax_heads == {0: [0, 1], 1: [1]}
    assert LinearAttentionConfig().softmax_heads == {}


def test_a_layer_with_softmax_heads_is_its_kind_with_the_same_parameters():
    model = tiny_model(window_size=4, num_hidden_layers=3, softmax_heads={0: [1], 2: [0, 1]})
    plain = tiny_model(window_size=4, num_hidden_layers=3)
    assert [model.config.layer_kind(i) for i in range(3)] == ["window"] * 3  # the kind of the other heads
    classes = [type(layer.self_attn) for layer in model.model.layers]
    assert classes == [WindowHybridAttentionWithSoftmaxHeads, WindowHybridAttention,
                       WindowHybridAttentionWithSoftmaxHeads]
    assert issubclass(classes[0], WindowHybridAttention) and issubclass(classes[0], SoftmaxHeadsMixin)
    first = model.model.layers[0].self_attn
    assert (first.softmax_kv_heads, first.softmax_query_heads) == ([1], [2, 3])
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    cache = LinearAttentionCache(model.config)
    assert isinstance(cache.layers[0], WindowStateLayer) and isinstance(cache.layers[0], SoftmaxHeadsState)
    assert not isinstance(cache.layers[1], SoftmaxHeadsState) and not cache.is_compileable


# ----------------------------------------------------------------------------------------------- the oracles
@pytest.mark.parametrize("name", SOURCES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_head_restored_is_the_teacher(name, kind):
    """Every KV head of every layer restored: the teacher's logits, whatever the kind (the output norm, gate and
    the other parts act on none of them; the convolution starts as the identity)."""
    source = teacher(name)
    every = {layer: [0, 1] for layer in range(2)}
    student = convert_to_linear_attention(source, softmax_heads=every, **KINDS[kind])
    ids = torch.randint(0, 96, (2, 70))  # beyond the window (64) and the memory's first block end
    with torch.no_grad():
        torch.testing.assert_close(student(ids, use_cache=False).logits, source(ids).logits, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(student.generate(ids[:, :20], max_new_tokens=8, do_sample=False),
                                   source.generate(ids[:, :20], max_new_tokens=8, do_sample=False))


@pytest.mark.parametrize("name", SOURCES)
def test_a_restored_head_is_the_teachers_and_the_others_are_the_kinds(name):
    """Layer 0 sees the same input in all three models: with KV head 1 restored, query heads 2, 3 give the teacher's
    attention output and query heads 0, 1 what the converted model without restored heads gives."""
    source = teacher(name)
    options = dict(window_size=4, num_sink_tokens=1)
    plain = convert_to_linear_attention(source, **options)
    restored = convert_to_linear_attention(source, softmax_heads={0: [1]}, **options)
    ids = torch.randint(0, 96, (2, 40))
    expected, kind, got = (o_proj_inputs(model, ids, 0) for model in (source, plain, restored))
    d = plain.config.head_dim
    torch.testing.assert_close(got[..., 2 * d:], expected[..., 2 * d:], atol=1e-6, rtol=0)
    assert torch.equal(got[..., : 2 * d], kind[..., : 2 * d])
    assert not torch.allclose(kind[:, 10:, 2 * d:], expected[:, 10:, 2 * d:], atol=1e-3)  # the heads did differ


def test_no_softmax_heads_is_the_model_as_it_was():
    source = teacher("qwen3")
    ids = torch.randint(0, 96, (2, 40))
    none, plain = (convert_to_linear_attention(source, window_size=4, **extra) for extra in ({"softmax_heads": {}}, {}))
    assert [type(x.self_attn) for x in none.model.layers] == [type(x.self_attn) for x in plain.model.layers]
    with torch.no_grad():
        assert torch.equal(none(ids).logits, plain(ids).logits)


# ----------------------------------------------------------------------------------------------- restoring
@pytest.mark.parametrize("name", VARIANTS)
def test_restoring_heads_changes_the_config_and_the_class_only(name):
    """The restored model shares every parameter with the original (no copy), and equals a model built with the
    heads from the start and given the same weights."""
    model = tiny_model(**VARIANTS[name])
    restored = restore_softmax_heads(model, {1: [1]}, inplace=False)
    assert model.config.softmax_heads == {} and restored.config.softmax_heads == {1: [1]}
    assert not isinstance(model.model.layers[1].self_attn, SoftmaxHeadsMixin)  # (a deep copy was changed)
    built = tiny_model(**MIXED[name])
    built.load_state_dict(model.state_dict())
    assert restored.state_dict().keys() == model.state_dict().keys()
    ids = torch.randint(3, 128, (2, 30))
    with torch.no_grad():
        assert torch.equal(restored(ids).logits, built(ids).logits)
    parameters = dict(model.named_parameters())
    assert restore_softmax_heads(model, {1: [1]}, inplace=True) is model
    assert isinstance(model.model.layers[1].self_attn, SoftmaxHeadsMixin)
    assert dict(model.named_parameters()).keys() == parameters.keys()
    assert all(p is parameters[n] for n, p in model.named_parameters())  # the same tensors, not copies


def test_restoring_more_heads_and_whole_layers_keeps_the_config_consistent():
    source = teacher("qwen2")
    converted = convert_to_linear_attention(source, window_size=4, num_sink_tokens=1, softmax_heads={0: [1]})
    restore_softmax_heads(converted, {0: [0], 1: [0]}, inplace=True)
    direct = convert_to_linear_attention(source, window_size=4, num_sink_tokens=1, softmax_heads={0: [0, 1], 1: [0]})
    assert converted.config.softmax_heads == direct.config.softmax_heads == {0: [0, 1], 1: [0]}
    ids = torch.randint(0, 96, (2, 30))
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, direct(ids).logits)
    whole = restore_softmax_layers(converted, [1])
    assert whole.config.softmax_layers == [1] and whole.config.softmax_heads == {0: [0, 1]}
    rebuilt = type(whole)(LinearAttentionConfig(**whole.config.to_dict())).eval()  # the config says what it is
    rebuilt.load_state_dict(whole.state_dict())
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, whole(ids).logits)


# ----------------------------------------------------------------------------------------------- every path
@pytest.mark.parametrize("name", MIXED)
def test_prefill_chunks_and_decode_steps_equal_one_forward(name):
    model = tiny_model(**MIXED[name])
    ids = torch.randint(3, 128, (2, 75))
    cache = LinearAttentionCache(model.config)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        parts = [model(ids[:, s: s + 23], cache=cache).logits for s in range(0, 69, 23)]
        parts += [model(ids[:, i: i + 1], cache=cache).logits for i in range(69, 75)]
    assert cache.get_seq_length() == 75
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-5, rtol=1e-4)
    layer = cache.layers[1]
    assert layer.head_keys.shape == layer.head_values.shape == (2, 1, 75, model.config.head_dim)
    plain = LinearAttentionCache(tiny_model(**VARIANTS[name]).config)
    with torch.no_grad():
        tiny_model(**VARIANTS[name])(ids, cache=plain)
    assert cache.nbytes() == plain.nbytes() + 2 * layer.head_keys.numel() * 4  # the kind's state and the K/V


@pytest.mark.parametrize("name", MIXED)
def test_the_oracle_backend_gives_the_same_outputs_and_gradients(name):
    ids = torch.randint(3, 128, (2, 77))
    results = []
    for backend in ("auto", "recurrent"):
        model = tiny_model(**MIXED[name], linear_attention_backend=backend).train()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (oracle_loss, oracle_grads) = results
    torch.testing.assert_close(loss, oracle_loss, atol=2e-5, rtol=1e-4)
    assert grads.keys() == oracle_grads.keys() and grads
    for n in grads:
        torch.testing.assert_close(grads[n], oracle_grads[n], atol=2e-5, rtol=1e-3, msg=n)


@pytest.mark.parametrize("name", ["elu-scalar-decay", "hedgehog-window-sinks-vector-decay", "gated-delta-window-sinks"])
def test_the_triton_backend_agrees(name):
    model = tiny_model(**MIXED[name])
    ids = torch.randint(3, 128, (1, 70))
    with torch.no_grad():
        expected = model(ids).logits
        model.config.linear_attention_backend = "triton"
        torch.testing.assert_close(model(ids).logits, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", MIXED)
def test_padding_and_holes_equal_the_real_tokens_alone(name):
    model = tiny_model(**MIXED[name])
    seqs = prompts([13, 6, 9])
    ids, mask = left_pad(seqs)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for row, s in enumerate(seqs):
            torch.testing.assert_close(batched[row, -len(s):], model(s[None]).logits[0], atol=2e-5, rtol=1e-4)
        # A hole: the full forward and token-by-token decoding of the same holed prompt agree (window kinds count
        # positions, so the hole is compared with itself, not with the prompt without it).
        seq = prompts([30], seed=3)[0]
        holed = torch.cat([seq[:12], torch.tensor([0]), seq[12:]])[None]
        hole_mask = torch.ones_like(holed)
        hole_mask[0, 12] = 0
        full = model(holed, attention_mask=hole_mask, use_cache=False).logits
        cache = LinearAttentionCache(model.config)
        steps = [model(holed[:, :5], attention_mask=hole_mask[:, :5], cache=cache).logits]
        steps += [model(holed[:, i: i + 1], attention_mask=hole_mask[:, : i + 1], cache=cache).logits
                  for i in range(5, holed.shape[1])]
    real = hole_mask[0].bool()
    torch.testing.assert_close(torch.cat(steps, dim=1)[:, real], full[:, real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", MIXED)
def test_packed_documents_equal_each_document_alone(name):
    model = tiny_model(**MIXED[name])
    docs = prompts([11, 20, 7], seed=6)
    ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids).logits[0]
        alone = torch.cat([model(d[None]).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["elu", "hedgehog-window-sinks-scalar-decay-sparse-memory", "qwen3-like-hybrid",
                                  "gated-delta-conv", "gated-delta-window-sinks"])
def test_every_generate_mode_with_the_cache_equals_without(name):
    model = tiny_model(**MIXED[name])
    seqs = prompts([12, 5], seed=2)
    ids, mask = left_pad(seqs)
    for mode in ({}, {"prefill_chunk_size": 4}, {"num_beams": 3, "num_return_sequences": 2},
                 {"do_sample": True, "top_k": 20, "num_return_sequences": 2}):
        reference = {key: value for key, value in mode.items() if key != "prefill_chunk_size"}  # (needs a cache)
        outs = []
        for use_cache, kwargs in ((True, mode), (False, reference)):
            torch.manual_seed(7)
            outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=70, use_cache=use_cache,
                                       **{**GREEDY, **kwargs}))
        torch.testing.assert_close(outs[0], outs[1])
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GREEDY)
    for row, s in enumerate(seqs):
        torch.testing.assert_close(batched[row, -8:], model.generate(s[None], max_new_tokens=8, **GREEDY)[0, -8:])
    first = model.generate(ids[:1], max_new_tokens=5, return_dict_in_generate=True, **GREEDY)
    follow_up = torch.cat([first.sequences, torch.tensor([[17, 23, 5]])], dim=1)
    reused = model.generate(follow_up, max_new_tokens=6, cache=getattr(first, OUTPUT_CACHE_FIELD), **GREEDY)
    torch.testing.assert_close(reused, model.generate(follow_up, max_new_tokens=6, **GREEDY))


def test_a_model_with_softmax_heads_compiles_without_a_graph_break_and_exports():
    model = tiny_model(**MIXED["hedgehog-window-sinks"])
    ids = torch.randint(3, 128, (1, 20))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        explained = torch._dynamo.explain(model.model)(ids, use_cache=False)
        exported = torch.export.export(model, (ids,), kwargs={"use_cache": False})
        torch.testing.assert_close(exported.module()(ids, use_cache=False).logits, expected, atol=1e-6, rtol=0)
    assert explained.graph_break_count == 0, explained.break_reasons


# ----------------------------------------------------------------------------------------------- training, saving
@pytest.mark.parametrize("name", ["hedgehog-window-sinks", "gated-delta-conv"])
def test_training_and_attention_transfer_run_through_the_softmax_heads(name):
    model = tiny_model(**MIXED[name]).train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(3, 128, (2, 30))
    model(ids, labels=ids, use_cache=False).loss.backward()
    layer = model.model.layers[1].self_attn
    d = model.config.head_dim
    q_grad = layer.q_proj.weight.grad.view(4, d, -1)
    assert all(q_grad[h].abs().sum() > 0 for h in range(4))  # softmax heads (2, 3) and the kind's (0, 1)
    model.zero_grad()
    model.gradient_checkpointing_disable()
    with AttentionTransfer(model) as transfer:
        assert layer in transfer.layers and len(transfer.layers) == 2
        loss = model(ids, use_cache=False, logits_to_keep=1).loss
        loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(term) for term in transfer.layer_losses)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    grads = {n: p.grad for n, p in layer.named_parameters() if n.split(".")[0] not in projections}  # the kind's own
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values()), grads.keys()


def test_a_converted_model_with_softmax_heads_saves_and_reloads(tmp_path):
    student = convert_to_linear_attention(teacher("qwen3"), window_size=8, softmax_heads={1: [0]})
    student.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.softmax_heads == {1: [0]}
    assert isinstance(reloaded.model.layers[1].self_attn, SoftmaxHeadsMixin)
    ids = torch.randint(0, 96, (1, 30))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, student(ids).logits)
