"""Fine-tune (or train from a config) a linear-attention causal LM with `accelerate`.

    accelerate launch training/finetune.py --config configs/finetune_tiny.yaml [--field value ...]
    python training/finetune.py --model_name_or_path DIR --train_file docs.jsonl --use_lora --max_steps 500

A recipe (`--config FILE.yaml`) sets any field of `training.stages.FINETUNE_ARGUMENTS`; flags on the
command line override it, and every field works without a recipe too (an empty value, e.g. `--config_name ""`,
unsets a field the recipe sets). Flag names follow transformers' run_clm.py.

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

The run is `training.stages.finetune`; this script parses its arguments.
"""

from __future__ import annotations

from hf_linear_attn.training.command_line import exit_on_bad_input
from hf_linear_attn.training.recipes import parse_recipe_args
from hf_linear_attn.training.stages import FINETUNE_ARGUMENTS, FinetuneArguments, finetune


def parse_args(argv: list[str] | None = None) -> FinetuneArguments:
    """The four argument dataclasses from `--config RECIPE.yaml` (optional) and the flags that override it
    (default: the command line)."""
    return parse_recipe_args(FINETUNE_ARGUMENTS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with exit_on_bad_input():
        finetune(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
