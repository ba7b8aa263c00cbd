"""Stage 1 of the conversion recipe: attention transfer (LoLCATs).

    accelerate launch training/distill.py --model_name_or_path CONVERTED_DIR --output_dir DIR \
        [--config configs/RECIPE.yaml] [--max_steps 200 --block_size 512 ...]

Every linear-attention layer of the converted model (`training/convert.py`) computes, from the
same frozen q/k/v, both its own output and the softmax output of the teacher it replaced; the loss
is the MSE between the two per-head outputs (before `o_proj`), summed over layers, and the
teacher's output is what flows on to the next layer (teacher forcing), so each layer learns from
exactly the inputs it will see (`training.attention_transfer`, hooks installed for the run only).
Only the parameters conversion adds train (`--trainable_parameters`): feature maps, the window mixing γ
and the decay gates (a decayed window hybrid starts with long memory and learns here where to forget) and,
for the delta rule, the β projection, the short convolution and the output gate. The loss is layer-local:
the LM head plays no part.

Runs on the fine-tuning loop (`training.loop`: accelerate, checkpoints every `--save_steps`,
`--resume_from_checkpoint latest`, progress bar, eval loss on held-out rows). Stage 2 (LoRA
recovery with next-token loss) is `training/finetune.py` on the result, e.g.
`--use_lora --lora_r 8 --lora_alpha 16`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accelerate.utils import set_seed
from transformers import AutoTokenizer

import hf_linear_attn
from hf_linear_attn.conversion import load_teacher, tokenizer_max_length
from training.attention_transfer import AttentionTransfer, attention_transfer_loss, transfer_layers
from training.checkpoints import export_model
from training.command_line import exit_on_bad_input
from training.data import DataArguments, build_datasets, check_data_arguments
from training.loop import TrainArguments, TrainResult, check_train_arguments, make_accelerator, train
from training.model_card import write_model_card, write_training_summary
from training.recipes import parse_recipe_args, recipe_dict


@dataclass
class DistillArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A converted LinearAttentionForCausalLM checkpoint (training/convert.py)."}
    )
    trainable_parameters: list[str] = field(
        default_factory=lambda: [r"feature_map|window_gate|decay_proj|beta_proj|qkv_conv|g_proj"],
        metadata={"help": "Regexes of the parameter names that train (default: feature maps, window γ, decay gates and "
                          "the delta rule's β projection, short convolution and output gate; each regex must match)."},
    )


def distill(args: DistillArguments, data_args: DataArguments, train_args: TrainArguments) -> TrainResult:
    """Run stage 1 and save the student (an ordinary model again) to `train_args.output_dir`."""
    if not args.model_name_or_path:
        raise ValueError("--model_name_or_path (a converted checkpoint, see training/convert.py) is required.")
    check_data_arguments(data_args)
    check_train_arguments(train_args)
    model = load_teacher(args.model_name_or_path)  # refuses missing or unexpected weights
    if not isinstance(model, hf_linear_attn.LinearAttentionForCausalLM):
        raise ValueError(f"{args.model_name_or_path} holds a {type(model).__name__}, not a linear-attention model; "
                         "convert it first with training/convert.py.")
    if not transfer_layers(model):
        raise ValueError(f"{args.model_name_or_path} has no linear-attention layer to distill (all softmax_layers).")
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenizer.model_max_length = tokenizer_max_length(tokenizer, model.config.max_position_embeddings)
    accelerator = make_accelerator(train_args)
    set_seed(train_args.seed)
    datasets = build_datasets(data_args, tokenizer, accelerator.main_process_first())
    with AttentionTransfer(model):  # hooks on the layers, removed before the student is saved
        result = train(model, datasets["train"], datasets["validation"], train_args, accelerator,
                       loss_fn=attention_transfer_loss, trainable=args.trainable_parameters, run_name="distill",
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


def main(argv: list[str] | None = None) -> int:
    args = parse_recipe_args((DistillArguments, DataArguments, TrainArguments), argv)
    with exit_on_bad_input():
        distill(*args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
