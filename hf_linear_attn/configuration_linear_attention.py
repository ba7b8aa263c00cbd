"""Configuration of a Llama-style decoder whose attention is the linear-attention family.

The decoder itself is Llama's (RMSNorm, SwiGLU MLP, RoPE, GQA) with the switches needed to
carry Mistral / Qwen2 / Qwen3 checkpoints over (q/k/v bias, q/k RMSNorm, explicit head_dim,
tied embeddings). Every attention option is validated here, at construction, so a bad value
fails before any weight is allocated.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

FEATURE_MAPS = ("elu", "relu", "identity", "t2r", "hedgehog", "taylor")
LEARNED_FEATURE_MAPS = ("t2r", "hedgehog")
DECAYS = ("none", "fixed", "scalar", "vector")
BACKENDS = ("auto", "torch", "recurrent", "parallel", "triton")
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


def _check(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"LinearAttentionConfig: invalid `{field}`={value!r}; {allowed}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class LinearAttentionConfig(PretrainedConfig):
    r"""Configuration for [`LinearAttentionModel`] and [`LinearAttentionForCausalLM`].

    Decoder fields follow `LlamaConfig` (`vocab_size`, `hidden_size`, `intermediate_size`,
    `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`, `hidden_act`,
    `max_position_embeddings`, `rms_norm_eps`, `rope_theta` / `rope_parameters`,
    `tie_word_embeddings`, `initializer_range`).

    Architecture switches for converted checkpoints:
        attention_bias: bias on q/k/v projections (Qwen2; Llama's `attention_bias=True` also
            needs `attention_out_bias=True`).
        attention_out_bias: bias on the output projection.
        use_qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        mlp_bias: bias on the MLP projections.

    Linear attention (the math is in the repository's docs/design.md):
        feature_map: one of `elu` (elu+1), `relu`, `identity`, `t2r` (learned ReLU(xW+b)),
            `hedgehog` (learned softmax(xW) ⊕ softmax(-xW), two halves), `taylor`
            (2nd-order Taylor expansion of exp). Applied per head after RoPE.
        feature_dim: feature dimension F of the learned maps (`t2r` outputs F, `hedgehog` 2F);
            defaults to `head_dim`. Must be unset for the fixed maps.
        normalize: divide by φ(q)ᵀz (the Linear Transformer denominator). Required by the
            window hybrid, whose softmax and linear parts share one normaliser.
        output_norm: per-head RMSNorm on the attention output before `o_proj` (GLA-style).
        decay: `none`, `fixed` (RetNet per-head γ_h = 1 - 2^(-5-h)), `scalar` (data-dependent per
            head, Mamba-2 / simple GLA), `vector` (data-dependent per key dimension, GLA).
        decay_low_rank_dim: rank of the GLA low-rank gate projection (`decay="vector"`).
        window_size: 0 disables; otherwise exact softmax over the last `window_size` tokens
            (plus `num_sink_tokens` first tokens) and linear attention over older ones
            (LoLCATs), mixed through a learned per-head γ.
        num_sink_tokens: first tokens always attended with softmax (window hybrid only).
        softmax_layers: indices of layers that keep full softmax attention.
        linear_attention_backend: backend of `hf_linear_attn.linear_attention` used by the
            layers (`auto` picks the fastest available).

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
        attention_bias: bool = False,
        attention_out_bias: bool = False,
        use_qk_norm: bool = False,
        mlp_bias: bool = False,
        feature_map: str = "elu",
        feature_dim: int | None = None,
        normalize: bool = True,
        output_norm: bool = False,
        decay: str = "none",
        decay_low_rank_dim: int = 16,
        window_size: int = 0,
        num_sink_tokens: int = 0,
        softmax_layers: list[int] | None = None,
        linear_attention_backend: str = "auto",
        base_model_name_or_path: str | None = None,
        base_model_type: str | None = None,
        **kwargs,
    ) -> None:
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
        self.feature_map = feature_map
        self.feature_dim = feature_dim
        self.normalize = normalize
        self.output_norm = output_norm
        self.decay = decay
        self.decay_low_rank_dim = decay_low_rank_dim
        self.window_size = window_size
        self.num_sink_tokens = num_sink_tokens
        self.softmax_layers = sorted(set(softmax_layers)) if softmax_layers else []
        self.linear_attention_backend = linear_attention_backend
        self.base_model_name_or_path = base_model_name_or_path
        self.base_model_type = base_model_type
        # RoPE: one dict {"rope_type", "rope_theta", ...} as transformers>=5 expects.
        self.rope_theta = rope_theta
        rope_parameters = dict(rope_parameters or {})
        rope_parameters.setdefault("rope_type", rope_parameters.pop("type", "default"))
        rope_parameters.setdefault("rope_theta", rope_theta)
        self.rope_parameters = rope_parameters
        self._validate()
        if self.head_dim is None:
            self.head_dim = hidden_size // num_attention_heads
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def _validate(self) -> None:
        positive = "must be a positive integer"
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                      "decay_low_rank_dim"):
            value = getattr(self, field)
            _check(_is_int(value) and value > 0, field, value, positive)
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if self.head_dim is None:
            _check(self.hidden_size % heads == 0, "num_attention_heads", heads,
                   f"must divide hidden_size={self.hidden_size} when head_dim is not given")
        else:
            _check(_is_int(self.head_dim) and self.head_dim > 0 and self.head_dim % 2 == 0, "head_dim",
                   self.head_dim, "must be a positive even integer (RoPE rotates pairs)")
        _check(heads % kv_heads == 0, "num_key_value_heads", kv_heads,
               f"must divide num_attention_heads={heads}")
        _check(self.hidden_act in HIDDEN_ACTS, "hidden_act", self.hidden_act, f"allowed: {HIDDEN_ACTS}")
        _check(self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "must be > 0")
        _check(self.feature_map in FEATURE_MAPS, "feature_map", self.feature_map, f"allowed: {FEATURE_MAPS}")
        if self.feature_dim is not None:
            _check(self.feature_map in LEARNED_FEATURE_MAPS, "feature_dim", self.feature_dim,
                   f"only the learned maps {LEARNED_FEATURE_MAPS} have a feature dimension; "
                   f"feature_map={self.feature_map!r} takes none (leave it None)")
            _check(_is_int(self.feature_dim) and self.feature_dim > 0, "feature_dim", self.feature_dim, positive)
        _check(self.decay in DECAYS, "decay", self.decay, f"allowed: {DECAYS}")
        _check(_is_int(self.window_size) and self.window_size >= 0, "window_size", self.window_size,
               "must be an integer >= 0 (0 disables the sliding-window hybrid)")
        _check(_is_int(self.num_sink_tokens) and self.num_sink_tokens >= 0, "num_sink_tokens",
               self.num_sink_tokens, "must be an integer >= 0")
        if self.num_sink_tokens > 0:
            _check(self.window_size > 0, "num_sink_tokens", self.num_sink_tokens,
                   "sink tokens need the window hybrid (window_size > 0)")
        if self.window_size > 0:
            _check(self.normalize, "normalize", self.normalize,
                   "the window hybrid shares one normaliser between its softmax and linear parts: "
                   "window_size > 0 needs normalize=True")
            _check(self.decay == "none", "decay", self.decay,
                   "the window hybrid supports decay='none' only")
        for index in self.softmax_layers:
            _check(_is_int(index) and 0 <= index < self.num_hidden_layers, "softmax_layers", self.softmax_layers,
                   f"layer indices must lie in [0, {self.num_hidden_layers - 1}]")
        _check(self.linear_attention_backend in BACKENDS, "linear_attention_backend",
               self.linear_attention_backend, f"allowed: {BACKENDS}")
        _check(isinstance(self.rope_parameters.get("rope_theta"), (int, float)) and
               self.rope_parameters["rope_theta"] > 0, "rope_theta", self.rope_parameters.get("rope_theta"),
               "must be a positive number")

    @property
    def feature_output_dim(self) -> int:
        """K: the size of φ(q), φ(k) and so of the key side of the recurrent state."""
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        learned = self.feature_dim or head_dim
        return {
            "t2r": learned,
            "hedgehog": 2 * learned,
            "taylor": 1 + head_dim + head_dim * head_dim,
        }.get(self.feature_map, head_dim)


__all__ = ["LinearAttentionConfig"]
