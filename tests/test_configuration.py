import pytest
from helpers import tiny_config

from hf_linear_attn import LinearAttentionConfig


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
        ({"window_size": 8, "decay": "scalar"}, "decay"),
        ({"head_dim": 7}, "head_dim"),
        ({"hidden_act": "swish2"}, "hidden_act"),
        ({"linear_attention_backend": "cuda"}, "linear_attention_backend"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"rope_theta": -1.0}, "rope_theta"),
    ],
)
def test_invalid_fields_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    "feature_map, feature_dim, expected",
    [("elu", None, 16), ("relu", None, 16), ("identity", None, 16), ("t2r", 8, 8), ("hedgehog", 8, 16),
     ("hedgehog", None, 32), ("taylor", None, 1 + 16 + 256)],
)
def test_feature_output_dim(feature_map, feature_dim, expected):
    assert tiny_config(feature_map=feature_map, feature_dim=feature_dim).feature_output_dim == expected
