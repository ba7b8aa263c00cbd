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

The run is `training.stages.distill`; this script parses its arguments.
"""

from __future__ import annotations

from hf_linear_attn.training.command_line import exit_on_bad_input
from hf_linear_attn.training.data import DataArguments
from hf_linear_attn.training.loop import TrainArguments
from hf_linear_attn.training.recipes import parse_recipe_args
from hf_linear_attn.training.stages import DistillArguments, distill


def main(argv: list[str] | None = None) -> int:
    args = parse_recipe_args((DistillArguments, DataArguments, TrainArguments), argv)
    with exit_on_bad_input():
        distill(*args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
