"""Fine-tune (or train from a config) a linear-attention causal LM with `accelerate`.

    accelerate launch training/finetune.py --config configs/finetune_tiny.yaml [--field value ...]
    python training/finetune.py --model_name_or_path DIR --train_file docs.jsonl --use_lora --max_steps 500

A recipe (`--config FILE.yaml`) sets any of the fields below; flags on the command line override it,
and every field works without a recipe too (an empty value, e.g. `--config_name ""`, unsets a field the
recipe sets). Flag names follow transformers' run_clm.py.

- Model: a `LinearAttentionForCausalLM` checkpoint (`--model_name_or_path`, folder or Hub id) or a
  config to train from scratch (`--config_name`: folder, config.json file or Hub id; tokenizer: the
  `--tokenizer_name` one, else a byte-level tokenizer built in, see `training.data`);
  `--config_overrides "k=v,k=v"` changes config fields.
- What trains: everything (default), the parameters matching the regexes `--trainable_parameters`
  (e.g. `feature_map window_gate`), or LoRA adapters (`--use_lora`, on `--lora_target_modules`) plus
  any matches; LoRA is merged into the saved weights unless `--merge_lora false`.
- Data (`training.data`): a Hub dataset, local files or the embedded offline corpus, packed into rows
  of `--block_size` tokens with document boundaries respected, and a held-out split.
- Loop (`training.loop`): checkpoints `OUTPUT_DIR/checkpoint-STEP` every `--save_steps`, resumable with
  `--resume_from_checkpoint latest`; the final model, tokenizer, `training_summary.json` and a model
  card go to `OUTPUT_DIR`, and `--push_to_hub --hub_model_id USER/NAME` uploads them.

Every bad input (a missing file, an unknown recipe key or column, a checkpoint that is not a
linear-attention model or has missing or unexpected weights, LoRA targets that match nothing, nothing to
resume, an earlier run in the output folder without `--resume_from_checkpoint` or
`--overwrite_output_dir`) is reported before training; an earlier run that `--overwrite_output_dir`
replaces is deleted only once the new run has its first checkpoint (`training.checkpoints`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

import hf_linear_attn
from hf_linear_attn.conversion import load_teacher, tokenizer_max_length
from training.checkpoints import export_model
from training.command_line import exit_on_bad_input
from training.data import DataArguments, build_datasets, byte_level_tokenizer, check_data_arguments
from training.hub import HubArguments, push_to_hub
from training.loop import (
    TrainArguments,
    TrainResult,
    check_train_arguments,
    make_accelerator,
    select_trainable,
    train,
)
from training.losses import causal_lm_loss, logit_distillation_loss
from training.model_card import write_model_card, write_training_summary
from training.recipes import parse_recipe_args, recipe_dict

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


ARGUMENT_CLASSES = (ModelArguments, DataArguments, TrainArguments, HubArguments)
Arguments = tuple[ModelArguments, DataArguments, TrainArguments, HubArguments]


def parse_args(argv: list[str] | None = None) -> Arguments:
    """The four argument dataclasses from `--config RECIPE.yaml` (optional) and the flags that override it
    (default: the command line)."""
    return parse_recipe_args(ARGUMENT_CLASSES, argv)


def check_arguments(model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments,
                    hub_args: HubArguments) -> None:
    """Every check that needs nothing loaded; raises a clear error."""
    if bool(model_args.model_name_or_path) == bool(model_args.config_name):
        raise ValueError("Give exactly one of --model_name_or_path (fine-tune a checkpoint) and --config_name "
                         "(train from a config); see configs/finetune_tiny.yaml for a complete recipe.")
    if model_args.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"--dtype {model_args.dtype!r}: use one of {WEIGHT_DTYPES}.")
    if model_args.dtype != "float32" and (not model_args.use_lora or model_args.trainable_parameters):
        raise ValueError(f"--dtype {model_args.dtype} is for the frozen base of a LoRA run: weights that train "
                         "stay float32 (--mixed_precision bf16 gives bf16 compute).")
    if model_args.use_lora:
        if model_args.lora_r < 1:
            raise ValueError(f"--lora_r must be >= 1, got {model_args.lora_r}.")
        if model_args.trainable_parameters and not model_args.merge_lora:
            raise ValueError("--trainable_parameters with an unmerged LoRA adapter: a PEFT adapter does not store "
                             "the base weights that would train; set --merge_lora true.")
    if model_args.teacher_gguf_file and not model_args.teacher_name_or_path:
        raise ValueError("--teacher_gguf_file names a file inside --teacher_name_or_path, which is not set.")
    if not 0.0 <= model_args.kl_weight <= 1.0:
        raise ValueError(f"--kl_weight must be in [0, 1], got {model_args.kl_weight}.")
    if model_args.kl_temperature <= 0:
        raise ValueError(f"--kl_temperature must be > 0, got {model_args.kl_temperature}.")
    if hub_args.push_to_hub:
        if not hub_args.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id USER/NAME.")
        if model_args.use_lora and not model_args.merge_lora:
            raise ValueError("--push_to_hub uploads a full model: keep --merge_lora true.")
    check_data_arguments(data_args)
    check_train_arguments(train_args)  # also the output folder: an earlier run is resumed or explicitly replaced


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    """The tokenizer named, the checkpoint's, or (training from a config) the built-in byte-level one."""
    source = model_args.tokenizer_name or model_args.model_name_or_path
    if not source:
        return byte_level_tokenizer()
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(f"No tokenizer could be loaded from {source} ({error}); pass --tokenizer_name.") from None


