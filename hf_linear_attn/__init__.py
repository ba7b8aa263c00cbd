"""hf-linear-attn: linear attention as a Hugging Face `transformers` model.

Importing the package registers `LinearAttentionConfig` (model_type "linear_attention") and
both model classes with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`, so checkpoints
load with the Auto classes without `trust_remote_code`. Saved checkpoints also carry the code
(`auto_map`) so they load with `trust_remote_code=True` where this package is not installed.
"""

from importlib.metadata import PackageNotFoundError, version

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache_linear_attention import LinearAttentionCache
from .configuration_linear_attention import InputError, InputNotFoundError, InputTypeError, LinearAttentionConfig
from .conversion import convert_to_linear_attention
from .feature_maps import FeatureMap, register_feature_map
from .modeling_linear_attention import (
    LinearAttentionForCausalLM,
    LinearAttentionModel,
    LinearAttentionPreTrainedModel,
)
from .ops import delta_rule_attention, linear_attention, window_attention, window_softmax
from .ops_sparse_memory import sparse_window_attention

try:  # the one version source is pyproject.toml, read back from the installed distribution's metadata
    __version__ = version("hf-linear-attn")
except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
    __version__ = "0+unknown"

AutoConfig.register(LinearAttentionConfig.model_type, LinearAttentionConfig, exist_ok=True)
AutoModel.register(LinearAttentionConfig, LinearAttentionModel, exist_ok=True)
AutoModelForCausalLM.register(LinearAttentionConfig, LinearAttentionForCausalLM, exist_ok=True)
# Mark the classes so save_pretrained copies their code files next to the weights.
LinearAttentionConfig.register_for_auto_class()
LinearAttentionModel.register_for_auto_class("AutoModel")
LinearAttentionForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "FeatureMap",
    "InputError",
    "InputNotFoundError",
    "InputTypeError",
    "LinearAttentionCache",
    "LinearAttentionConfig",
    "LinearAttentionForCausalLM",
    "LinearAttentionModel",
    "LinearAttentionPreTrainedModel",
    "convert_to_linear_attention",
    "delta_rule_attention",
    "linear_attention",
    "register_feature_map",
    "sparse_window_attention",
    "window_attention",
    "window_softmax",
]
