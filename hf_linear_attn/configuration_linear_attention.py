"""Configuration of a Llama-style decoder whose attention is the linear-attention family.

The decoder itself is Llama's (RMSNorm, SwiGLU MLP, RoPE, GQA) with the switches needed to
carry Mistral / Qwen2 / Qwen3 checkpoints over (q/k/v bias, q/k RMSNorm, explicit head_dim,
tied embeddings). The attention options are declared once, in `AttentionOptions` (type, default,
help and allowed values of each): the config takes them as keyword arguments, and the conversion
API and the training scripts' command lines are built from the same fields. Every field is
checked here, at construction, so a bad value fails, naming the field, before any weight is
allocated.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import logging

from .backends import BACKENDS, OP_BACKENDS, accepted_by
from .feature_maps import DELTA_FEATURE_MAPS, FEATURE_DIM_MAPS, FEATURE_MAPS, feature_output_dim

logger = logging.get_logger(__name__)

# What a saved checkpoint's `auto_map` holds: the three Auto classes resolve to this package's own files, copied
# beside the weights by `save_pretrained`, so that `trust_remote_code=True` loads the checkpoint without the package.
AUTO_MAP = {
    "AutoConfig": "configuration_linear_attention.LinearAttentionConfig",
    "AutoModel": "modeling_linear_attention.LinearAttentionModel",
    "AutoModelForCausalLM": "modeling_linear_attention.LinearAttentionForCausalLM",
}
# The one-line repair of a checkpoint whose `auto_map` names other code (training/export.py).
REPAIR_COMMAND = "hf-linear-attn-export --model_name_or_path {folder} --output_dir {folder}"


def foreign_auto_map(auto_map: dict[str, Any] | None) -> dict[str, Any]:
    """The entries of a checkpoint's `auto_map` that name code other than this package's (e.g. the class an engine
    made: FSDP2's `_fsdp_init.FSDPLinearAttentionForCausalLM`, whose file is torch's)."""
    return {key: value for key, value in (auto_map or {}).items() if AUTO_MAP.get(key, value) != value}


DECAYS = ("none", "fixed", "scalar", "vector")
UPDATE_RULES = ("additive", "delta")
# What a decoder layer's attention is (`LinearAttentionConfig.layer_kind`): the model builds one attention class per
# kind and the cache one state class per kind (plus the sparse memory's variant of the window state).
LAYER_KINDS = ("softmax", "linear", "delta", "window", "delta_window")
# The ops each recurrent kind runs with `linear_attention_backend` (names of `backends.OP_BACKENDS`): the delta window
# runs window_attention(update_rule="delta"), whose state part is delta_rule_attention. (With a sparse memory the
# window hybrid takes no backend, but sparse_cache_size may be set to 0 on a loaded model's config.)
KIND_OPS = {
    "linear": ("linear_attention",),
    "delta": ("delta_rule_attention",),
    "window": ("window_attention",),
    "delta_window": ("window_attention", "delta_rule_attention"),
}
# What the delta rule accepts. Its keys are L2-normalised after φ: the maps whose output is a direction worth
# normalising qualify, those registered with delta_rule=True (`DELTA_FEATURE_MAPS`, feature_maps.py). Its decay is
# a per-head scalar (the op takes log a [B, T, H]). Its backends are those of the ops its layers call (`KIND_OPS`).
DELTA_DECAYS = ("none", "fixed", "scalar")
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")
ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)
# The rope types whose frequencies follow the input's length (transformers' `dynamic_rope_update`).
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


class InputError(ValueError):
    """Bad input to this package or its commands (a config field, an argument, a checkpoint that does not fit), with a
    message naming what was wrong and what is allowed. A ValueError, so that code catching that keeps working; the
    commands report it as one `error: ...` line, and let every other exception through with its traceback."""


class InputTypeError(InputError, TypeError):
    """Bad input of the wrong type (e.g. a config field given a string where it takes an integer); a TypeError too."""


class InputNotFoundError(InputError, FileNotFoundError):
    """Bad input naming a file or folder that does not exist (or lacks what it must hold); a FileNotFoundError too."""


def _fail(name: str, value: Any, allowed: str, error: type[InputError] = InputError) -> None:
    raise error(f"invalid `{name}`={value!r} ({type(value).__name__}): {allowed}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(name, value, "must be True or False", InputTypeError)


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    allowed = f"must be an integer >= {minimum}" + (" (or None)" if optional else "")
    if not _is_int(value):
        _fail(name, value, allowed, InputTypeError)
    if value < minimum:
        _fail(name, value, allowed)


def _check_number(name: str, value: Any, allowed: str, ok: Callable[[float], bool]) -> None:
    """A finite int or float (not a bool) for which `ok(value)` holds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, value, allowed, InputTypeError)
    if not (math.isfinite(value) and ok(value)):
        _fail(name, value, allowed)


