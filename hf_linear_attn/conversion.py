"""Convert a pretrained softmax-attention checkpoint into a `LinearAttentionForCausalLM`.

Supported sources: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`. The decoder is carried over exactly (embeddings, norms, MLPs, q/k/v/o with
their biases, Qwen3's q/k norms, RoPE settings, tied embeddings); only attention changes. The new
parameters (learned feature maps, the window mixing γ, decay gates, output norms) start from their
documented initialisation (`LinearAttentionPreTrainedModel._init_weights`), except the short convolution
(`conv_size`), which starts as the exact identity: the converted layer first sees the teacher's own q/k/v.
A window hybrid's decay starts with long memory (data-dependent gates at a = 1 − 1/`decay_horizon` per token,
2048 by default; fixed decay γ_h = 1 − 2^(−8−h)), and attention transfer learns where to forget.

Delta-rule conversions (`update_rule="delta"`, e.g. `**GATED_DELTANET_OPTIONS`) keep the teacher's q/k/v
projections and RoPE; what is new starts as follows, and attention transfer (`training/distill.py`) trains it:
the β projection at N(0, initializer_range), so β = sigmoid(x W_β) starts near 0.5 (every token writes, at
half strength); the convolution at the identity; the output gate's projection at N(0, initializer_range), so
silu(x W_g) starts small and the converted layer adds little to the residual stream until it has learned.

The delta rule with the window (`**GATED_DELTANET_WINDOW_OPTIONS`: window_size > 0) keeps exact softmax over the
window and sinks and adds λ_h times the (normed, gated) delta-rule state of the tokens that have left the window.
λ = `window_gate` starts at 0: the converted model *is* its teacher's sliding-window attention (with sinks), a
model that already works, and attention transfer grows the state part from there wherever it helps. Its decay
gate starts with the window hybrid's long memory (a = 1 − 1/`decay_horizon`).

With `window_size` ≥ the sequence length the hybrid layer *is* softmax attention (either update rule: the delta
rule's state is then empty), so a freshly converted model reproduces its teacher's logits exactly there: the
conversion tests rely on it.

A source with sliding-window attention (Mistral's `sliding_window`; Qwen2's and Qwen3's with `use_sliding_window`,
in the layers its `layer_types` mark) is converted without that window, and the conversion logs a warning naming
what changed (`sliding_window_change`). The model has no windowed kind of full softmax attention to keep it in, and
the window would not serve: the converted layers hold exact softmax over their own `window_size` tokens and carry
everything older in a recurrent state (a constant-size cache, the point of converting), and the softmax layers and
heads are there to attend to the whole context. Leaving the window out changes nothing over inputs no longer than it
(every key lies inside it); beyond it, the converted layers and heads see keys the source never attended to.

    from hf_linear_attn import convert_to_linear_attention
    student = convert_to_linear_attention("HuggingFaceTB/SmolLM2-135M", feature_map="hedgehog",
                                          feature_dim=64, window_size=64, num_sink_tokens=4)
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging

from .configuration_linear_attention import (
    ATTENTION_OPTIONS,
    LENGTH_DEPENDENT_ROPE_TYPES,
    AttentionOptions,
    InputError,
    LinearAttentionConfig,
)
from .modeling_linear_attention import LinearAttention, LinearAttentionForCausalLM

logger = logging.get_logger(__name__)
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

# The LoLCATs recipe (Zhang et al. 2024): Hedgehog feature map, 64-token window, a few sinks; the softmax layers and
# heads sharpened past the source's trained positions (`softmax_log_length_scale`, which changes nothing within them:
# on the demo's model, read whole at 32K, it took KJV from 1.10x to 1.05x the same tokens read within 4K, and Austen,
# not used for the choice, from 1.13x to 1.08x; docs/results/long-context.md); every other attention option at its
# `AttentionOptions` default.
DEFAULT_ATTENTION_OPTIONS: dict[str, Any] = asdict(AttentionOptions(feature_map="hedgehog", window_size=64,
                                                                    num_sink_tokens=4, softmax_log_length_scale=0.4))

# Gated DeltaNet (Yang et al. 2024) as a conversion target: the delta rule with a per-head data-dependent decay,
# a width-4 short convolution, and the output norm and gate; φ is the identity (q, k are L2-normalised).
GATED_DELTANET_OPTIONS: dict[str, Any] = dict(update_rule="delta", feature_map="identity", normalize=False,
                                              window_size=0, num_sink_tokens=0, decay="scalar", conv_size=4,
                                              output_norm=True, output_gate=True)
# Gated DeltaNet beside the demo's window: exact softmax over 64 tokens and 4 sinks, the delta rule for what has left.
GATED_DELTANET_WINDOW_OPTIONS: dict[str, Any] = dict(GATED_DELTANET_OPTIONS, window_size=64, num_sink_tokens=4)


def converted_position_cap(source_config, requested: int | None) -> int | None:
    """The `rope_position_cap` of a conversion: `requested`, or the source's `max_position_embeddings` (its RoPE is
    trained up to there; past it the slow rotations are held). None with a length-dependent RoPE, whose rotations
    follow the input. InputError for a cap that is not an int in [2, max_position_embeddings] or one with a
    length-dependent RoPE."""
    trained = source_config.max_position_embeddings
    if source_config.rope_parameters.get("rope_type") in LENGTH_DEPENDENT_ROPE_TYPES:
        if requested is not None:
            raise InputError(f"rope_position_cap {requested}: the source's rope_type "
                             f"{source_config.rope_parameters['rope_type']!r} rotates by the input's length, which a "
                             "cap cannot hold fixed; leave it unset")
        return None
    if requested is None:
        return trained
    if isinstance(requested, bool) or not isinstance(requested, int) or not 2 <= requested <= trained:
        raise InputError(f"rope_position_cap {requested!r}: an int from 2 to the source's max_position_embeddings "
                         f"({trained}), the positions its RoPE was trained at")
    return requested


def linear_attention_config(
    source_config, softmax_heads: dict[int, list[int]] | None = None, rope_position_cap: int | None = None,
    **attention_options: Any
) -> LinearAttentionConfig:
    """The `LinearAttentionConfig` of a converted `source_config` (a Llama / Mistral / Qwen2 / Qwen3 config).

    `attention_options` are `AttentionOptions` fields (`ATTENTION_OPTIONS`); unset ones take the
    LoLCATs defaults of `DEFAULT_ATTENTION_OPTIONS`. `softmax_heads` ({layer: [kv_head, ...]}) are the KV heads that
    keep their softmax attention (`LinearAttentionConfig`). `rope_position_cap`: where the slow RoPE rotations stop
    (`LinearAttentionConfig`); None takes the source's `max_position_embeddings`, the positions its RoPE was trained
    at (docs/results/long-context.md measures lower caps). Raises ValueError for another architecture or an
    unknown / invalid option (TypeError for one of the wrong type), before anything is built.
    """
    model_type = getattr(source_config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise InputError(
            f"Cannot convert a {model_type!r} model: supported architectures are "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
            "Qwen3ForCausalLM)."
        )
    unknown = sorted(set(attention_options) - set(ATTENTION_OPTIONS))
    if unknown:
        raise InputError(f"Unknown attention option(s) {unknown}; allowed: {list(ATTENTION_OPTIONS)}.")
    options = {**DEFAULT_ATTENTION_OPTIONS, **{k: v for k, v in attention_options.items() if v is not None}}

    c = source_config
    position_cap = converted_position_cap(c, rope_position_cap)
    if model_type == "qwen2":  # q/k/v carry a bias, o does not
        qkv_bias, out_bias = True, False
    else:
        qkv_bias = out_bias = bool(getattr(c, "attention_bias", False))
    num_heads = c.num_attention_heads
    return LinearAttentionConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // num_heads,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        initializer_range=getattr(c, "initializer_range", 0.02),
        rms_norm_eps=c.rms_norm_eps,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        rope_parameters=dict(c.rope_parameters),
        rope_position_cap=position_cap,
        attention_bias=qkv_bias,
        attention_out_bias=out_bias,
        use_qk_norm=model_type == "qwen3",
        mlp_bias=bool(getattr(c, "mlp_bias", False)),
        softmax_heads=softmax_heads,
        base_model_name_or_path=getattr(c, "_name_or_path", None) or None,
        base_model_type=model_type,
        **options,
    )


def sliding_window_change(source_config, config: LinearAttentionConfig) -> str | None:
    """What converting `source_config` into `config` changes of the source's sliding-window attention, in words; None
    when no layer of the source attends through a window shorter than its `max_position_embeddings`. The layers
    that slide are those `layer_types` marks "sliding_attention" (Qwen2, Qwen3), or every layer when the config has
    no `layer_types` (Mistral)."""
    window = getattr(source_config, "sliding_window", None)
    if not window or window >= source_config.max_position_embeddings:
        return None
    types = getattr(source_config, "layer_types", None)
    sliding = [i for i in range(config.num_hidden_layers) if types is None or types[i] == "sliding_attention"]
    if not sliding:
        return None
    where = (f"all {len(sliding)} layers" if len(sliding) == config.num_hidden_layers else f"layers {sliding}")
    softmax_layers = [i for i in sliding if config.layer_kind(i) == "softmax"]
    recurrent = [i for i in sliding if i not in softmax_layers]
    heads = {i: list(config.softmax_heads_of(i)) for i in recurrent if config.softmax_heads_of(i)}
    changes = []
    if recurrent:
        reach = (f"exact softmax over their last {config.window_size} tokens (+ {config.num_sink_tokens} sinks) and a "
                 "recurrent state over everything older" if config.window_size else
                 "a recurrent state over the whole context")
        changes.append(f"its {config.layer_kind(recurrent[0])} layers {recurrent} attend with {reach}, not cut at "
                       f"{window} tokens")
        if config.window_size > window:
            changes.append(f"their window of {config.window_size} tokens reaches past the source's {window}")
    if softmax_layers:
        changes.append(f"its softmax layers {softmax_layers} attend to the whole context")
    if heads:
        changes.append(f"its softmax heads {heads} attend to the whole context")
    return (f"The {source_config.model_type} source attends through a sliding window of {window} tokens in {where}; "
            f"the converted model does not keep that window: {'; '.join(changes)}. Attention transfer's softmax "
            f"targets are full causal attention, the source's own within {window} tokens only: train on rows "
            f"(block_size) of at most {window} tokens.")


def load_teacher(model_name_or_path: str, **from_pretrained_kwargs: Any) -> PreTrainedModel:
    """Load a causal-LM checkpoint (a conversion's source, a distillation teacher or a model to train) with
    `AutoModelForCausalLM`, refusing one whose weights do not match the model: transformers would silently
    initialise missing weights at random and drop unexpected ones. Raises ValueError naming them."""
    model, info = AutoModelForCausalLM.from_pretrained(
        model_name_or_path, output_loading_info=True, **from_pretrained_kwargs
    )
    problems = []
    for key, what in (("missing_keys", "is missing weights"), ("unexpected_keys", "has unexpected weights"),
                      ("mismatched_keys", "has weights of the wrong shape")):
        names = sorted(str(name[0] if isinstance(name, tuple) else name) for name in info.get(key) or [])
        if names:
            problems.append(f"{what} {names[:8]}{' ...' if len(names) > 8 else ''}")
    if problems:
        raise InputError(f"{model_name_or_path} {'; '.join(problems)}: an incomplete or mismatched checkpoint is "
                         "refused (its weights would be initialised at random or dropped).")
    return model


def tokenizer_max_length(tokenizer: Any, max_position_embeddings: int | None) -> int | None:
    """The `model_max_length` a converted or trained checkpoint's tokenizer should carry: the tokenizer's own
    when it sets one, else the model's `max_position_embeddings` (a tokenizer saved without a maximum
    reports transformers' placeholder of 1e30)."""
    own = getattr(tokenizer, "model_max_length", None)
    if isinstance(own, int) and 0 < own < 10**12:
        return own
    return max_position_embeddings


def convert_to_linear_attention(
    model_or_path: PreTrainedModel | str, dtype: torch.dtype | None = None,
    softmax_heads: dict[int, list[int]] | None = None, rope_position_cap: int | None = None, **attention_options: Any
) -> LinearAttentionForCausalLM:
    """Convert a softmax-attention causal LM (an instance, a local folder or a Hub id) into a
    `LinearAttentionForCausalLM` with the given attention options (`LinearAttentionConfig` field names),
    `softmax_heads` ({layer: [kv_head, ...]}: KV heads that keep the teacher's softmax attention, exactly) and
    `rope_position_cap` (None: the teacher's `max_position_embeddings`; `linear_attention_config`).

    Every weight of the source is copied (the source model is left untouched); the new attention parameters
    take their initial values. The result is in eval mode, in `dtype` (default: the source's dtype).
    """
    if isinstance(model_or_path, str):
        # Build the config first so that bad options fail before the weights are read.
        from transformers import AutoConfig

        linear_attention_config(AutoConfig.from_pretrained(model_or_path), softmax_heads, rope_position_cap,
                                **attention_options)
        teacher = load_teacher(model_or_path)
    elif isinstance(model_or_path, PreTrainedModel):
        teacher = model_or_path
    else:
        raise TypeError(f"model_or_path must be a PreTrainedModel or a path / Hub id, got {type(model_or_path)}")
    config = linear_attention_config(teacher.config, softmax_heads, rope_position_cap, **attention_options)
    if change := sliding_window_change(teacher.config, config):
        logger.warning(change)
    dtype = dtype or next(teacher.parameters()).dtype

    student = LinearAttentionForCausalLM(config).to(dtype)
    source = teacher.state_dict()
    target = student.state_dict()
    unexpected = sorted(k for k in source if k not in target and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise InputError(
            f"The source has weights the converted model has no place for: {unexpected[:8]}; is it really a "
            f"{config.base_model_type} checkpoint?"
        )
    incompatible = student.load_state_dict({k: v for k, v in source.items() if k in target}, strict=False)
    added = {f"{prefix}.{name}" for prefix, layer in student.named_modules() if isinstance(layer, LinearAttention)
             for name in layer.added_parameters()}  # what the layers declare new (`LinearAttention.TEACHER_PARTS`)
    not_copied = [k for k in incompatible.missing_keys if k not in added]
    if config.tie_word_embeddings:
        not_copied = [k for k in not_copied if k != "lm_head.weight"]
    if not_copied:
        raise InputError(f"The source checkpoint lacks weights the converted model needs: {not_copied[:8]}")
    if config.tie_word_embeddings:
        student.tie_weights()
    with torch.no_grad():
        for name, conv in student.named_modules():
            if name.endswith("qkv_conv"):  # the identity: y_t = x_t (the last tap sees the current token)
                conv.weight.zero_()
                conv.weight[:, :, -1] = 1.0
    return student.eval()


__all__ = [
    "convert_to_linear_attention", "linear_attention_config", "load_teacher", "sliding_window_change",
    "tokenizer_max_length",
    "DEFAULT_ATTENTION_OPTIONS", "GATED_DELTANET_OPTIONS", "GATED_DELTANET_WINDOW_OPTIONS",
]