def load_config(model_args: ModelArguments) -> PretrainedConfig:
    """The model's config, checked to be a linear-attention one, with `config_overrides` applied."""
    source = model_args.model_name_or_path or model_args.config_name
    flag = "--model_name_or_path" if model_args.model_name_or_path else "--config_name"
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    except OSError as error:  # neither a folder with a config nor a reachable Hub id
        raise ValueError(f"{flag} {source}: no config could be loaded ({error}).") from None
    if config.model_type != hf_linear_attn.LinearAttentionConfig.model_type:
        raise ValueError(
            f"{source} is a {config.model_type!r} model, not a linear-attention one: convert it first "
            "(training/convert.py or hf_linear_attn.convert_to_linear_attention), then fine-tune the result."
        )
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
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
        raise ValueError(f"The tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
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
        raise ValueError(f"--lora_target_modules {missing} match no module of the model; linear modules: {linear}.")
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
        raise ValueError(f"The teacher {model_args.teacher_name_or_path} predicts {teacher_vocab} tokens but the "
                         f"model {config.vocab_size}: logit distillation needs the same vocabulary.")
    return teacher.eval().requires_grad_(False)


def trainable_patterns(model_args: ModelArguments) -> list[str] | None:
    """Regexes of the parameters that train (None: all of a plain model)."""
    if model_args.use_lora:
        return [r"\.lora_", *(model_args.trainable_parameters or [])]
    return model_args.trainable_parameters


def _shards_parameters(accelerator: Accelerator) -> bool:
    plugin = accelerator.state.deepspeed_plugin
    return accelerator.distributed_type == DistributedType.FSDP or (
        accelerator.distributed_type == DistributedType.DEEPSPEED and plugin is not None and plugin.zero_stage == 3
    )


def run(args: Arguments) -> TrainResult:
    """Set up everything (checking all inputs first), train, save and optionally push."""
    model_args, data_args, train_args, hub_args = args
    check_arguments(*args)
    accelerator = make_accelerator(train_args)
    if model_args.use_lora and model_args.merge_lora and _shards_parameters(accelerator):
        raise ValueError("Merging LoRA needs the full weights on one process; under FSDP / ZeRO-3 train with "
                         "--merge_lora false and merge the saved adapter afterwards.")
    set_seed(train_args.seed)
    config = load_config(model_args)
    tokenizer = load_tokenizer(model_args)
    fit_to_tokenizer(config, tokenizer, from_scratch=bool(model_args.config_name))
    datasets = build_datasets(data_args, tokenizer, accelerator.main_process_first())
    model = build_model(model_args, config)
    loss_fn = causal_lm_loss
    if model_args.teacher_name_or_path:
        teacher = load_distillation_teacher(model_args, config).to(accelerator.device)
        loss_fn = logit_distillation_loss(teacher, model_args.kl_weight, model_args.kl_temperature)
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with exit_on_bad_input():
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