def check_window_weight(weight: Any, name: str = "window_weight") -> None:
    """γ of the additive window hybrid (`window_weight`, `LinearAttentionForCausalLM.set_window_weight`): a finite
    number strictly between 0 and 1 (its logit is the gate)."""
    _check_number(name, weight, "must be a number strictly between 0 and 1", lambda value: 0 < value < 1)


def _check_choice(name: str, value: Any, choices: Sequence[str], note: str = "") -> None:
    if not isinstance(value, str) or value not in choices:
        _fail(name, value, f"allowed: {', '.join(choices)}{note}", InputError if isinstance(value, str)
              else InputTypeError)


def _check_optional_str(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        _fail(name, value, "must be a string or None", InputTypeError)


def _check_token_ids(name: str, value: Any, allow_list: bool) -> None:
    ids = value if allow_list and isinstance(value, list) else [value]
    if value is not None and not all(_is_int(i) for i in ids):
        _fail(name, value, "must be an integer token id" + (", a list of them" if allow_list else "") + " or None",
              InputTypeError)


def _option(default: Any, help: str, **metadata: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class AttentionOptions:
    """The attention options of `LinearAttentionConfig`, the one place each is declared with its type, default,
    help and allowed values (`choices`). Checks that involve only these options run at construction; those that
    involve the decoder too (layer indices, the window against `max_position_embeddings`) run in the config.
    """

    feature_map: str = _option(
        "elu", "Kernel feature map φ, applied per head after RoPE: elu (elu+1), relu, identity, t2r (learned "
        "ReLU(xW+b)), hedgehog (learned [softmax(xW), softmax(-xW)], two halves), taylor (2nd-order Taylor "
        "expansion of exp), or a map of your own registered with hf_linear_attn.register_feature_map.",
        choices=FEATURE_MAPS)
    feature_dim: int | None = _option(
        None, "Feature dimension F of the learned maps (t2r outputs F features, hedgehog 2F); default head_dim. "
        "Leave it unset for the fixed maps.")
    normalize: bool = _option(
        True, "Divide by φ(q)ᵀz (the Linear Transformer denominator). The additive window hybrid needs it: its "
        "softmax and linear parts share one normaliser.")
    output_norm: bool = _option(False, "Per-head RMSNorm on the attention output before o_proj (GLA-style); in "
                                        "the delta-rule window hybrid, on its state part only.")
    decay: str = _option(
        "none", "none; fixed (RetNet per-head γ_h = 1 - 2^(-5-h), in the window hybrid 1 - 2^(-8-h)); scalar "
        "(data-dependent per head, Mamba-2 / simple GLA); vector (data-dependent per key dimension, GLA). In the "
        "window hybrid the decay acts on the linear part, from when a key leaves the window.", choices=DECAYS)
    decay_low_rank_dim: int = _option(16, "Rank of the GLA low-rank gate projection (decay='vector').")
    decay_horizon: int = _option(
        2048, "Window hybrid with decay='scalar' or 'vector': the memory of the linear part when the model is "
        "built (and converted): a = 1 - 1/decay_horizon for every token, which training then moves. A horizon "
        "below the training rows' length keeps what the linear part sees at any position like what it saw in "
        "training, so quality does not fall beyond the training length.")
    window_size: int = _option(
        0, "0 disables; otherwise exact softmax over the last window_size tokens (plus the num_sink_tokens first "
        "ones) and linear attention over older ones (LoLCATs), mixed through a learned per-head γ; with "
        "update_rule='delta', the window's softmax plus λ_h times the delta-rule state of the tokens that have left "
        "the window. window_size + num_sink_tokens may not exceed max_position_embeddings.")
    num_sink_tokens: int = _option(0, "First tokens always attended with softmax (window hybrid only).")
    window_weight: float = _option(
        0.5, "Additive window hybrid: γ when the model is built (and converted), the weight of each window softmax "
        "term against the linear part's (window_gate = logit γ, per head), which training then moves. Training "
        "moves it slowly (the gate is one logit per head), so where it is set matters: a converted SmolLM2 with a "
        "256-token decay reads lower perplexity with γ near 1 than at 0.5, but learns more in attention transfer at "
        "0.5; the demo trains at 0.5 and sets 0.99 for its recovery stage (`set_window_weight`, docs/design.md). "
        "The delta-rule window's λ starts at 0 whatever this says.")
    sparse_cache_size: int = _option(
        0, "Additive window hybrid only: 0 disables; otherwise m exact key/value pairs per KV head that have left the "
        "window stay under softmax (a training-free sparse memory, LoLA's re-scoring): those the current linear state "
        "recalls worst, re-chosen every MEMORY_BLOCK_SIZE = 64 positions; the rest is folded into the linear "
        "part. The cache grows by m slots and 64 window positions per layer and KV head, constant in the "
        "context. Setting it on a loaded "
        "model's config takes effect at the next forward (with a new cache).")
    softmax_layers: list[int] = _option([], "Indices of the layers that keep full softmax attention.")
    linear_attention_backend: str = _option(
        "auto", "Backend of hf_linear_attn.linear_attention (or delta_rule_attention) used by the layers (auto "
        "picks the fastest available); update_rule='delta' takes those of delta_rule_attention: "
        f"{'/'.join(OP_BACKENDS['delta_rule_attention'])}.", choices=BACKENDS)
    update_rule: str = _option(
        "additive", "How a token enters the state: additive (S += φ(k)vᵀ, the Linear Transformer) or delta "
        "(S = a(I - βkkᵀ)S + βkvᵀ, DeltaNet / Gated DeltaNet: q and k are L2-normalised after φ, a learned "
        "β = sigmoid(xW) per head; needs normalize=False, a decay of none/fixed/scalar and a feature_map of "
        f"{'/'.join(DELTA_FEATURE_MAPS)}; with window_size > 0 only the tokens that have left the window enter "
        "the state, beside exact softmax over the window; no sparse_cache_size).", choices=UPDATE_RULES)
    conv_size: int = _option(
        0, "0 disables; otherwise a causal depthwise convolution of that width over time on the q/k/v projections, "
        "before RoPE and φ (Gated DeltaNet uses 4). Its last conv_size - 1 inputs live in the cache.")
    output_gate: bool = _option(
        False, "Multiply the attention output (after output_norm) by silu(x W_g) per channel (Gated DeltaNet: with "
        "output_norm=True, o = RMSNorm(o) * silu(g_proj(x))); in the delta-rule window hybrid, its state part only.")
    softmax_log_length_scale: float = _option(
        0.0, "β of the exact attention's log-length scaling: at every position p ≥ max_position_embeddings the "
        "queries of the softmax layers and softmax heads are multiplied by 1 + β ln((p + 1) / "
        "max_position_embeddings), so that a query attending over more keys than training ever gave one spreads its "
        "attention no wider than it did in training (the log-n scaling of Qwen's logn_attn and Llama 4's attention "
        "temperature tuning). Nothing changes below max_position_embeddings; 0 turns it off (a model without "
        "softmax layers or heads has nothing it scales). Read at every forward: set on a loaded model's config, it "
        "holds at once.")

    def __post_init__(self) -> None:
        _check_choice("feature_map", self.feature_map, FEATURE_MAPS, " (a map defined elsewhere is registered "
                      "first, with hf_linear_attn.register_feature_map)")
        _check_int("feature_dim", self.feature_dim, 1, optional=True)
        if self.feature_dim is not None and self.feature_map not in FEATURE_DIM_MAPS:
            _fail("feature_dim", self.feature_dim,
                  f"only the learned maps {', '.join(FEATURE_DIM_MAPS)} have a feature dimension; "
                  f"feature_map={self.feature_map!r} takes none (leave it None)")
        _check_bool("normalize", self.normalize)
        _check_bool("output_norm", self.output_norm)
        _check_choice("decay", self.decay, DECAYS)
        _check_int("decay_low_rank_dim", self.decay_low_rank_dim, 1)
        _check_int("decay_horizon", self.decay_horizon, 2)
        _check_int("window_size", self.window_size, 0)
        _check_int("num_sink_tokens", self.num_sink_tokens, 0)
        check_window_weight(self.window_weight)
        _check_choice("linear_attention_backend", self.linear_attention_backend, BACKENDS)
        _check_choice("update_rule", self.update_rule, UPDATE_RULES)
        _check_int("conv_size", self.conv_size, 0)
        if self.conv_size == 1:
            _fail("conv_size", self.conv_size, "0 (off) or a width >= 2: a width-1 convolution only rescales "
                  "channels, which the projections already do")
        _check_bool("output_gate", self.output_gate)
        _check_number("softmax_log_length_scale", self.softmax_log_length_scale, "must be a number >= 0 (0: off)",
                      lambda value: value >= 0)
        if self.update_rule == "delta":  # before the window checks: their advice would not apply
            self._check_delta_rule()
        self._check_layer_backend()
        check_sparse_cache_size(self)
        if self.num_sink_tokens > 0 and self.window_size == 0:
            _fail("num_sink_tokens", self.num_sink_tokens, "sink tokens need the window hybrid (window_size > 0)")
        if self.window_size > 0 and not self.normalize and self.update_rule == "additive":
            _fail("normalize", self.normalize, "the window hybrid shares one normaliser between its softmax and "
                  "linear parts: window_size > 0 needs normalize=True")
        layers = [] if self.softmax_layers is None else self.softmax_layers
        allowed = "must be a list of layer indices (integers >= 0)"
        if not isinstance(layers, (list, tuple)) or not all(_is_int(i) for i in layers):
            _fail("softmax_layers", self.softmax_layers, allowed, InputTypeError)
        if any(i < 0 for i in layers):
            _fail("softmax_layers", self.softmax_layers, allowed)
        self.softmax_layers = sorted(set(layers))

    def _check_delta_rule(self) -> None:
        """The combinations update_rule='delta' supports (see DELTA_FEATURE_MAPS and the help of update_rule)."""
        if self.normalize:
            _fail("normalize", self.normalize, "update_rule='delta' has no normaliser (its keys are L2-normalised "
                  "and the state stores values, not sums): pass normalize=False")
        if self.feature_map not in DELTA_FEATURE_MAPS:
            _fail("feature_map", self.feature_map, f"update_rule='delta' L2-normalises φ(q), φ(k); allowed: "
                  f"{', '.join(DELTA_FEATURE_MAPS)}, the maps registered with delta_rule=True (taylor's features "
                  "approximate exp(q·k), which normalising breaks)")
        if self.decay not in DELTA_DECAYS:
            _fail("decay", self.decay, f"update_rule='delta' takes one decay per head and token; allowed: "
                  f"{', '.join(DELTA_DECAYS)}")

    def _check_layer_backend(self) -> None:
        """`linear_attention_backend` among the backends every op of the layers accepts."""
        ops = KIND_OPS[recurrent_kind(self)]
        accepted = accepted_by(*ops)
        if self.linear_attention_backend not in accepted:
            kind = f"update_rule={self.update_rule!r}" + (" with window_size > 0" if self.window_size else "")
            _fail("linear_attention_backend", self.linear_attention_backend, f"{kind} runs on {' and '.join(ops)}, "
                  f"whose backends are {', '.join(accepted)}")


def _checked_softmax_heads(value: Any) -> dict[int, list[int]]:
    """`softmax_heads` as {layer: sorted KV heads}, layers in increasing order and layers with an empty list dropped.
    Layer keys may be ints or their decimal strings (config.json has string keys). Raises naming the field for
    another type, a negative index or a repeated head (the indices' upper bounds are checked with the decoder)."""
    allowed = "must be a dict {layer index: [KV head index, ...]} of integers >= 0"
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail("softmax_heads", value, allowed, InputTypeError)
    heads = {}
    for layer, kv_heads in value.items():
        index = int(layer) if isinstance(layer, str) and layer.isdigit() else layer
        if not _is_int(index) or not isinstance(kv_heads, (list, tuple)) or not all(_is_int(h) for h in kv_heads):
            _fail("softmax_heads", value, allowed, InputTypeError)
        if index < 0 or any(h < 0 for h in kv_heads):
            _fail("softmax_heads", value, allowed)
        if index in heads:
            _fail("softmax_heads", value, f"layer {index} is given twice (as {index!r} and {str(index)!r})")
        repeated = sorted({h for h in kv_heads if list(kv_heads).count(h) > 1})
        if repeated:
            _fail("softmax_heads", value, f"layer {index} lists KV head(s) {repeated} more than once")
        if kv_heads:
            heads[index] = sorted(kv_heads)
    return dict(sorted(heads.items()))


def recurrent_kind(options: Any) -> str:
    """The kind of every layer of a config (or `AttentionOptions`) that is not a softmax layer, one of LAYER_KINDS:
    by update_rule and window_size, "linear" (additive), "delta", "window" (the additive window hybrid, with or
    without the sparse memory) or "delta_window" (the delta rule behind a window). The one place that decides it
    (`LinearAttentionConfig.layer_kind` adds the softmax layers)."""
    if options.window_size > 0:
        return "delta_window" if options.update_rule == "delta" else "window"
    return "delta" if options.update_rule == "delta" else "linear"


def check_has_window_weight(options: Any, name: str, weight: Any) -> None:
    """Raise unless a config (or `AttentionOptions`) has an additive window-hybrid layer, the only kind with a γ
    (`window_weight`) to set: `name` = `weight` is what asked to set it. The one place that decides which models
    have a γ (`set_window_weight`, finetune's `--set_window_weight`, the demo's `recovery_window_weight`)."""
    kinds = ([options.layer_kind(i) for i in range(options.num_hidden_layers)] if hasattr(options, "layer_kind")
             else [recurrent_kind(options)])
    if "window" not in kinds:
        _fail(name, weight, "only an additive window-hybrid layer (window_size > 0, update_rule 'additive', not a "
              "softmax layer) has a γ to set, and this model has none")


def check_sparse_cache_size(options: Any) -> None:
    """`sparse_cache_size` of a config (or `AttentionOptions`): an int ≥ 0, and > 0 only with the window hybrid. The
    model checks it again before every forward, since it may be set on a loaded model's config."""
    value = options.sparse_cache_size
    _check_int("sparse_cache_size", value, 0)
    if value > 0 and options.update_rule == "delta":
        _fail("sparse_cache_size", value, "the sparse memory re-scores the tokens that have left the window against "
              "an additive linear state, and update_rule='delta' has none (its state part is the delta rule's): "
              "pass sparse_cache_size=0 with update_rule='delta'")
    if value > 0 and options.window_size == 0:
        _fail("sparse_cache_size", value, "the sparse memory keeps tokens that have left the window: it needs the "
              "window hybrid (window_size > 0); 0 disables it")


ATTENTION_OPTIONS = tuple(f.name for f in fields(AttentionOptions))


def _attention_options_doc() -> str:
    """The docstring lines of the attention options, from their declaration."""
    return "\n".join(
        textwrap.fill(f"{f.name}: {f.metadata['help']}", width=110, initial_indent=" " * 8,
                      subsequent_indent=" " * 12)
        for f in fields(AttentionOptions)
    )


class LinearAttentionConfig(PretrainedConfig):
    __doc__ = r"""Configuration for [`LinearAttentionModel`] and [`LinearAttentionForCausalLM`].

    Decoder fields follow `LlamaConfig` (`vocab_size`, `hidden_size`, `intermediate_size`,
    `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`, `hidden_act`,
    `max_position_embeddings`, `rms_norm_eps`, `rope_theta` / `rope_parameters`,
    `tie_word_embeddings`, `initializer_range`). `rope_parameters` may use every `rope_type`
    transformers knows; `dynamic` and `longrope` rescale with the input's length as in Llama.

    Past the trained positions:
        rope_position_cap (`int | None`, default None): the frequency pairs of RoPE that do not complete a turn within
            this many positions (the slow ones, which a model reads as where a token is) rotate up to position
            `rope_position_cap - 1` and no further; the faster pairs, whose every angle training has seen, rotate
            on. Below the cap nothing changes; past it, every position looks like one the model was trained at,
            and each position's rotation stays fixed (a cache and a streamed state stay consistent). A conversion
            sets it to the teacher's `max_position_embeddings` unless given another (`convert_to_linear_attention`'s
            `rope_position_cap`). Not with a `dynamic` or `longrope` rope_type.

    Architecture switches for converted checkpoints:
        attention_bias: bias on q/k/v projections (Qwen2; Llama's `attention_bias=True` also
            needs `attention_out_bias=True`).
        attention_out_bias: bias on the output projection.
        use_qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        mlp_bias: bias on the MLP projections.

    Linear attention (keyword arguments, declared in `AttentionOptions`; the math is in
    the repository's docs/design.md):
""" + _attention_options_doc() + r"""

    Softmax heads (the head-level hybrid): `softmax_heads` = {layer: [kv_head, ...]}, per layer the KV heads that
    keep exact causal softmax attention over the whole context, with their query groups (query head j belongs to KV
    head j // (H / H_kv)); the layer's other heads stay of its kind (`layer_kind`), its parameters unchanged. Those
    heads keep an ordinary growing K/V in the cache and bypass the output norm and gate (they compute their softmax
    teacher's attention). A layer listed here may not be in `softmax_layers`; layers with an empty list are dropped.
    config.json stores the layers as strings (JSON keys); they are read back as ints.

    Provenance (set by `convert_to_linear_attention`): `base_model_name_or_path` and
    `base_model_type` of the softmax checkpoint this model was converted from.
    """

    model_type = "linear_attention"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 512,
        intermediate_size: int = 1408,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 8,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        tie_word_embeddings: bool = False,
        rope_theta: float = 10000.0,
        rope_parameters: dict | None = None,
        rope_position_cap: int | None = None,
        attention_bias: bool = False,
        attention_out_bias: bool = False,
        use_qk_norm: bool = False,
        mlp_bias: bool = False,
        softmax_heads: dict[int, list[int]] | None = None,
        base_model_name_or_path: str | None = None,
        base_model_type: str | None = None,
        **kwargs,
    ) -> None:
        # The attention options (`AttentionOptions` fields) come as keyword arguments; unset ones take their default.
        options = AttentionOptions(**{name: kwargs.pop(name) for name in ATTENTION_OPTIONS if name in kwargs})
        for name in ATTENTION_OPTIONS:
            setattr(self, name, getattr(options, name))
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.attention_bias = attention_bias
        self.attention_out_bias = attention_out_bias
        self.use_qk_norm = use_qk_norm
        self.mlp_bias = mlp_bias
        self.softmax_heads = _checked_softmax_heads(softmax_heads)
        self.base_model_name_or_path = base_model_name_or_path
        self.base_model_type = base_model_type
        self._validate_decoder(pad_token_id, bos_token_id, eos_token_id, tie_word_embeddings)
        if self.head_dim is None:
            self.head_dim = hidden_size // num_attention_heads
        # RoPE: one dict {"rope_type", "rope_theta", ...} as transformers>=5 expects (a legacy `rope_scaling`
        # dict, as older configs carry, takes precedence as in transformers).
        self.rope_theta = rope_theta
        self._set_rope_parameters(kwargs.pop("rope_scaling", None) or rope_parameters)
        self.rope_position_cap = rope_position_cap
        self._check_rope_position_cap()
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        if foreign := foreign_auto_map(getattr(self, "auto_map", None)):
            # Loading still works here (this package's classes are registered and win over `auto_map`); where it is
            # not installed, transformers would import the named files (an engine's) and fail.
            logger.warning(
                f"This checkpoint's config.json names code that is not hf-linear-attn's in `auto_map` ({foreign}): it "
                "was saved by an older version through a training engine's wrapper, and loading it with "
                "trust_remote_code=True where hf-linear-attn is not installed fails. Repair the folder in place "
                "(config.json and the code files only, not the weights): "
                + REPAIR_COMMAND.format(folder="CHECKPOINT_DIR") + "; or re-save it with this version.")

    def _validate_decoder(self, pad_token_id: Any, bos_token_id: Any, eos_token_id: Any,
                          tie_word_embeddings: Any) -> None:
        """The decoder fields and the checks that tie the attention options to them."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            _check_int(name, getattr(self, name), 1)
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if self.head_dim is None:
            if self.hidden_size % heads:
                _fail("num_attention_heads", heads, f"must divide hidden_size={self.hidden_size} when head_dim is "
                      "not given")
        else:
            _check_int("head_dim", self.head_dim, 2)
            if self.head_dim % 2:
                _fail("head_dim", self.head_dim, "must be a positive even integer (RoPE rotates pairs)")
        if heads % kv_heads:
            _fail("num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}")
        _check_choice("hidden_act", self.hidden_act, HIDDEN_ACTS)
        _check_number("rms_norm_eps", self.rms_norm_eps, "must be a number > 0", lambda x: x > 0)
        _check_number("initializer_range", self.initializer_range, "must be a number in [0, 1]",
                      lambda x: 0 <= x <= 1)
        for name in ("use_cache", "attention_bias", "attention_out_bias", "use_qk_norm", "mlp_bias"):
            _check_bool(name, getattr(self, name))
        _check_bool("tie_word_embeddings", tie_word_embeddings)
        _check_token_ids("pad_token_id", pad_token_id, allow_list=False)
        _check_token_ids("bos_token_id", bos_token_id, allow_list=False)
        _check_token_ids("eos_token_id", eos_token_id, allow_list=True)
        _check_optional_str("base_model_name_or_path", self.base_model_name_or_path)
        _check_optional_str("base_model_type", self.base_model_type)
        # The window cache keeps window_size + num_sink_tokens raw keys and values per layer.
        retained = self.window_size + self.num_sink_tokens
        if retained > self.max_position_embeddings:
            _fail("window_size", self.window_size, f"window_size + num_sink_tokens ({retained}) may not exceed "
                  f"max_position_embeddings={self.max_position_embeddings}: a window at least that long is "
                  "already softmax attention over every position the model was made for")
        for index in self.softmax_layers:
            if index >= self.num_hidden_layers:
                _fail("softmax_layers", self.softmax_layers,
                      f"layer indices must lie in [0, {self.num_hidden_layers - 1}]")
        for index, heads in self.softmax_heads.items():
            if index >= self.num_hidden_layers:
                _fail("softmax_heads", self.softmax_heads,
                      f"layer indices must lie in [0, {self.num_hidden_layers - 1}]")
            if index in self.softmax_layers:
                _fail("softmax_heads", self.softmax_heads, f"layer {index} is in softmax_layers={self.softmax_layers} "
                      "(every head of it is softmax already): list a layer in one of the two")
            if heads[-1] >= kv_heads:
                _fail("softmax_heads", self.softmax_heads, f"layer {index}: KV head indices must lie in "
                      f"[0, {kv_heads - 1}] (num_key_value_heads={kv_heads}; each brings its query group)")

    def _set_rope_parameters(self, rope_parameters: Any) -> None:
        """Sets `rope_parameters`, completed with `rope_type` and `rope_theta`; refuses what this model does not
        apply as transformers' Llama does (every `rope_type` of `ROPE_INIT_FUNCTIONS`, all of the head rotated)."""
        if rope_parameters is not None and not isinstance(rope_parameters, dict):
            _fail("rope_parameters", rope_parameters, "must be a dict such as {'rope_type': 'default', "
                  "'rope_theta': 10000.0} (or None)", InputTypeError)
        _check_number("rope_theta", self.rope_theta, "must be a number > 0", lambda x: x > 0)
        rope = dict(rope_parameters or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", self.rope_theta)
        _check_choice("rope_parameters['rope_type']", rope["rope_type"], ROPE_TYPES)
        _check_number("rope_parameters['rope_theta']", rope["rope_theta"], "must be a number > 0", lambda x: x > 0)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            _fail("rope_parameters['partial_rotary_factor']", rope["partial_rotary_factor"],
                  "only 1.0 is supported: RoPE rotates the whole head")
        self.rope_parameters = rope
        self.rope_theta = rope["rope_theta"]  # one value in config.json (the legacy field mirrors the dict)
        self.standardize_rope_params()  # adds `original_max_position_embeddings` where the rope_type uses it
        try:
            self.validate_rope()  # transformers' checks of the keys each rope_type needs
        except KeyError as error:
            raise InputError(f"invalid `rope_parameters`={rope!r}: {error.args[0]}.") from None

    def _check_rope_position_cap(self) -> None:
        """`rope_position_cap`: None, or an int ≥ 2 with a RoPE whose rotations do not depend on the input's length."""
        _check_int("rope_position_cap", self.rope_position_cap, 2, optional=True)
        rope_type = self.rope_parameters["rope_type"]
        if self.rope_position_cap is not None and rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
            _fail("rope_position_cap", self.rope_position_cap, f"fixes the rotation of every position for good, and "
                  f"rope_type {rope_type!r} rescales them with the input's length: set one or the other (the cap "
                  "with rope_type 'default', or None)")

    def layer_kind(self, layer_idx: int) -> str:
        """The kind of attention of layer `layer_idx`, one of LAYER_KINDS: "softmax" (listed in softmax_layers), else
        the config's `recurrent_kind`. The model builds its attention class and the cache its state from it."""
        return "softmax" if layer_idx in self.softmax_layers else recurrent_kind(self)

    def softmax_heads_of(self, layer_idx: int) -> tuple[int, ...]:
        """The KV heads of layer `layer_idx` that keep softmax attention (`softmax_heads`), sorted; () for none."""
        return tuple(self.softmax_heads.get(layer_idx, ()))

    @property
    def feature_output_dim(self) -> int:
        """K: the size of φ(q), φ(k) and so of the key side of the recurrent state."""
        return feature_output_dim(self.feature_map, self.head_dim, self.feature_dim)


__all__ = ["ATTENTION_OPTIONS", "AttentionOptions", "InputError", "InputNotFoundError", "InputTypeError", "LAYER_KINDS",
           "LinearAttentionConfig", "check_sparse_cache_size"]
