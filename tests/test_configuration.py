import ast
import json
import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_model
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hf_linear_attn import LinearAttentionConfig, backends, configuration_linear_attention, ops
from hf_linear_attn.backends import BACKENDS, OP_BACKENDS
from hf_linear_attn.configuration_linear_attention import ATTENTION_OPTIONS, FEATURE_MAPS, AttentionOptions
from hf_linear_attn.feature_maps import build_feature_map
from hf_linear_attn.modeling_linear_attention import LinearAttentionRotaryEmbedding


def test_defaults_are_valid_and_round_trip(tmp_path):
    config = tiny_config(feature_map="hedgehog", feature_dim=8, window_size=16, num_sink_tokens=2,
                         softmax_layers=[1])
    config.save_pretrained(tmp_path)
    loaded = LinearAttentionConfig.from_pretrained(tmp_path)
    for field in ("feature_map", "feature_dim", "window_size", "num_sink_tokens", "softmax_layers",
                  "num_key_value_heads", "head_dim", "rope_parameters", "normalize", "decay"):
        assert getattr(loaded, field) == getattr(config, field), field
    assert loaded.model_type == "linear_attention"
    assert loaded.head_dim == 16


def test_attention_options_are_declared_once():
    """The config takes exactly the fields of `AttentionOptions`, with their defaults, and documents each."""
    config, declared = LinearAttentionConfig(), AttentionOptions()
    assert ATTENTION_OPTIONS == tuple(f.name for f in fields(AttentionOptions))
    assert {"feature_map", "decay_low_rank_dim", "window_size", "linear_attention_backend"} <= set(ATTENTION_OPTIONS)
    for f in fields(AttentionOptions):
        assert getattr(config, f.name) == getattr(declared, f.name), f.name
        assert f.name in config.to_dict()
        assert f"{f.name}: {f.metadata['help'][:30]}" in " ".join(LinearAttentionConfig.__doc__.split())


# Configs as the previous release saved them (the second one with the legacy `rope_scaling` key and without the
# options added since): they must keep loading, unchanged.
SAVED_CONFIG = {
    "attention_bias": False, "attention_out_bias": False,
    "auto_map": {"AutoConfig": "configuration_linear_attention.LinearAttentionConfig"},
    "base_model_name_or_path": None, "base_model_type": None, "bos_token_id": 1, "decay": "none",
    "decay_low_rank_dim": 16, "eos_token_id": 2, "feature_dim": 8, "feature_map": "hedgehog", "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "linear_attention_backend": "auto", "max_position_embeddings": 512, "mlp_bias": False,
    "model_type": "linear_attention", "normalize": True, "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_sink_tokens": 2, "output_norm": False, "pad_token_id": None,
    "rms_norm_eps": 1e-06, "rope_parameters": {"factor": 2.0, "rope_theta": 10000.0, "rope_type": "linear"},
    "rope_theta": 10000.0, "softmax_layers": [1], "tie_word_embeddings": False, "transformers_version": "5.24.0",
    "use_cache": True, "use_qk_norm": False, "vocab_size": 128, "window_size": 16,
}
LEGACY_ROPE_CONFIG = {
    **{k: v for k, v in SAVED_CONFIG.items()
       if k not in ("rope_parameters", "decay_low_rank_dim", "output_norm", "linear_attention_backend")},
    "rope_scaling": {"type": "linear", "factor": 2.0},
}


@pytest.mark.parametrize("saved", [SAVED_CONFIG, LEGACY_ROPE_CONFIG], ids=["saved", "legacy-rope"])
def test_configs_saved_by_earlier_versions_load(tmp_path, saved):
    (tmp_path / "config.json").write_text(json.dumps(saved))
    config = LinearAttentionConfig.from_pretrained(tmp_path)
    assert (config.feature_map, config.feature_dim, config.window_size, config.num_sink_tokens,
            config.softmax_layers) == ("hedgehog", 8, 16, 2, [1])
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert (config.decay_low_rank_dim, config.output_norm, config.linear_attention_backend) == (16, False, "auto")
    assert (config.update_rule, config.conv_size, config.output_gate) == ("additive", 0, False)


