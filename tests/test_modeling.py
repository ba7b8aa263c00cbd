"""The model: every attention variant against its oracle backend, padding, loss, generate, dtypes."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import VARIANTS, left_pad, prompts, teacher, tiny_config, tiny_model
from transformers.cache_utils import DynamicLayer

from hf_linear_attn import (
    LinearAttentionCache,
    LinearAttentionForCausalLM,
    LinearAttentionModel,
    convert_to_linear_attention,
)
from hf_linear_attn.cache_linear_attention import (
    DeltaWindowStateLayer,
    GrowingLayer,
    LinearStateLayer,
    SparseWindowStateLayer,
    WindowStateLayer,
)
from hf_linear_attn.modeling_linear_attention import (
    AdditiveLinearAttention,
    DeltaRuleAttention,
    DeltaWindowAttention,
    LinearAttention,
    LinearAttentionRotaryEmbedding,
    SoftmaxAttention,
    WindowHybridAttention,
    apply_rotary,
    causal_conv1d,
)
from hf_linear_attn.ops_delta_rule import recurrent_delta_rule


@pytest.mark.parametrize("name", VARIANTS)
def test_chunked_backend_matches_oracle_backend(name):
    model = tiny_model(**VARIANTS[name])
    ids = torch.randint(3, 128, (2, 77))  # > one 64-token chunk, odd length
    with torch.no_grad():
        fast = model(ids).logits
        model.config.linear_attention_backend = "recurrent"
        slow = model(ids).logits
    assert fast.shape == (2, 77, 128)
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", VARIANTS)
def test_causal_future_tokens_do_not_change_the_past(name):
    model = tiny_model(**VARIANTS[name])
    ids = torch.randint(3, 128, (1, 40))
    changed = ids.clone()
    changed[0, 25:] = (changed[0, 25:] + 7) % 125 + 3
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :25], b[:, :25], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, 25:], b[:, 25:])


def test_layer_kinds_follow_softmax_layers():
    model = tiny_model(num_hidden_layers=3, softmax_layers=[1])
    kinds = [type(layer.self_attn) for layer in model.model.layers]
    assert kinds == [AdditiveLinearAttention, SoftmaxAttention, AdditiveLinearAttention]


# Each attention kind: its config, the class its layers get, the cache state the layer reads and writes.
KINDS = {
    "linear": ({}, AdditiveLinearAttention, LinearStateLayer),
    "delta": (VARIANTS["gated-delta-conv"], DeltaRuleAttention, LinearStateLayer),
    "window": (VARIANTS["hedgehog-window-sinks"], WindowHybridAttention, WindowStateLayer),
    "sparse window": (VARIANTS["hedgehog-window-sinks-scalar-decay-sparse-memory"], WindowHybridAttention,
                      SparseWindowStateLayer),
    "delta_window": (VARIANTS["gated-delta-window-sinks"], DeltaWindowAttention, DeltaWindowStateLayer),
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_gets_its_class_and_a_cache_state_holding_only_its_tensors(kind):
    overrides, attention_class, state_class = KINDS[kind]
    model = tiny_model(num_hidden_layers=2, softmax_layers=[1], **overrides)
    assert model.config.layer_kind(0) == kind.split()[-1] and model.config.layer_kind(1) == "softmax"
    assert type(model.model.layers[0].self_attn) is attention_class
    ids, mask = left_pad(prompts([9, 4]))
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
    state, softmax = cache.layers
    assert type(state) is state_class and type(softmax) is GrowingLayer and isinstance(softmax, DynamicLayer)
    assert set(state.tensors()) <= set(state_class.TENSORS)  # a state has no field of another kind
    expected = {"state"} | ({"conv_inputs"} if model.config.conv_size else set())
    assert expected <= set(state.tensors())


def test_the_shared_base_has_no_attention_of_its_own():
    config = tiny_config()
    x = torch.randn(1, 3, config.hidden_size)
    rotation = LinearAttentionRotaryEmbedding(config).rotation(x, torch.arange(3)[None])
    with pytest.raises(NotImplementedError, match="shared base"):
        LinearAttention(config, layer_idx=0)(x, rotation)


@pytest.mark.parametrize("name", VARIANTS)
def test_left_padded_batch_equals_each_prompt_alone(name):
    model = tiny_model(**VARIANTS[name])
    seqs = prompts([13, 6, 9])
    ids, mask = left_pad(seqs)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for row, s in enumerate(seqs):
            alone = model(s[None]).logits[0]
            torch.testing.assert_close(batched[row, -len(s):], alone, atol=2e-5, rtol=1e-4)


def test_right_padding_leaves_real_positions_unchanged():
    model = tiny_model(**VARIANTS["hedgehog-window-sinks"])
    seq = prompts([10])[0]
    ids = torch.cat([seq, torch.zeros(4, dtype=torch.long)])[None]
    mask = torch.cat([torch.ones(10), torch.zeros(4)]).long()[None]
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits[0, :10]
        alone = model(seq[None]).logits[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "mask, message",
    [
        ([[0, 0, 0, 0]], "no real token"),
        ([[1, 1, 1]], "shape"),
    ],
)
def test_bad_attention_masks_raise(mask, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        model(torch.randint(3, 128, (1, 4)), attention_mask=torch.tensor(mask))


def test_bad_inputs_raise():
    model = tiny_model()
    with pytest.raises(ValueError, match="zero tokens"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="exactly one"):
        model()
    with pytest.raises(ValueError, match="no attention weights"):
        model(torch.randint(3, 128, (1, 4)), output_attentions=True)


@pytest.mark.parametrize("bad", [128, 1000, -1])
def test_out_of_range_token_id_names_input_ids_and_vocab_size(bad):
    model = tiny_model()
    ids = torch.tensor([[5, bad, 7]])
    with pytest.raises(ValueError, match=rf"input_ids holds the token id {bad}, outside .*vocab_size.*128"):
        model(ids)
    with pytest.raises(ValueError, match="input_ids"):
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name", ["elu", "t2r-vector-decay", "hedgehog-window-sinks", "qwen3-like-hybrid",
                                  "gated-delta-conv", "gated-delta-window-sinks"])
def test_batch_of_one_left_padded_row_equals_the_row_unpadded(name):
    """A single left-padded row (the default positions give every pad position 0) is no packed document."""
    model = tiny_model(**VARIANTS[name])
    seq = prompts([9], seed=11)[0]
    ids = torch.cat([torch.zeros(4, dtype=torch.long), seq])[None]  # four pads on the left
    mask = (torch.arange(13) >= 4).long()[None]
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits[0, 4:]
        alone = model(seq[None]).logits[0]
    torch.testing.assert_close(padded, alone, atol=2e-5, rtol=1e-4)
    greedy = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    for use_cache in (True, False):
        out = model.generate(ids, attention_mask=mask, use_cache=use_cache, **greedy)
        torch.testing.assert_close(out[0, 4:], model.generate(seq[None], use_cache=use_cache, **greedy)[0])


def test_packed_position_ids_with_a_padding_mask_raise():
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 6))
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2]])  # a second document starts at a real token
    with pytest.raises(ValueError, match="packed documents"):
        model(ids, position_ids=position_ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))
    with torch.no_grad():  # a 0 at the first real token or at a pad is padding (as generate() numbers pads)
        model(ids, position_ids=torch.tensor([[0, 0, 0, 1, 2, 3]]), attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]))


def hole_after(seq, at, pad_id=0):
    """seq with a pad token inserted before index `at`, and its mask (the hole is the 0)."""
    ids = torch.cat([seq[:at], torch.tensor([pad_id]), seq[at:]])[None]
    mask = torch.ones_like(ids)
    mask[0, at] = 0
    return ids, mask


@pytest.mark.parametrize("name", ["elu", "identity-fixed-decay", "t2r-vector-decay", "qwen3-like-hybrid", "delta"])
def test_a_hole_in_the_mask_equals_the_prompt_without_the_pad(name):
    """Linear layers skip the pad (state unchanged), softmax layers mask it, positions count real tokens."""
    model = tiny_model(**VARIANTS[name])
    seq = prompts([70], seed=12)[0]
    ids, mask = hole_after(seq, 30)
    with torch.no_grad():
        holed = model(ids, attention_mask=mask).logits[0]
        alone = model(seq[None]).logits[0]
    real = mask[0].bool()
    torch.testing.assert_close(holed[real], alone, atol=2e-5, rtol=1e-4)


def test_a_hole_in_the_window_hybrid_removes_one_key_from_the_window():
    """The window counts positions: a hole inside it leaves window_size - 1 real keys under softmax. The
    chunked backend agrees with the quadratic reference."""
    model = tiny_model(**VARIANTS["hedgehog-window-sinks"])
    seq = prompts([70], seed=13)[0]
    ids, mask = hole_after(seq, 40)
    with torch.no_grad():
        fast = model(ids, attention_mask=mask).logits
        model.config.linear_attention_backend = "parallel"
        slow = model(ids, attention_mask=mask).logits
        alone = model(seq[None]).logits[0]
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=1e-4)
    real = mask[0].bool()
    # Before the hole the prompt is untouched; right after it, the window holds one real key fewer.
    torch.testing.assert_close(fast[0, :40], alone[:40], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(fast[0, real][40:45], alone[40:45], atol=1e-4)


def test_config_output_hidden_states_and_return_dict_are_the_defaults():
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 5))
    model.config.output_hidden_states = True
    model.config.return_dict = False
    with torch.no_grad():
        as_tuple = model(ids)
        as_output = model(ids, return_dict=True, output_hidden_states=False)
        base = model.model(ids)
    assert isinstance(as_tuple, tuple)
    assert len(as_tuple[-1]) == model.config.num_hidden_layers + 1  # the hidden states, last
    torch.testing.assert_close(as_tuple[0], as_output.logits)
    assert as_output.hidden_states is None
    assert isinstance(base, tuple) and len(base[-1]) == model.config.num_hidden_layers + 1


@pytest.mark.parametrize("name", ["gated-delta-window-sinks", "elu", "qwen3-like-hybrid", "hedgehog-window-sinks",
                                  "elu-scalar-decay", "gated-delta-conv", "hedgehog-window-sinks-vector-decay"])
def test_torch_export_of_the_no_cache_forward_matches_eager(name):
    model = tiny_model(**VARIANTS[name])
    ids = torch.randint(3, 128, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kwargs = {"attention_mask": mask, "use_cache": False}
    exported = torch.export.export(model, (ids,), kwargs)
    other_ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        for x in (ids, other_ids):
            torch.testing.assert_close(exported.module()(x, **kwargs).logits, model(x, **kwargs).logits)
    plain = torch.export.export(model, (ids,), {"use_cache": False})
    torch.testing.assert_close(plain.module()(other_ids, use_cache=False).logits,
                               model(other_ids, use_cache=False).logits)


@pytest.mark.parametrize("name", ["t2r-vector-decay", "gated-delta-conv", "gated-delta-window-sinks"])
def test_labels_give_shifted_cross_entropy_and_gradients_reach_every_parameter(name):
    model = tiny_model(**VARIANTS[name]).train()
    ids = torch.randint(3, 128, (2, 33))
    out = model(ids, labels=ids)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_window_gate_and_hedgehog_receive_gradients():
    model = tiny_model(**VARIANTS["hedgehog-window-sinks"]).train()
    ids = torch.randint(3, 128, (1, 30))
    model(ids, labels=ids).loss.backward()
    attn = model.model.layers[0].self_attn
    assert attn.window_gate.grad.abs().sum() > 0
    assert attn.feature_map_q.weight.grad.abs().sum() > 0


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(3, 128, (2, 20))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(**VARIANTS["elu-scalar-decay"]).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert model.model.layers[0].gradient_checkpointing
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


def test_logits_to_keep():
    model = tiny_model()
    ids = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        last = model(ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, 128)
    torch.testing.assert_close(last, full[:, -1:])


def test_return_dict_false_and_hidden_states():
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        as_tuple = model(ids, return_dict=False)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    torch.testing.assert_close(as_tuple[0], out.logits)


def manual_greedy(model, ids, steps):
    for _ in range(steps):
        with torch.no_grad():
            next_id = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids


@pytest.mark.parametrize("name", ["elu", "hedgehog-window-sinks", "qwen3-like-hybrid"])
def test_generate_without_cache_matches_manual_greedy(name):
    model = tiny_model(**VARIANTS[name])
    ids = prompts([7])[0][None]
    out = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False, eos_token_id=None)
    torch.testing.assert_close(out, manual_greedy(model, ids, 6))


def test_generate_left_padded_batch_without_cache_equals_each_alone():
    model = tiny_model(**VARIANTS["elu-scalar-decay"])
    seqs = prompts([9, 4])
    ids, mask = left_pad(seqs)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=False,
                         eos_token_id=None, pad_token_id=0)
    for row, s in enumerate(seqs):
        alone = model.generate(s[None], max_new_tokens=5, do_sample=False, use_cache=False, eos_token_id=None)
        torch.testing.assert_close(out[row, -5:], alone[0, -5:])


@pytest.mark.parametrize("name", ["elu-scalar-decay", "gated-delta-conv", "gated-delta-window-sinks"])
def test_bf16_forward_is_close_to_fp32(name):
    model = tiny_model(**VARIANTS[name])
    ids = torch.randint(3, 128, (2, 70))
    with torch.no_grad():
        ref = model(ids).logits
        out = model.to(torch.bfloat16)(ids).logits
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("name", VARIANTS)
def test_bf16_autocast_training_step_is_close_to_fp32(name):
    """Mixed precision (`--mixed_precision bf16`: fp32 weights, bf16 autocast) runs every kind of attention forward and
    backward, and its loss and gradients stay close to fp32's (the ops pick their own accumulation precision)."""
    ids = torch.randint(3, 128, (2, 70))
    losses, grads = [], []
    for autocast in (False, True):
        model = tiny_model(**VARIANTS[name])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert losses[1] == pytest.approx(losses[0], rel=0.02)
    assert F.cosine_similarity(grads[0], grads[1], dim=0) > 0.98


