"""The model a training run trains, built from its `ModelArguments`: the config (checked to be a linear-attention one,
overrides applied), the tokenizer (the checkpoint's, a named one, or the built-in byte-level one), the weights
(a checkpoint refusing missing or unexpected weights, or a fresh initialisation), LoRA adapters, and the frozen
teacher of logit distillation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

import hf_linear_attn
from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.conversion import load_teacher, tokenizer_max_length
from hf_linear_attn.training.data import byte_level_tokenizer

LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelArguments:
    """Which model trains, and which of its parameters."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A LinearAttentionForCausalLM checkpoint: folder or Hub id."}
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Train from scratch from this config: folder, config.json or Hub id."}
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "Config changes as `k=v,k=v`, e.g. `hidden_size=64,window_size=32`."}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer folder or Hub id (default: the model's, or built-in bytes)."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow code from the checkpoint's folder."})
    dtype: str = field(
        default="float32",
        metadata={"help": f"Dtype of the loaded weights (the teacher's too), one of {WEIGHT_DTYPES}. Weights that "
                          "train stay float32 (use --mixed_precision for bf16 compute); bfloat16 / float16 halve the "
                          "memory of the frozen base under LoRA."},
    )
    trainable_parameters: list[str] | None = field(
        default=None,
        metadata={"help": "Regexes over parameter names that train (default: all; with LoRA: LoRA only, plus these)."},
    )
    use_lora: bool = field(default=False, metadata={"help": "Train LoRA adapters (peft) instead of the weights."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(LORA_DEFAULT_TARGETS),
        metadata={"help": "Module names that get adapters (each must match a module)."},
    )
    merge_lora: bool = field(
        default=True, metadata={"help": "Merge LoRA into the saved weights (else save a PEFT adapter)."}
    )
    teacher_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Logit distillation: a frozen causal LM with the same vocabulary (e.g. the softmax "
                          "model a conversion started from) whose next-token distributions the model also learns."},
    )
    teacher_gguf_file: str | None = field(default=None, metadata={"help": "GGUF file of the teacher, in its folder."})
    kl_weight: float = field(
        default=0.5, metadata={"help": "With a teacher, the loss is (1 - w) * cross-entropy + w * T^2 * KL(teacher "
                                       "|| model), per token; w in [0, 1] (1: KL only)."}
    )
    kl_temperature: float = field(default=1.0, metadata={"help": "Softmax temperature T of both distributions."})
    set_window_weight: float | None = field(
        default=None,
        metadata={"help": "Before training, set the additive window hybrid's γ to this in every head (in (0, 1); "
                          "`LinearAttentionForCausalLM.set_window_weight`): e.g. raised after attention transfer "
                          "for a LoRA recovery, which does not train γ. None: as the checkpoint has it."},
    )
    saved_rope_position_cap: int | None = field(
        default=None,
        metadata={"help": "Write this rope_position_cap (from 2 to max_position_embeddings) into the saved model: "
                          "training reads positions as the checkpoint does, the saved model holds RoPE's slow "
                          "rotations at this many positions past it (e.g. the training rows' length). None: as the "
                          "checkpoint has it."},
    )


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    """The tokenizer named, the checkpoint's, or (training from a config) the built-in byte-level one."""
    source = model_args.tokenizer_name or model_args.model_name_or_path
    if not source:
        return byte_level_tokenizer()
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError) as error:
        raise InputError(f"No tokenizer could be loaded from {source} ({error}); pass --tokenizer_name.") from None


def load_config(model_args: ModelArguments) -> PretrainedConfig:
    """The model's config, checked to be a linear-attention one, with `config_overrides` applied."""
    source = model_args.model_name_or_path or model_args.config_name
    flag = "--model_name_or_path" if model_args.model_name_or_path else "--config_name"
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    except OSError as error:  # neither a folder with a config nor a reachable Hub id
        raise InputError(f"{flag} {source}: no config could be loaded ({error}).") from None
    if config.model_type != hf_linear_attn.LinearAttentionConfig.model_type:
        raise InputError(
            f"{source} is a {config.model_type!r} model, not a linear-attention one: convert it first "
            "(training/convert.py or hf_linear_attn.convert_to_linear_attention), then fine-tune the result."
        )
    if model_args.config_overrides:
        try:
            config.update_from_string(model_args.config_overrides)
        except ValueError as error:  # transformers': a malformed pair or a field the config lacks
            raise InputError(f"--config_overrides {model_args.config_overrides!r}: {error}") from None
        config = type(config).from_dict(config.to_dict())  # rebuilt, so that the new values are validated
    return config


def fit_to_tokenizer(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, from_scratch: bool) -> None:
    """From scratch, vocabulary size and special tokens come from the tokenizer; a checkpoint's
    embeddings must cover the tokenizer. A tokenizer without a maximum length gets the model's."""
    tokenizer.model_max_length = tokenizer_max_length(tokenizer, config.max_position_embeddings)
    if from_scratch:
        config.vocab_size = len(tokenizer)
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    elif len(tokenizer) > config.vocab_size:
        raise InputError(f"The tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{config.vocab_size}.")


def build_model(model_args: ModelArguments, config: PretrainedConfig) -> PreTrainedModel:
    """Load the checkpoint (refusing one with missing or unexpected weights) or initialise from the config
    (seeded by the caller), in `model_args.dtype`."""
    dtype = getattr(torch, model_args.dtype)
    if model_args.model_name_or_path:
        return load_teacher(model_args.model_name_or_path, config=config, dtype=dtype,
                            trust_remote_code=model_args.trust_remote_code)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=model_args.trust_remote_code)


def apply_lora(model: PreTrainedModel, model_args: ModelArguments) -> torch.nn.Module:
    """Wrap `model` with LoRA adapters on `lora_target_modules`; raises if a target matches no module."""
    from peft import LoraConfig, TaskType, get_peft_model

    module_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    missing = [target for target in model_args.lora_target_modules if target not in module_names]
    if missing:
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        raise InputError(f"--lora_target_modules {missing} match no module of the model; linear modules: {linear}.")
    config = LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
                        target_modules=list(model_args.lora_target_modules), task_type=TaskType.CAUSAL_LM)
    return get_peft_model(model, config)


def load_distillation_teacher(model_args: ModelArguments, config: PretrainedConfig) -> PreTrainedModel:
    """The frozen teacher of logit distillation (eval mode, no gradients), checked to predict over the
    model's vocabulary."""
    kwargs = {"gguf_file": model_args.teacher_gguf_file} if model_args.teacher_gguf_file else {}
    teacher = load_teacher(model_args.teacher_name_or_path, dtype=getattr(torch, model_args.dtype),
                           trust_remote_code=model_args.trust_remote_code, **kwargs)
    teacher_vocab = teacher.get_output_embeddings().weight.shape[0]
    if teacher_vocab != config.vocab_size:
        raise InputError(f"The teacher {model_args.teacher_name_or_path} predicts {teacher_vocab} tokens but the "
                         f"model {config.vocab_size}: logit distillation needs the same vocabulary.")
    return teacher.eval().requires_grad_(False)


def trainable_patterns(model_args: ModelArguments) -> list[str] | None:
    """Regexes of the parameters that train (None: all of a plain model)."""
    if model_args.use_lora:
        return [r"\.lora_", *(model_args.trainable_parameters or [])]
    return model_args.trainable_parameters
