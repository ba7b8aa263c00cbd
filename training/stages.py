"""The training stages after conversion, as functions over their argument dataclasses (the scripts
training/distill.py and training/finetune.py parse a command line into them; `make demo` calls them in turn):

- `distill`: stage 1, attention transfer (LoLCATs). Every linear-attention layer of the converted model computes,
  from the same frozen q/k/v, both its own output and the softmax output of the teacher it replaced; the loss is
  the MSE between the two per-head outputs, and only the parameters conversion adds train
  (`training.attention_transfer`).
- `finetune`: stage 2 or training from a config: full, selected parameters or LoRA (`training.models` builds the
  model), with an optional KL to a teacher; the final model, tokenizer, `training_summary.json` and a model card go
  to the output folder, and optionally to the Hub.

Both run on the training loop (`training.loop`) and check every input before training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from transformers import AutoTokenizer
from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

import hf_linear_attn
from hf_linear_attn.configuration_linear_attention import InputError, check_has_window_weight, check_window_weight
from hf_linear_attn.conversion import converted_position_cap, load_teacher, tokenizer_max_length
from hf_linear_attn.training.attention_transfer import (
    AttentionTransfer,
    attention_transfer_loss,
    check_window_dropout,
    select_transfer_parameters,
    transfer_layers,
)
from hf_linear_attn.training.checkpoints import export_model
from hf_linear_attn.training.data import DataArguments, build_datasets, check_data_arguments, check_positions
from hf_linear_attn.training.hub import HubArguments, push_to_hub
from hf_linear_attn.training.loop import (
    TrainArguments,
    TrainResult,
    check_train_arguments,
    make_accelerator,
    select_trainable,
    train,
)
from hf_linear_attn.training.losses import causal_lm_loss, logit_distillation_loss
from hf_linear_attn.training.model_card import write_model_card, write_training_summary
from hf_linear_attn.training.models import (
    WEIGHT_DTYPES,
    ModelArguments,
    apply_lora,
    build_model,
    fit_to_tokenizer,
    load_config,
    load_distillation_teacher,
    load_tokenizer,
    trainable_patterns,
)
from hf_linear_attn.training.recipes import recipe_dict

# ---------------------------------------------------------------------------------------------- stage 1

@dataclass
class DistillArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A converted LinearAttentionForCausalLM checkpoint (training/convert.py)."}
    )
    trainable_parameters: list[str] | None = field(
        default=None,
        metadata={"help": "Regexes of the parameter names that train, each of which must match (default: the "
                          "parameters conversion adds, as the linear-attention layers declare them in "
                          "LinearAttention.attention_transfer_parameters: feature maps, window γ, decay gates, the "
                          "delta rule's β projection, short convolution and output gate; not the output norm)."},
    )
    window_dropout: float = field(
        default=0.0,
        metadata={"help": "Window layers: the probability that a layer's softmax window shrinks, for one training "
                          "forward, to a size drawn uniformly from 1 .. window_size − 1, so that the linear part "
                          "learns to carry what the window holds (training/attention_transfer.py). 0: the window "
                          "always whole."},
    )


def distill(args: DistillArguments, data_args: DataArguments, train_args: TrainArguments) -> TrainResult:
    """Run stage 1 and save the student (an ordinary model again) to `train_args.output_dir`."""
    if not args.model_name_or_path:
        raise InputError("--model_name_or_path (a converted checkpoint, see training/convert.py) is required.")
    check_data_arguments(data_args)
    check_train_arguments(train_args)
    model = load_teacher(args.model_name_or_path)  # refuses missing or unexpected weights
    if not isinstance(model, hf_linear_attn.LinearAttentionForCausalLM):
        raise InputError(f"{args.model_name_or_path} holds a {type(model).__name__}, not a linear-attention model; "
                         "convert it first with training/convert.py.")
    if not transfer_layers(model):
        raise InputError(f"{args.model_name_or_path} has no linear-attention layer to distill (all softmax_layers).")
    check_window_dropout(args.window_dropout, model.config)
    select_transfer_parameters(model, args.trainable_parameters)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    check_positions(data_args, model.config.max_position_embeddings)
    tokenizer.model_max_length = tokenizer_max_length(tokenizer, model.config.max_position_embeddings)
    accelerator = make_accelerator(train_args)
    set_seed(train_args.seed)
    datasets = build_datasets(data_args, tokenizer, accelerator.main_process_first())
    with AttentionTransfer(model, args.window_dropout):  # hooks on the layers, removed before the student is saved
        result = train(model, datasets["train"], datasets["validation"], train_args, accelerator,
                       loss_fn=attention_transfer_loss, run_name="distill",
                       perplexity=False)
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    export_model(accelerator, result.model, train_args.output_dir, tokenizer)
    if accelerator.is_main_process:
        write_training_summary(train_args.output_dir, script="training/distill.py",
                               base_model=args.model_name_or_path, data_args=data_args, result=result,
                               recipe=recipe_dict((args, data_args, train_args)))
        write_model_card(train_args.output_dir)
    accelerator.print(f"Attention transfer: {result.global_step} steps on {result.tokens_seen:,} tokens "
                      f"(eval: {result.eval_metrics}); student in {train_args.output_dir}")
    accelerator.end_training()
    return result


# ---------------------------------------------------------------------------------------------- stage 2

FINETUNE_ARGUMENTS = (ModelArguments, DataArguments, TrainArguments, HubArguments)
FinetuneArguments = tuple[ModelArguments, DataArguments, TrainArguments, HubArguments]


def check_finetune_arguments(model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments,
                             hub_args: HubArguments) -> None:
    """Every check that needs nothing loaded; raises a clear error."""
    if bool(model_args.model_name_or_path) == bool(model_args.config_name):
        raise InputError("Give exactly one of --model_name_or_path (fine-tune a checkpoint) and --config_name "
                         "(train from a config); see configs/finetune_tiny.yaml for a complete recipe.")
    if model_args.dtype not in WEIGHT_DTYPES:
        raise InputError(f"--dtype {model_args.dtype!r}: use one of {WEIGHT_DTYPES}.")
    if model_args.dtype != "float32" and (not model_args.use_lora or model_args.trainable_parameters):
        raise InputError(f"--dtype {model_args.dtype} is for the frozen base of a LoRA run: weights that train "
                         "stay float32 (--mixed_precision bf16 gives bf16 compute).")
    if model_args.saved_rope_position_cap is not None and model_args.use_lora and not model_args.merge_lora:
        raise InputError("--saved_rope_position_cap is written into the saved model's config, and an unmerged LoRA "
                         "adapter saves none: keep --merge_lora true, or set rope_position_cap when loading.")
    if model_args.use_lora:
        if model_args.lora_r < 1:
            raise InputError(f"--lora_r must be >= 1, got {model_args.lora_r}.")
        if model_args.config_name and not model_args.merge_lora:
            raise InputError("--use_lora --merge_lora false from --config_name: the adapter's base would be a random "
                             "initialisation saved nowhere, so it could never be merged or loaded; fine-tune a "
                             "checkpoint (--model_name_or_path) or keep --merge_lora true.")
        if model_args.trainable_parameters and not model_args.merge_lora:
            raise InputError("--trainable_parameters with an unmerged LoRA adapter: a PEFT adapter does not store "
                             "the base weights that would train; set --merge_lora true.")
    if model_args.teacher_gguf_file and not model_args.teacher_name_or_path:
        raise InputError("--teacher_gguf_file names a file inside --teacher_name_or_path, which is not set.")
    if not 0.0 <= model_args.kl_weight <= 1.0:
        raise InputError(f"--kl_weight must be in [0, 1], got {model_args.kl_weight}.")
    if model_args.kl_temperature <= 0:
        raise InputError(f"--kl_temperature must be > 0, got {model_args.kl_temperature}.")
    if model_args.set_window_weight is not None:
        check_window_weight(model_args.set_window_weight, "--set_window_weight")
    if hub_args.push_to_hub:
        if not hub_args.hub_model_id:
            raise InputError("--push_to_hub needs --hub_model_id USER/NAME.")
        if model_args.use_lora and not model_args.merge_lora:
            raise InputError("--push_to_hub uploads a full model: keep --merge_lora true.")
    check_data_arguments(data_args)
    check_train_arguments(train_args)  # also the output folder: an earlier run is resumed or explicitly replaced


def _shards_parameters(accelerator: Accelerator) -> bool:
    plugin = accelerator.state.deepspeed_plugin
    return accelerator.distributed_type == DistributedType.FSDP or (
        accelerator.distributed_type == DistributedType.DEEPSPEED and plugin is not None and plugin.zero_stage == 3
    )


@contextlib.contextmanager
def whole_weights(accelerator: Accelerator) -> Iterator[None]:
    """Models loaded inside hold their whole weights on every process. Under ZeRO-3 transformers partitions weights
    as it loads them (zero.Init) for DeepSpeed to gather in the forward; a frozen teacher is not handed to DeepSpeed,
    so it must be whole. (accelerate's `zero3_init_context_manager(enable=False)` leaves transformers' DeepSpeed
    config in place in accelerate 1.x, so it is unset here and set again after.)"""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or not is_deepspeed_zero3_enabled():
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def finetune(args: FinetuneArguments) -> TrainResult:
    """Stage 2, or training from a config: set up everything (checking all inputs first), train, save and optionally
    push."""
    model_args, data_args, train_args, hub_args = args
    check_finetune_arguments(*args)
    accelerator = make_accelerator(train_args)
    if model_args.use_lora and model_args.merge_lora and _shards_parameters(accelerator):
        raise InputError("Merging LoRA needs the full weights on one process; under FSDP / ZeRO-3 train with "
                         "--merge_lora false, then merge the saved adapter into its base: hf-linear-attn-export "
                         "--model_name_or_path OUTPUT_DIR --output_dir MERGED_DIR.")
    set_seed(train_args.seed)
    config = load_config(model_args)
    tokenizer = load_tokenizer(model_args)
    fit_to_tokenizer(config, tokenizer, from_scratch=bool(model_args.config_name))
    check_positions(data_args, getattr(config, "max_position_embeddings", None))
    if model_args.set_window_weight is not None:
        check_has_window_weight(config, "--set_window_weight", model_args.set_window_weight)
    if model_args.saved_rope_position_cap is not None:
        converted_position_cap(config, model_args.saved_rope_position_cap)  # the bound is the model's positions
    datasets = build_datasets(data_args, tokenizer, accelerator.main_process_first())
    model = build_model(model_args, config)
    if model_args.set_window_weight is not None:
        model.set_window_weight(model_args.set_window_weight)
    loss_fn = causal_lm_loss
    if model_args.teacher_name_or_path:
        with whole_weights(accelerator):
            teacher = load_distillation_teacher(model_args, config).to(accelerator.device)
        loss_fn = logit_distillation_loss(teacher, model_args.kl_weight, model_args.kl_temperature,
                                          teacher_precision=accelerator.autocast)
    if train_args.gradient_checkpointing:
        # transformers 5.24 renamed it (the old name warns); 5.5 has only the old one.
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})  # the checkpoint kwargs, first parameter of both
    if model_args.use_lora:
        model = apply_lora(model, model_args)
    patterns = trainable_patterns(model_args)
    if patterns is not None:
        select_trainable(model, patterns)
    # Held-out metrics stay next-token cross-entropy and perplexity whatever the training objective.
    result = train(model, datasets["train"], datasets["validation"], train_args, accelerator, loss_fn=loss_fn,
                   eval_loss_fn=causal_lm_loss, tracker_config=recipe_dict(args))
    if model_args.saved_rope_position_cap is not None:
        accelerator.unwrap_model(result.model).config.rope_position_cap = model_args.saved_rope_position_cap
    export_model(accelerator, result.model, train_args.output_dir, tokenizer, merge_lora=model_args.merge_lora)
    if accelerator.is_main_process:
        write_training_summary(train_args.output_dir, script="training/finetune.py",
                               base_model=model_args.model_name_or_path, data_args=data_args, result=result,
                               recipe=recipe_dict(args), license=hub_args.license)
        if not (model_args.use_lora and not model_args.merge_lora):  # an adapter folder has no model config
            write_model_card(train_args.output_dir, repo_id=hub_args.hub_model_id)
        if hub_args.push_to_hub:
            url = push_to_hub(train_args.output_dir, hub_args.hub_model_id, private=hub_args.hub_private_repo,
                              license=hub_args.license)
            accelerator.print(f"Pushed to {url}")
    accelerator.print(f"Trained {result.global_step} steps on {result.tokens_seen:,} tokens "
                      f"(eval: {result.eval_metrics}); model in {train_args.output_dir}")
    accelerator.end_training()
    return result