def test_tied_embeddings_share_storage():
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    untied = tiny_model(tie_word_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_resize_token_embeddings():
    model = tiny_model(tie_word_embeddings=True)
    model.resize_token_embeddings(200)
    assert model.config.vocab_size == 200
    assert model.lm_head.weight.shape == (200, 64)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert model(torch.tensor([[199, 5]])).logits.shape == (1, 2, 200)


def test_base_model_returns_hidden_states():
    torch.manual_seed(0)
    model = LinearAttentionModel(tiny_model().config).eval()
    with torch.no_grad():
        out = model(torch.randint(3, 128, (1, 6)))
    assert out.last_hidden_state.shape == (1, 6, 64)


def test_peft_lora_on_attention_projections():
    peft = pytest.importorskip("peft")
    model = tiny_model(**VARIANTS["hedgehog-window-sinks"])
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        init_lora_weights=False),
    )
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert sum("q_proj" in n for n in trainable) == 2 * model.config.num_hidden_layers
    ids = torch.randint(3, 128, (1, 20))
    lora.train()
    lora(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in lora.named_parameters() if p.requires_grad)
    lora.eval()
    with torch.no_grad():
        with_adapters = lora(input_ids=ids).logits
        merged = lora.merge_and_unload()
        assert isinstance(merged, LinearAttentionForCausalLM)
        torch.testing.assert_close(merged(ids).logits, with_adapters, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["elu-scalar-decay", "t2r-vector-decay", "hedgehog-window-sinks",
                                  "qwen3-like-hybrid", "gated-delta-conv", "hedgehog-window-sinks-vector-decay",
                                  "gated-delta-window-sinks"])
