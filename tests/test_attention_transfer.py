"""Attention transfer (training/attention_transfer.py): the loss against a direct computation, teacher
forcing, what trains, and the hooks leaving the model as it was."""

import pytest
import torch
from helpers import teacher, tiny_model
from torch import nn

from hf_linear_attn import convert_to_linear_attention
from hf_linear_attn.modeling_linear_attention import LinearAttention, causal_softmax_attention
from hf_linear_attn.training.attention_transfer import AttentionTransfer, attention_transfer_loss

VARIANTS = {
    "window": dict(feature_map="hedgehog", feature_dim=8, window_size=4, num_sink_tokens=1),
    "decayed_normed_with_softmax_layer": dict(feature_map="t2r", decay="vector", decay_low_rank_dim=4,
                                              output_norm=True, softmax_layers=[0]),
}


def direct_transfer_losses(model, ids, mask, position_ids, cu_seqlens) -> list[torch.Tensor]:
    """The per-layer transfer MSE computed by hand from the model's parts: each linear layer's per-head output
    (its `o_proj` swapped for the identity) against `causal_softmax_attention` of its own q/k/v, over real
    tokens, with the teacher's output passed on to the next layer."""
    decoder = model.model
    hidden = decoder.embed_tokens(ids)
    position_embeddings = decoder.rotary_emb.rotation(hidden, position_ids)
    losses = []
    for layer in decoder.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        if isinstance(attn, LinearAttention):
            q, k, v = attn.project(x, position_embeddings)
            expected = causal_softmax_attention(
                q.transpose(1, 2), attn.repeat_kv(k).transpose(1, 2), attn.repeat_kv(v).transpose(1, 2), mask,
                cu_seqlens,
            ).transpose(1, 2)  # [B, T, H, D]
            o_proj, attn.o_proj = attn.o_proj, nn.Identity()
            own = attn(x, position_embeddings, mask, None, cu_seqlens).view_as(expected)
            attn.o_proj = o_proj
            error = (own - expected).pow(2)
            losses.append((error if mask is None else error[mask]).mean())
            hidden = hidden + o_proj(expected.flatten(2))
        else:
            hidden = hidden + attn(x, position_embeddings, mask, None, cu_seqlens)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return losses