@pytest.mark.parametrize("decay", ["none", "fixed", "scalar", "vector"])
def test_the_window_hybrid_takes_every_decay(decay):
    config = tiny_config(window_size=8, num_sink_tokens=2, decay=decay)
    assert (config.window_size, config.decay) == (8, decay)


def test_rope_parameters_keep_scaling_type():
    config = tiny_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    assert config.rope_parameters["rope_type"] == "linear"
    assert config.rope_parameters["rope_theta"] == 5e5


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"feature_map": "cosine"}, "feature_map"),
        ({"decay": "exponential"}, "decay"),
        ({"window_size": -1}, "window_size"),
        ({"num_sink_tokens": -2, "window_size": 8}, "num_sink_tokens"),
        ({"num_sink_tokens": 2}, "num_sink_tokens"),  # sinks without a window
        ({"hidden_size": 66}, "num_attention_heads"),  # 4 heads do not divide 66
        ({"num_key_value_heads": 3}, "num_key_value_heads"),  # 3 does not divide 4
        ({"softmax_layers": [2]}, "softmax_layers"),  # only layers 0 and 1 exist
        ({"softmax_layers": [-1]}, "softmax_layers"),
        ({"feature_dim": 8}, "feature_dim"),  # elu has no feature dimension
        ({"feature_map": "t2r", "feature_dim": 0}, "feature_dim"),
        ({"window_size": 8, "normalize": False}, "normalize"),
        ({"head_dim": 7}, "head_dim"),
        ({"hidden_act": "swish2"}, "hidden_act"),
        ({"linear_attention_backend": "cuda"}, "linear_attention_backend"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters['rope_theta']"),
        ({"initializer_range": -1}, "initializer_range"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"decay_low_rank_dim": 0}, "decay_low_rank_dim"),
        ({"window_weight": 0}, "window_weight"),  # γ = 0 or 1 would be a gate logit of ∓inf
        ({"window_weight": 1.0}, "window_weight"),
        ({"window_weight": float("nan")}, "window_weight"),
        # The window cache keeps window_size + num_sink_tokens keys per layer: 10**9 would allocate ~128 GB.
        ({"window_size": 10**9}, "window_size"),
        ({"window_size": 510, "num_sink_tokens": 3}, "window_size"),  # 513 > max_position_embeddings=512
        ({"rope_parameters": {"rope_type": "ntk"}}, "rope_parameters['rope_type']"),
        ({"rope_parameters": {"rope_type": "dynamic"}}, "rope_parameters"),  # dynamic needs a factor
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
         "rope_parameters['partial_rotary_factor']"),
        ({"rope_position_cap": 1}, "rope_position_cap"),  # a cap at position 0 would leave no slow rotation at all
        # A length-dependent RoPE moves every position's rotation with the input; the cap fixes them.
        ({"rope_position_cap": 64, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_position_cap"),
        # A negative β would flatten softmax attention past the trained positions instead of sharpening it.
        ({"softmax_log_length_scale": -0.1}, "softmax_log_length_scale"),
        ({"softmax_log_length_scale": float("inf")}, "softmax_log_length_scale"),
    ],
)
def test_invalid_values_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"`{field.replace('[', '.').replace(']', '.')}`"):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    "field, value",
    [
        ("softmax_layers", [0, "1"]),
        ("softmax_layers", 1),
        ("softmax_layers", "01"),
        ("normalize", "no"),
        ("normalize", 1),  # an int is not a bool
        ("output_norm", None),
        ("rms_norm_eps", "x"),
        ("initializer_range", True),
        ("num_hidden_layers", True),  # a bool is not an int
        ("window_size", 8.0),
        ("feature_dim", True),
        ("head_dim", 16.0),
        ("vocab_size", "128"),
        ("feature_map", None),
        ("decay", 0),
        ("linear_attention_backend", ["auto"]),
        ("hidden_act", None),
        ("use_cache", "yes"),
        ("tie_word_embeddings", 1),
        ("attention_bias", None),
        ("eos_token_id", "2"),
        ("eos_token_id", [2, "3"]),
        ("pad_token_id", 0.5),
        ("base_model_type", 3),
        ("rope_theta", "x"),
        ("softmax_log_length_scale", "0.5"),
        ("softmax_log_length_scale", True),
        ("rope_parameters", "dynamic"),
        ("window_weight", "0.9"),
        ("window_weight", True),
    ],
)
def test_values_of_the_wrong_type_raise_naming_the_field_and_the_value(field, value):
    with pytest.raises(TypeError) as error:
        tiny_config(**{field: value})
    message = str(error.value)
    assert f"`{field}`" in message and repr(value) in message, message


