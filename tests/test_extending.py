"""Extending the model (docs/extending.md): what attention transfer trains is what the layers declare, and a feature
map defined outside the package, once registered, is a config value, runs in the model as the oracle computes it,
and trains in attention transfer."""

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import VARIANTS, teacher, tiny_config, tiny_model
from torch import nn
from transformers import initialization as init

from hf_linear_attn import (
    FeatureMap,
    InputError,
    LinearAttentionConfig,
    convert_to_linear_attention,
    register_feature_map,
)
from hf_linear_attn.conversion import GATED_DELTANET_OPTIONS, GATED_DELTANET_WINDOW_OPTIONS
from hf_linear_attn.feature_maps import FEATURE_MAP_REGISTRY, per_head_projection
from hf_linear_attn.modeling_linear_attention import LinearAttention
from hf_linear_attn.ops_reference import recurrent_linear_attention
from hf_linear_attn.training.attention_transfer import (
    AttentionTransfer,
    attention_transfer_loss,
    select_transfer_parameters,
)

# The parts attention transfer trains, by name (what `--trainable_parameters` defaulted to before the layers declared
# it): the declared selection must be exactly these on every variant, so that what stage 1 trains only changes on
# purpose. A new part meant to train there is named here too.
TRAINED_PARTS = r"feature_map|window_gate|decay_proj|beta_proj|qkv_conv|g_proj"


def declared(model) -> set[str]:
    return {f"{prefix}.{name}" for prefix, layer in model.named_modules() if isinstance(layer, LinearAttention)
            for name in layer.attention_transfer_parameters()}


def by_name(model) -> set[str]:
    return {name for name, _ in model.named_parameters() if re.search(TRAINED_PARTS, name)}


@pytest.mark.parametrize("name", VARIANTS)
def test_the_declared_selection_is_the_named_one_on_every_variant(name):
    model = tiny_model(**VARIANTS[name])
    assert declared(model) == by_name(model)


@pytest.mark.parametrize("options", [
    dict(softmax_heads={0: [1]}),  # the LoLCATs default (hedgehog, window, sinks) with a softmax head
    dict(GATED_DELTANET_OPTIONS, softmax_heads={1: [0]}),
    dict(GATED_DELTANET_WINDOW_OPTIONS, window_size=8, num_sink_tokens=2),
    dict(feature_map="t2r", feature_dim=8, decay="vector", decay_low_rank_dim=4, output_norm=True, softmax_layers=[0]),
], ids=["softmax-heads", "delta-softmax-heads", "delta-window", "t2r-output-norm-softmax-layer"])
def test_the_declared_selection_is_the_named_one_on_converted_models(options):
    student = convert_to_linear_attention(teacher("llama"), **options)
    assert declared(student) == by_name(student) != set()
    assert select_transfer_parameters(student) == [n for n, p in student.named_parameters() if n in by_name(student)]


def test_an_explicit_selection_overrides_and_nothing_to_train_is_refused():
    model = tiny_model(**VARIANTS["hedgehog-window-sinks"])
    assert select_transfer_parameters(model, ["window_gate"]) == [
        f"model.layers.{i}.self_attn.window_gate" for i in range(2)]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == select_transfer_parameters(model, [
        "window_gate"])
    with pytest.raises(InputError, match="no parameter attention transfer trains"):
        select_transfer_parameters(tiny_model(**VARIANTS["identity-fixed-decay"]))


class SoftplusProjection(FeatureMap):
    """A map defined outside the package: φ(x) = softplus(x W_h) per head; K = F, learned, positive."""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int) -> None:
        super().__init__(num_heads, head_dim, feature_dim)
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, feature_dim))

    @staticmethod
    def output_size(head_dim: int, feature_dim: int) -> int:
        return feature_dim

    def initialize(self) -> None:
        init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(per_head_projection(x, self.weight))


@pytest.fixture
def softplus_map():
    """`SoftplusProjection` registered as "softplus_test_map" (for the delta rule too), for one test: conftest.py puts
    the registry back after each test."""
    register_feature_map("softplus_test_map", takes_feature_dim=True, delta_rule=True)(SoftplusProjection)
    return "softplus_test_map"


def test_a_registered_map_is_a_config_value(softplus_map, tmp_path):
    config = tiny_config(feature_map=softplus_map, feature_dim=8, update_rule="delta", normalize=False)
    assert config.feature_output_dim == 8
    config.save_pretrained(tmp_path)
    assert LinearAttentionConfig.from_pretrained(tmp_path).feature_map == softplus_map
    register_feature_map(softplus_map, takes_feature_dim=True, delta_rule=True)(SoftplusProjection)  # again: a no-op
    with pytest.raises(ValueError, match="taken by SoftplusProjection"):
        register_feature_map(softplus_map)(SoftplusProjection)
    with pytest.raises(TypeError, match="subclass of FeatureMap"):
        register_feature_map("plain_module")(nn.Identity)
    with pytest.raises(TypeError, match=r"does not implement \['output_size', 'forward'\]"):
        register_feature_map("empty")(type("Empty", (FeatureMap,), {}))
    assert "plain_module" not in FEATURE_MAP_REGISTRY and "empty" not in FEATURE_MAP_REGISTRY


def test_an_unregistered_map_is_refused_naming_the_registration():
    assert "softplus_test_map" not in FEATURE_MAP_REGISTRY  # an earlier test's registration is gone
    with pytest.raises(InputError, match="register_feature_map"):
        tiny_config(feature_map="softplus_test_map")


def test_a_registered_map_runs_as_the_oracle_computes_it(softplus_map):
    """The layer with the registered map (scalar decay, normalised, chunked backend) equals the recurrence of
    ops_reference on φ(q), φ(k) of the map, with the layer's own decay, output norm and projections."""
    model = tiny_model(feature_map=softplus_map, feature_dim=8, decay="scalar", output_norm=True)
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.feature_map_q, SoftplusProjection) and attn.key_dim == 8
    x = torch.randn(2, 70, 64)
    position_embeddings = model.model.rotary_emb.rotation(x, torch.arange(70).expand(2, 70))
    with torch.no_grad():
        q, k, v = attn.project(x, position_embeddings)
        q_feat, k_feat = attn.feature_map_q(q), attn.feature_map_k(attn.repeat_kv(k))
        o, _ = recurrent_linear_attention(q_feat, k_feat, attn.repeat_kv(v), attn.log_decay(x)[..., None],
                                          scale=8**-0.5, normalize=True)
        expected = attn.project_out(attn.o_norm(o))
        torch.testing.assert_close(attn(x, position_embeddings), expected, atol=1e-5, rtol=1e-4)


def test_a_registered_map_trains_in_one_attention_transfer_step(softplus_map):
    """Converted with the registered map, the default stage-1 selection holds its weights; one step moves them and
    nothing of the teacher's."""
    torch.manual_seed(0)
    student = convert_to_linear_attention(teacher("llama"), feature_map=softplus_map, feature_dim=8, window_size=0,
                                          num_sink_tokens=0).train()
    trained = select_transfer_parameters(student)
    assert trained == [f"model.layers.{i}.self_attn.feature_map_{side}.weight" for i in range(2) for side in "qk"]
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=1e-2)
    with AttentionTransfer(student):
        batch = {"input_ids": torch.randint(0, 96, (2, 24)), "position_ids": torch.arange(24).expand(2, 24)}
        loss, _ = attention_transfer_loss(student, batch)
        loss.mean().backward()
        optimizer.step()
    for name, p in student.named_parameters():
        assert torch.equal(p, before[name]) == (name not in trained), name