@pytest.mark.parametrize("layout", ["left_padded", "packed"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_transfer_loss_is_the_per_layer_mse_against_causal_softmax_attention(variant, layout):
    model = tiny_model(**VARIANTS[variant])
    ids = torch.randint(3, 128, (2, 24))
    if layout == "left_padded":
        attention_mask = torch.ones(2, 24, dtype=torch.long)
        attention_mask[1, :5] = 0
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        mask, cu_seqlens, kwargs = attention_mask.bool(), None, {"attention_mask": attention_mask}
    else:  # three documents packed into one row, as the distillation runs them
        ids = ids[:1]
        position_ids = torch.cat([torch.arange(10), torch.arange(5), torch.arange(9)])[None]
        mask, cu_seqlens, kwargs = None, torch.tensor([0, 10, 15, 24]), {"position_ids": position_ids}
    with torch.no_grad():
        expected = direct_transfer_losses(model, ids, mask, position_ids, cu_seqlens)
        with AttentionTransfer(model) as transfer:
            loss = model(ids, use_cache=False, **kwargs).loss
    assert len(transfer.layer_losses) == len(expected) == 2 - len(VARIANTS[variant].get("softmax_layers", []))
    torch.testing.assert_close(torch.stack(transfer.layer_losses), torch.stack(expected), rtol=1e-5, atol=0)
    torch.testing.assert_close(loss, torch.stack(expected).sum(), rtol=1e-5, atol=0)
    assert (loss > 0).all()


def test_attention_transfer_passes_the_teacher_on_and_trains_only_feature_maps():
    source = teacher("llama")
    student = convert_to_linear_attention(source, feature_map="hedgehog", feature_dim=8, window_size=6,
                                          num_sink_tokens=2).train()
    for name, p in student.named_parameters():
        p.requires_grad_("feature_map" in name or "window_gate" in name)
    ids = torch.randint(0, 96, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0  # a left-padded row: pads are left out of the loss
    with AttentionTransfer(student) as transfer:
        output = student(ids, attention_mask=mask, use_cache=False)
    with torch.no_grad():
        expected = source(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(output.logits[real], expected[real], atol=2e-5, rtol=1e-4)  # teacher forcing
    assert (torch.stack(transfer.layer_losses) > 0).all()
    output.loss.backward()
    for name, p in student.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_leaving_the_block_restores_the_model_and_bad_calls_fail_before_any_work():
    model = tiny_model(feature_map="hedgehog", softmax_layers=[1])
    ids = torch.randint(3, 128, (2, 16))
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
        transfer = AttentionTransfer(model)
        with transfer:
            for kwargs, message in [({"use_cache": True}, "without a cache"), ({"labels": ids}, "labels"),
                                    ({"return_dict": False}, "return_dict")]:
                with pytest.raises(ValueError, match=message):
                    model(ids, **kwargs)
            with pytest.raises(RuntimeError, match="already installed"):
                transfer.__enter__()
        after = model(ids, use_cache=False)
    assert after.loss is None
    torch.testing.assert_close(after.logits, before, rtol=0, atol=0)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    batch = {"input_ids": ids, "position_ids": torch.arange(16).expand(2, 16)}
    with pytest.raises(RuntimeError, match="inside `with AttentionTransfer"):
        attention_transfer_loss(model, batch)
    with pytest.raises(TypeError, match="LinearAttentionForCausalLM"):
        AttentionTransfer(model.model)
    with pytest.raises(ValueError, match="no linear-attention layer"):
        AttentionTransfer(tiny_model(softmax_layers=[0, 1]))


def test_window_dropout_shrinks_each_window_for_one_training_forward_as_drawn():
    model = tiny_model(feature_map="hedgehog", feature_dim=8, window_size=6, num_sink_tokens=1, num_hidden_layers=3,
                       softmax_layers=[1]).train()
    ids = torch.randint(3, 128, (1, 24))
    position_ids = torch.arange(24)[None]
    transfer = AttentionTransfer(model, window_dropout=0.5)
    drawn, checked = [], 0
    torch.manual_seed(0)
    with transfer, torch.no_grad():
        for _ in range(60):
            model(ids, use_cache=False)
            drawn.append(list(transfer.windows))
            assert [layer.window_size for layer in transfer.layers] == [6, 6]  # put back after each forward
            if max(drawn[-1]) == 6:
                continue
            # Both windows shrunk: the losses are those of the layers run with the windows drawn (set by hand).
            losses = torch.stack(transfer.layer_losses)
            for layer, window in zip(transfer.layers, drawn[-1], strict=True):
                layer.window_size = window
            expected = torch.stack(direct_transfer_losses(model, ids, None, position_ids, None))
            for layer in transfer.layers:
                layer.window_size = 6
            torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
            checked += 1
        assert checked > 5
        # Evaluation forwards draw nothing and leave the torch RNG alone.
        model.eval()
        rng = torch.get_rng_state()
        model(ids, use_cache=False)
        assert transfer.windows == [6, 6] and torch.equal(torch.get_rng_state(), rng)
    sizes = [w for row in drawn for w in row]
    shrunk = [w for w in sizes if w < 6]
    assert 0.3 < len(shrunk) / len(sizes) < 0.7 and set(shrunk) == {1, 2, 3, 4, 5}  # 120 draws at p = 0.5
    # The same seed draws the same windows: a run resumed with its RNG state shrinks as the first run did.
    torch.manual_seed(0)
    with AttentionTransfer(model.train(), window_dropout=0.5) as again, torch.no_grad():
        replay = []
        for _ in range(60):
            model(ids, use_cache=False)
            replay.append(list(again.windows))
    assert replay == drawn
    assert [layer.window_size for layer in transfer.layers] == [6, 6]


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, True, "0.5", None])
def test_window_dropout_must_be_a_probability_below_one(value):
    with pytest.raises(ValueError, match=r"window_dropout=.*probability in \[0, 1\)"):
        AttentionTransfer(tiny_model(feature_map="hedgehog", window_size=4), window_dropout=value)


def test_window_dropout_needs_a_window_to_shrink():
    for options in [dict(feature_map="hedgehog"), dict(feature_map="hedgehog", window_size=1)]:
        with pytest.raises(ValueError, match="no sliding window to shrink"):
            AttentionTransfer(tiny_model(**options), window_dropout=0.2)
    AttentionTransfer(tiny_model(feature_map="hedgehog"), window_dropout=0.0)  # 0 is fine without a window