@pytest.mark.parametrize("starts", [(0, 0, 0, 0), (5, 40, 0, 3)], ids=["restarts", "offsets"])
def test_packed_documents_equal_each_document_alone(name, starts):
    """DataCollatorWithFlattening's format: one row, position_ids restarting at 0 at each document; or each
    document at its own first position (training with position offsets), a document starting wherever the
    position does not step by one."""
    model = tiny_model(**VARIANTS[name])
    docs = prompts([9, 70, 1, 23], seed=7)
    ids = torch.cat(docs)[None]
    positions = [torch.arange(len(d)) + start for d, start in zip(docs, starts, strict=True)]
    with torch.no_grad():
        packed = model(ids, position_ids=torch.cat(positions)[None]).logits[0]
        alone = torch.cat([model(d[None], position_ids=p[None]).logits[0]
                           for d, p in zip(docs, positions, strict=True)])
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(ids, position_ids=torch.cat(positions)[None], use_cache=True)


def test_packed_documents_work_with_the_flattening_collator_and_train():
    from transformers import DataCollatorWithFlattening

    model = tiny_model(**VARIANTS["elu-scalar-decay"]).train()
    features = [{"input_ids": d.tolist()} for d in prompts([12, 30, 5], seed=8)]
    batch = DataCollatorWithFlattening()(features)
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
    labels = [torch.tensor([-100] + f["input_ids"][1:]) for f in features]
    assert torch.equal(batch["labels"][0], torch.cat(labels))  # the collator masks each document's first label
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_causal_conv1d_is_the_sum_over_the_last_inputs_and_continues_from_past():
    torch.manual_seed(0)
    x, weight = torch.randn(2, 9, 5), torch.randn(5, 1, 4)
    y, last = causal_conv1d(x, weight)
    padded = torch.cat([torch.zeros(2, 3, 5), x], dim=1)
    expected = torch.stack([(padded[:, t : t + 4] * weight[:, 0].T).sum(1) for t in range(9)], dim=1)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(last, x[:, -3:])
    head, tail = causal_conv1d(x[:, :2], weight)  # shorter than the width: the zeros before it are kept
    assert tail.shape == (2, 3, 5) and torch.equal(tail[:, 0], torch.zeros(2, 5))
    rest, last_again = causal_conv1d(x[:, 2:], weight, tail)
    torch.testing.assert_close(torch.cat([head, rest], dim=1), y)
    torch.testing.assert_close(last_again, last)
    past, stepwise = None, []
    for t in range(9):  # one token at a time: a decode step's weighted sum
        out, past = causal_conv1d(x[:, t : t + 1], weight, past)
        stepwise.append(out)
    torch.testing.assert_close(torch.cat(stepwise, dim=1), y)
    torch.testing.assert_close(past, last)