def test_window_may_reach_max_position_embeddings():
    assert tiny_config(window_size=508, num_sink_tokens=4).window_size == 508
    assert tiny_config(softmax_layers=(1, 0, 1)).softmax_layers == [0, 1]


def test_attention_options_check_themselves():
    """The scripts build `AttentionOptions` from their flags: the same checks apply without a config."""
    with pytest.raises(ValueError, match="`normalize`"):
        AttentionOptions(window_size=8, normalize=False)
    with pytest.raises(ValueError, match="`decay`"):
        AttentionOptions(decay="exponential")
    with pytest.raises(TypeError, match="`window_size`"):
        AttentionOptions(window_size="64")
    assert AttentionOptions(softmax_layers=None).softmax_layers == []


@pytest.mark.parametrize(
    "feature_map, feature_dim, expected",
    [("elu", None, 16), ("relu", None, 16), ("identity", None, 16), ("t2r", 8, 8), ("hedgehog", 8, 16),
     ("hedgehog", None, 32), ("taylor", None, 1 + 16 + 256)],
)
def test_feature_output_dim(feature_map, feature_dim, expected):
    assert tiny_config(feature_map=feature_map, feature_dim=feature_dim).feature_output_dim == expected


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_feature_output_dim_is_what_the_built_map_outputs(feature_map):
    feature_dim = 8 if feature_map in ("t2r", "hedgehog") else None
    config = tiny_config(feature_map=feature_map, feature_dim=feature_dim)
    feature_map_module = build_feature_map(feature_map, 4, config.head_dim, feature_dim)
    torch.nn.init.normal_(next(feature_map_module.parameters(), torch.empty(0)))
    x = torch.randn(1, 3, 4, config.head_dim)
    assert feature_map_module(x).shape[-1] == feature_map_module.output_dim == config.feature_output_dim


# RoPE scalings that change with the input length, checked against transformers' Llama rotary embedding.
LONG_ROPE = {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
             "long_factor": [2.0 + i / 4 for i in range(8)], "original_max_position_embeddings": 32}


@pytest.mark.parametrize("rope_parameters", [{"rope_type": "dynamic", "factor": 4.0}, LONG_ROPE],
                         ids=["dynamic", "longrope"])
def test_length_dependent_rope_matches_llama(rope_parameters):
    dims = dict(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=32)
    ours = LinearAttentionRotaryEmbedding(tiny_config(**dims, rope_parameters=dict(rope_parameters)))
    llama = LlamaRotaryEmbedding(LlamaConfig(**dims, rope_parameters=dict(rope_parameters)))
    x = torch.zeros(1, dtype=torch.float32)
    short = torch.arange(20)[None]
    unscaled = ours(x, short)
    torch.testing.assert_close(unscaled, llama(x, short), rtol=0, atol=0)
    # Long, then short again, then one decode position past the end.
    for position_ids in (torch.arange(100)[None], short, torch.tensor([[150]]), torch.arange(300).expand(2, 300)):
        got, expected = ours(x, position_ids), llama(x, position_ids)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # Whether short inputs get the original frequencies back after long ones is the installed release's choice
    # (transformers 5.24 restores them, 5.5 keeps the scaled ones); the loop above checks we make the same one.
    long = torch.arange(100)[None]
    assert not torch.allclose(ours(x, long)[0][:, :20], unscaled[0])  # long inputs are rescaled


