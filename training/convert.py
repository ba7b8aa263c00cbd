"""Convert a Llama / Mistral / Qwen2 / Qwen3 checkpoint into a linear-attention checkpoint.

    python training/convert.py --model_name_or_path SRC --output_dir DST [--config RECIPE.yaml] \
        [--feature_map hedgehog --feature_dim 64 --window_size 64 --num_sink_tokens 4 ...]

SRC is a local folder or a Hub id (`--gguf_file` for a GGUF checkpoint in that folder). Every
attention option (`AttentionOptions`: feature map, decay, window, ...) is a flag, with the LoLCATs
defaults of `DEFAULT_ATTENTION_OPTIONS`; a YAML recipe gives defaults that the command line
overrides. The output folder is written atomically (a temporary sibling renamed at the end), so
a failed conversion leaves nothing behind, and `--overwrite_output_dir` replaces an existing folder by
renames (the old one is deleted only once the new one is in place). The output may not be, lie inside
or contain the source folder. It holds safetensors weights, the model code (loads with
`trust_remote_code=True` without this package) and the source's tokenizer, whose `model_max_length`
is the source's (its tokenizer's, else its `max_position_embeddings`).

Softmax-layer selection: `--softmax_layers auto:K --ranking_model STAGE1` keeps as full softmax the K layers
whose restoration alone brings the model closest to the teacher (KL of next-token distributions on
`--ranking_rows` held-out rows of `--block_size` tokens of the data pipeline), measured on STAGE1, a stage-1
checkpoint (training/distill.py) of this same conversion: the output is STAGE1 with those K layers restored
(`hf_linear_attn.layer_selection`), and the ranking is written to `softmax_layer_ranking.json` beside it.
Attention transfer trains each layer on its teacher's exact inputs, so the stage-1 weights of the remaining
layers are what stage 1 of the hybrid itself would have trained.

Softmax-head selection: `--softmax_heads auto:N` keeps exact softmax attention in the N KV heads the teacher
retrieves with most (attention on a pass key, `--head_ranking_prompts` prompts). `--head_ranking restoration
--ranking_model STAGE1` ranks them on STAGE1 itself instead: by how much restoring each head alone raises STAGE1's
log-probability of the key (exactly for the `--head_ranking_shortlist` heads, default 3 × N, that a first-order
estimate ranks best); the output is STAGE1 with the N best restored, training-free, the ranking in
`softmax_head_ranking.json`.

The conversion is `training.checkpoint_conversion.convert_checkpoint`; this script parses its arguments.
"""

from __future__ import annotations

from hf_linear_attn.training.checkpoint_conversion import ConversionArguments, convert_checkpoint
from hf_linear_attn.training.command_line import exit_on_bad_input
from hf_linear_attn.training.data import DataArguments
from hf_linear_attn.training.host_memory import keep_freed_memory
from hf_linear_attn.training.recipes import parse_recipe_args


def parse_args(argv: list[str] | None = None) -> tuple[ConversionArguments, DataArguments]:
    """Command-line flags over an optional YAML recipe (`--config FILE`); the data flags say which held-out rows
    rank the layers for `--softmax_layers auto:K`."""
    return parse_recipe_args((ConversionArguments, DataArguments), argv)


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # this process runs one job: reuse freed host memory (training.host_memory)
    args, data_args = parse_args(argv)
    with exit_on_bad_input():
        convert_checkpoint(args, data_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