def test_delta_layer_is_gated_deltanet_from_its_parts():
    """One delta layer, written out: conv, RoPE, φ then L2 norm, β = sigmoid, the op's recurrent oracle, output
    norm and gate; it equals the layer's forward. Its new parameters: β projection, conv and gate."""
    model = tiny_model(**VARIANTS["gated-delta-conv"])
    attn = model.model.layers[1].self_attn
    assert attn.beta_proj.weight.shape == (4, 64) and attn.g_proj.weight.shape == (64, 64)
    assert attn.qkv_conv.weight.shape == (128, 1, 4)  # (4 + 2 * 2) heads of 16 channels, width 4
    x = torch.randn(2, 11, 64)
    position_embeddings = model.model.rotary_emb.rotation(x, torch.arange(11).expand(2, 11))
    with torch.no_grad():
        q, k, v = attn.project_unrotated(x)
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
        weight = attn.qkv_conv.weight[:, 0]  # [C, 4]
        padded = torch.cat([torch.zeros(2, 3, 128), qkv], dim=1)
        qkv = torch.stack([(padded[:, t : t + 4] * weight.T).sum(1) for t in range(11)], dim=1)
        q, k, v = (part.reshape(2, 11, -1, 16) for part in qkv.split([64, 32, 32], dim=-1))
        cos, sin, _ = position_embeddings
        q, k = apply_rotary(q, k, cos, sin)
        k = k.repeat_interleave(2, dim=2)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        beta = torch.sigmoid(attn.beta_proj(x))
        log_decay = F.logsigmoid(attn.decay_proj(x)) / 16
        o, _ = recurrent_delta_rule(q, k, v.repeat_interleave(2, dim=2), beta, log_decay, scale=16**-0.5)
        o = attn.o_norm(o) * F.silu(attn.g_proj(x)).view(2, 11, 4, 16)
        expected = attn.o_proj(o.reshape(2, 11, 64))
        torch.testing.assert_close(attn(x, position_embeddings), expected, atol=1e-5, rtol=1e-4)