def test_dynamic_rope_changes_the_model_only_beyond_max_position_embeddings():
    dynamic = tiny_model(max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 4.0})
    plain = tiny_model(max_position_embeddings=32)
    ids = torch.randint(0, 128, (1, 48))
    with torch.no_grad():
        torch.testing.assert_close(dynamic(ids[:, :32]).logits, plain(ids[:, :32]).logits, rtol=0, atol=0)
        assert not torch.allclose(dynamic(ids).logits, plain(ids).logits, atol=1e-4)


def test_the_position_cap_holds_only_the_rotations_training_never_saw_complete():
    """Below the cap RoPE is untouched; past it the slow frequencies (no full turn within the cap) stay at their
    angle of the last position below it, and the fast ones, whose every angle was seen, turn on as before."""
    plain = LinearAttentionRotaryEmbedding(tiny_config(head_dim=32))
    capped = LinearAttentionRotaryEmbedding(tiny_config(head_dim=32, rope_position_cap=64))
    positions = torch.arange(300)[None]
    free, held = plain.angles(positions)[0], capped.angles(positions)[0]  # [300, 16]
    torch.testing.assert_close(held[:64], free[:64], rtol=0, atol=0)
    slow = 63 * plain.inv_freq < 2 * torch.pi
    assert 0 < int(slow.sum()) < len(slow)
    torch.testing.assert_close(held[64:, slow], free[63, slow].expand(236, -1), rtol=0, atol=0)
    torch.testing.assert_close(held[:, ~slow], free[:, ~slow], rtol=0, atol=0)


@torch.no_grad()
def stepwise_logits(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """The logits [1, T, V] of ids [1, T] read through the cache: the first `prefill` tokens in one call, then one
    token a call."""
    out = model(ids[:, :prefill], use_cache=True)
    steps, cache = [out.logits], out.past_key_values
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        steps.append(out.logits)
        cache = out.past_key_values
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("overrides", [{}, {"window_size": 8, "num_sink_tokens": 2, "decay": "scalar",
                                           "softmax_heads": {1: [0]}}], ids=["linear", "window+heads"])
def test_a_model_with_a_position_cap_decodes_past_it_as_its_forward_reads(overrides):
    """Each position's rotation is fixed whatever the input's length: below the cap the model is the uncapped one,
    and token-by-token decoding past the cap (the cache's keys and state) gives the full forward's logits."""
    capped = tiny_model(max_position_embeddings=64, rope_position_cap=16, head_dim=32, **overrides).eval()
    plain = tiny_model(max_position_embeddings=64, head_dim=32, **overrides).eval()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(capped(ids[:, :16]).logits, plain(ids[:, :16]).logits, rtol=0, atol=0)
        full = capped(ids).logits
        assert not torch.allclose(full, plain(ids).logits, atol=1e-4)
    torch.testing.assert_close(stepwise_logits(capped, ids, prefill=12), full, rtol=1e-4, atol=1e-4)


def test_the_log_length_scale_sharpens_only_softmax_attention_and_only_past_the_trained_positions(monkeypatch):
    """With `softmax_log_length_scale` β the queries a softmax layer and a layer's softmax heads attend with are the
    plain model's times 1 + β ln((p + 1) / max_position_embeddings) from the trained positions on, and 1 before: the
    logits there are the plain model's to the bit; the linear heads and the window are untouched; token-by-token
    decoding past the trained positions gives the full forward's logits (the scale follows the position, not the
    call)."""
    import hf_linear_attn.modeling_linear_attention as modeling

    overrides = dict(max_position_embeddings=32, head_dim=32, window_size=8, num_sink_tokens=2, decay="scalar",
                     softmax_layers=[0], softmax_heads={1: [0]})
    plain = tiny_model(**overrides).eval()
    scaled = tiny_model(**overrides, softmax_log_length_scale=0.5).eval()
    scaled.load_state_dict(plain.state_dict())
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(0))
    queries = []
    attention = modeling.causal_softmax_attention
    monkeypatch.setattr(modeling, "causal_softmax_attention", lambda q, *rest: queries.append(q) or attention(q, *rest))
    x, positions = torch.randn(1, 80, 64), torch.arange(80)
    with torch.no_grad():
        torch.testing.assert_close(scaled(ids[:, :32]).logits, plain(ids[:, :32]).logits, rtol=0, atol=0)
        full = scaled(ids).logits
        assert not torch.allclose(full[:, 32:], plain(ids).logits[:, 32:], atol=1e-4)
        queries.clear()
        for layer, heads in ((0, 4), (1, 2)):  # the softmax layer's 4 query heads; the 2 of KV head 0 in layer 1
            for model in (scaled, plain):  # the same input to both layers
                model.model.layers[layer].self_attn(x, model.model.rotary_emb.rotation(x, positions[None]))
            got, plain_queries = queries[-2:]  # [B, h, T, D] each
            assert got.shape[1] == heads
            factor = (1 + 0.5 * torch.log(torch.clamp(positions.float() + 1, min=32) / 32))[:, None]  # [T, 1]
            assert factor[31] == 1 and factor[63] == pytest.approx(1 + 0.5 * math.log(2))
            torch.testing.assert_close(got, plain_queries * factor, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stepwise_logits(scaled, ids, prefill=20), full, rtol=1e-4, atol=1e-4)