def test_delta_pad_steps_leave_the_state_unchanged():
    """β = 0 and log a = 0 at pads: S ← (I − 0) S + 0. Pads after a prompt leave its final state as it was."""
    model = tiny_model(**VARIANTS["delta"], decay="scalar")
    seq = prompts([20], seed=3)[0][None]
    ids = torch.cat([seq, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    mask = (torch.arange(25) < 20).long()[None]
    with torch.no_grad():
        plain, padded = LinearAttentionCache(model.config), LinearAttentionCache(model.config)
        model(seq, cache=plain)
        model(ids, attention_mask=mask, cache=padded)
    for a, b in zip(plain.layers, padded.layers, strict=True):
        torch.testing.assert_close(a.state, b.state, atol=1e-6, rtol=1e-5)
        assert a.state.abs().sum() > 0


@pytest.mark.parametrize("feature_map, decay", [("relu", "fixed"), ("t2r", "none"), ("hedgehog", "scalar")])
def test_delta_rule_with_each_allowed_feature_map_and_decay_matches_the_oracle(feature_map, decay):
    learned = {"feature_dim": 8} if feature_map in ("t2r", "hedgehog") else {}
    model = tiny_model(update_rule="delta", normalize=False, feature_map=feature_map, decay=decay, **learned)
    ids = torch.randint(3, 128, (2, 70))
    with torch.no_grad():
        fast = model(ids).logits
        model.config.linear_attention_backend = "recurrent"
        slow = model(ids).logits
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("weight", [0.5, 0.95])
@pytest.mark.parametrize("update_rule", ["additive", "delta"])
def test_initial_window_weight(update_rule, weight):
    """An additive window hybrid starts with γ = sigmoid(window_gate) = window_weight in every head; the delta-rule
    window starts with λ = window_gate = 0 (its state part off), whatever window_weight says."""
    options = {"normalize": False, "feature_map": "identity"} if update_rule == "delta" else {"normalize": True}
    model = LinearAttentionForCausalLM(tiny_config(window_size=6, update_rule=update_rule, window_weight=weight,
                                                   **options))
    for layer in model.model.layers:
        gate = layer.self_attn.window_gate
        expected = torch.full_like(gate, weight) if update_rule == "additive" else torch.zeros_like(gate)
        torch.testing.assert_close(torch.sigmoid(gate) if update_rule == "additive" else gate, expected)


def test_set_window_weight_sets_gamma_in_every_window_head_and_refuses_what_it_cannot_set():
    model = LinearAttentionForCausalLM(tiny_config(window_size=6, normalize=True, softmax_layers=[0],
                                                   softmax_heads={1: [0]}))
    model.set_window_weight(0.99)
    gates = [layer.self_attn.window_gate for layer in model.model.layers[1:]]
    assert gates and all(torch.allclose(torch.sigmoid(gate), torch.full_like(gate, 0.99)) for gate in gates)
    assert model.config.window_weight == 0.99
    for bad in (0, 1.0, float("nan"), "0.9"):
        with pytest.raises((ValueError, TypeError), match="window_weight"):
            model.set_window_weight(bad)
    assert model.config.window_weight == 0.99
    # no γ anywhere: no window, the delta rule behind a window, every layer softmax
    for config in (tiny_config(), tiny_config(window_size=6, update_rule="delta", normalize=False),
                   tiny_config(window_size=6, softmax_layers=[0, 1])):
        with pytest.raises(ValueError, match="has a γ to set, and this model has none"):
            LinearAttentionForCausalLM(config).set_window_weight(0.9)


@pytest.mark.parametrize("horizon", [2048, 256])
@pytest.mark.parametrize("window_size", [0, 6])
@pytest.mark.parametrize("decay", ["fixed", "scalar", "vector"])
def test_initial_decays(decay, window_size, horizon):
    """At init a window hybrid's data-dependent gate (its last projection zero) gives a = 1 − 1/decay_horizon for
    every token; fixed decay is γ_h = 1 − 2^(−8−h). Linear layers keep theirs: RetNet's 1 − 2^(−5−h), and gates of
    the default init."""
    torch.manual_seed(0)
    model = LinearAttentionForCausalLM(tiny_config(decay=decay, window_size=window_size, normalize=True,
                                                   decay_low_rank_dim=4, decay_horizon=horizon))
    layer = model.model.layers[0].self_attn
    x = torch.randn(2, 7, model.config.hidden_size)
    log_decay = layer.log_decay(x)
    heads = model.config.num_attention_heads
    if decay == "fixed":
        first = 8 if window_size else 5
        gamma = 1 - 2.0 ** (-first - torch.arange(heads, dtype=torch.float64))
        torch.testing.assert_close(log_decay, gamma.log().float().expand(2, 7, heads), rtol=1e-6, atol=0)
    elif window_size:
        torch.testing.assert_close(log_decay, torch.full_like(log_decay, math.log(1 - 1 / horizon)), rtol=1e-5, atol=0)
        gate = layer.decay_proj if decay == "scalar" else layer.decay_proj[-1]
        assert not gate.weight.any()
        if decay == "vector":
            assert layer.decay_proj[0].weight.std() > 0  # the low-rank input keeps its random init
    else:
        assert log_decay.std() > 0 and log_decay.max() < math.log(0.99)  # default gate: a ≈ 0.96, data-dependent


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_hybrid_decay_gate_trains_from_its_zero_init(decay):
    torch.manual_seed(0)  # the documented init, not tiny_model's strong decays
    model = LinearAttentionForCausalLM(tiny_config(decay=decay, window_size=4, num_sink_tokens=1,
                                                   decay_low_rank_dim=4)).train()
    ids = torch.randint(3, 128, (2, 30))
    model(ids, labels=ids).loss.backward()
    layer = model.model.layers[0].self_attn
    gate = layer.decay_proj if decay == "scalar" else layer.decay_proj[-1]
    assert gate.weight.grad.abs().sum() > 0 and gate.bias.grad.abs().sum() > 0


@pytest.mark.parametrize("decay", ["fixed", "scalar", "vector"])
def test_converted_hybrid_with_decay_starts_close_to_the_undecayed_one(decay):
    """Conversion with a decay starts where the undecayed hybrid does, up to the slow long-memory decay (measured
    at 40 tokens: 7e-4 fixed, 1.4e-4 scalar and vector; a linear layer's default gate, a ≈ 0.96, gives 1.2e-2)."""
    source = teacher("llama")
    options = dict(feature_map="hedgehog", feature_dim=8, window_size=4, num_sink_tokens=1)
    plain = convert_to_linear_attention(source, **options)
    decayed = convert_to_linear_attention(source, decay=decay, **options)
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = plain(ids).logits, decayed(ids).logits
    difference = (got - expected).abs().max() / expected.abs().max()
    assert 0 < difference < 2e-3, difference


def test_window_layers_pass_a_mask_to_the_op_only_when_something_is_padded(monkeypatch):
    """No padding, no mask: on a GPU "auto" may then run the Triton window kernels (it avoids them for masks)."""
    import hf_linear_attn.modeling_linear_attention as modeling

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["key_padding_mask"])
        return window_attention(*args, **kwargs)

    window_attention = modeling.window_attention
    monkeypatch.setattr(modeling, "window_attention", spy)
    model = tiny_model(**VARIANTS["hedgehog-window-sinks"])
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        model(ids, use_cache=False)
        assert seen and all(mask is None for mask in seen)
        seen.clear()
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        model(ids, attention_mask=mask, use_cache=False)
    assert seen and all(m is not None and not m[1, :3].any() for m in seen)


DELTA_WINDOW = dict(update_rule="delta", normalize=False, feature_map="hedgehog", feature_dim=8, decay="fixed",
                    window_size=4, num_sink_tokens=2, output_norm=True, output_gate=True)


def test_delta_window_layer_is_window_softmax_plus_the_delta_rule_of_tokens_that_left():
    """One delta-rule window layer, written out token by token on a left-padded batch: exact softmax over the window
    and the sinks, plus λ_h · gate(norm(S_tᵀ q̂_t / √K)), where S takes token j = t − W at step t (decayed by a_t;
    nothing enters for a sink, a pad or j < 0) by the delta rule. It equals the layer's forward."""
    model = tiny_model(**DELTA_WINDOW)
    attn = model.model.layers[1].self_attn
    window, sinks, heads, head_dim, features = 4, 2, 4, 16, 16
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :3] = False
    x = torch.randn(2, 13, 64)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    position_embeddings = model.model.rotary_emb.rotation(x, positions)
    with torch.no_grad():
        got = attn(x, position_embeddings, mask)
        q, k, v = attn.project(x, position_embeddings)
        k, v = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)  # [B, T, H, D]
        q_hat, k_hat = F.normalize(attn.feature_map_q(q), dim=-1), F.normalize(attn.feature_map_k(k), dim=-1)
        beta = torch.sigmoid(attn.beta_proj(x))
        decay = 1 - 2.0 ** (-8 - torch.arange(heads))  # the window hybrid's fixed γ_h
        read, soft = torch.zeros(2, 13, heads, head_dim), torch.zeros(2, 13, heads, head_dim)
        for row in range(2):
            rank = mask[row].long().cumsum(0) - 1
            is_sink = mask[row] & (rank < sinks)
            state = torch.zeros(heads, features, head_dim)
            for t in range(13):
                if mask[row, t]:
                    state = decay[:, None, None] * state
                j = t - window
                if j >= 0 and mask[row, j] and not is_sink[j]:
                    kj, b = k_hat[row, j], beta[row, j][:, None, None]  # [H, K], [H, 1, 1]
                    erased = state - b * kj[:, :, None] * (kj[:, None, :] @ state)
                    state = erased + b * kj[:, :, None] * v[row, j][:, None]
                if not mask[row, t]:
                    continue
                read[row, t] = (q_hat[row, t, :, None, :] @ state)[:, 0] * features**-0.5
                seen = [i for i in range(t + 1) if mask[row, i] and (t - i < window or is_sink[i])]
                scores = torch.einsum("hd,ihd->hi", q[row, t], k[row, seen]) * head_dim**-0.5
                soft[row, t] = torch.einsum("hi,ihd->hd", scores.softmax(-1), v[row, seen])
        state_part = attn.o_norm(read) * F.silu(attn.g_proj(x)).view(2, 13, heads, head_dim)
        o = soft + attn.window_gate.view(heads, 1) * state_part
        expected = attn.o_proj(o.reshape(2, 13, -1))
    real = mask
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-4)
    assert state_part[real].abs().amax() > 0.1  # the state part is not negligible