DELTA = {"update_rule": "delta", "feature_map": "identity", "normalize": False}


@pytest.mark.parametrize(
    "overrides, field, reason",
    [
        ({**DELTA, "normalize": True}, "normalize", "no normaliser"),
        ({**DELTA, "window_size": 8, "sparse_cache_size": 4}, "sparse_cache_size", "additive linear state"),
        ({**DELTA, "sparse_cache_size": 4}, "sparse_cache_size", "sparse_cache_size=0 with update_rule='delta'"),
        ({**DELTA, "num_sink_tokens": 2}, "num_sink_tokens", "need the window hybrid"),
        ({**DELTA, "feature_map": "taylor"}, "feature_map", "taylor"),
        ({**DELTA, "decay": "vector"}, "decay", "one decay per head"),
        ({**DELTA, "linear_attention_backend": "parallel"}, "linear_attention_backend", "delta_rule_attention"),
        ({"update_rule": "gated"}, "update_rule", "allowed: additive, delta"),
        ({"conv_size": -1}, "conv_size", ">= 0"),
        ({"conv_size": 1}, "conv_size", "width >= 2"),
    ],
)
def test_delta_rule_combinations_it_does_not_support_raise(overrides, field, reason):
    with pytest.raises(ValueError, match=f"`{field}`.*{reason}"):
        tiny_config(**overrides)
    with pytest.raises(ValueError, match=f"`{field}`"):  # the scripts' flags: the same checks
        AttentionOptions(**overrides)


def op_accepts(op: str, backend: str) -> bool:
    """Whether `op` takes backend `backend`, asked with tiny valid inputs: False when it refuses the name; a name it
    takes runs (backend "triton" may instead say why it cannot take CPU tensors)."""
    q, v = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 5)
    k = torch.nn.functional.normalize(torch.randn(1, 3, 2, 4), dim=-1)
    calls = {
        "linear_attention": lambda: ops.linear_attention(q, k, v, backend=backend),
        "window_attention": lambda: ops.window_attention(q, k, v, q.exp(), k.exp(), torch.zeros(2), window_size=2,
                                                         backend=backend),
        "delta_rule_attention": lambda: ops.delta_rule_attention(q, k, v, torch.rand(1, 3, 2), backend=backend),
    }
    try:
        calls[op]()
    except ValueError as error:
        if "backend must be one of" in str(error):
            return False
        if backend != "triton":
            raise
    return True


# The ops that each kind of linear layer calls with the config's backend: (config overrides, ops).
LAYER_KINDS = {
    "additive": ({}, ("linear_attention",)),
    "additive window hybrid": ({"window_size": 4}, ("window_attention",)),
    "delta rule": (DELTA, ("delta_rule_attention",)),
    "delta rule behind a window": ({**DELTA, "window_size": 4}, ("window_attention", "delta_rule_attention")),
}


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_config_accepts_exactly_the_backends_of_its_layers_ops(kind):
    """Every backend the ops of a layer kind all take, the config takes for that kind, and it refuses the others
    (which an op would refuse), naming the op. The ops' names are those declared in `backends`."""
    overrides, layer_ops = LAYER_KINDS[kind]
    for op in layer_ops:
        assert tuple(name for name in BACKENDS if op_accepts(op, name)) == OP_BACKENDS[op], op
    for name in BACKENDS:
        if all(op_accepts(op, name) for op in layer_ops):
            assert tiny_config(**overrides, linear_attention_backend=name).linear_attention_backend == name
            AttentionOptions(**overrides, linear_attention_backend=name)
        else:
            with pytest.raises(ValueError, match=f"`linear_attention_backend`.*runs on .*{layer_ops[-1]}"):
                tiny_config(**overrides, linear_attention_backend=name)
            with pytest.raises(ValueError, match="`linear_attention_backend`"):
                AttentionOptions(**overrides, linear_attention_backend=name)


def test_config_and_ops_share_the_backend_names():
    """The config names the backends of the ops, declared once in `backends` (a module without torch, which remote
    code imports beside the config)."""
    assert configuration_linear_attention.BACKENDS == ops.BACKENDS == BACKENDS
    assert all(set(names) <= set(BACKENDS) and "auto" in names for names in OP_BACKENDS.values())
    tree = ast.parse(Path(backends.__file__).read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


@pytest.mark.parametrize("field, value", [("conv_size", 4.0), ("output_gate", 1), ("update_rule", None)])
def test_new_options_of_the_wrong_type_raise(field, value):
    with pytest.raises(TypeError, match=f"`{field}`"):
        tiny_config(**{field: value})


def test_delta_rule_options_round_trip(tmp_path):
    config = tiny_config(**{**DELTA, "feature_map": "hedgehog"}, feature_dim=8, decay="fixed", conv_size=4,
                         output_gate=True)
    config.save_pretrained(tmp_path)
    loaded = LinearAttentionConfig.from_pretrained(tmp_path)
    assert (loaded.update_rule, loaded.conv_size, loaded.output_gate, loaded.decay) == ("delta", 4, True, "fixed")
    assert tiny_config(conv_size=4, output_gate=True).update_rule == "additive"  # conv and gate need no delta


def test_delta_rule_takes_the_window_and_sinks_and_round_trips(tmp_path):
    """update_rule='delta' with window_size > 0 (and sinks): normalize stays False (the window's softmax has its own
    normaliser), and the fields survive a save and load."""
    config = tiny_config(**DELTA, window_size=8, num_sink_tokens=2, decay="scalar", conv_size=4, output_norm=True,
                         output_gate=True)
    config.save_pretrained(tmp_path)
    loaded = LinearAttentionConfig.from_pretrained(tmp_path)
    assert (loaded.update_rule, loaded.window_size, loaded.num_sink_tokens, loaded.normalize) == ("delta", 8, 2, False)
    with pytest.raises(ValueError, match="`normalize`.*no normaliser"):
        tiny_config(**{**DELTA, "normalize": True}, window_size=8)
    with pytest.raises(ValueError, match="`normalize`.*needs normalize=True"):  # the additive hybrid's shared one
        tiny_config(feature_map="hedgehog", normalize=False, window_size=8)


def test_the_legacy_rope_theta_mirrors_rope_parameters():
    config = LinearAttentionConfig(rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    assert config.rope_theta == config.rope_parameters["rope_theta"] == 100000.0
    assert LinearAttentionConfig.from_dict(config.to_dict()).rope_theta == 100000.0
