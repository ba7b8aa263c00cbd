"""Evaluate converted linear-attention models against their softmax teacher.

    hf-linear-attn-long-context prepare               # once: the held-out long texts (make long-context-data)
    python training/evaluate.py --teacher_name_or_path SRC --models converted=DIR stage1=DIR2 \
        [--teacher_gguf_file F] [--config RECIPE.yaml] [--block_size 512 --max_eval_rows 16 ...] \
        [--long_contexts 256 512 1024 2048 4096 --long_scored_tokens 8192 --long_min_rows 8] \
        [--passkey_lengths 1024 2048 4096 --passkey_trials 50 --passkey_variants chat single multi \
         --passkey_models teacher stage1]
    hf-linear-attn-evaluate ...                           # the same, installed as a command

Reports, for the teacher, its training-free sliding-window baseline and every `label=path` model
(`training.evaluation`): short held-out perplexity, long-context perplexity and cache bytes by context,
passkey retrieval (natural and filler haystacks; the chat variant the instruct teacher passes, one key in plain
text, several keyed doors; greedy accuracy, the key's log-probability ± its standard error and argmax accuracy,
one teacher-forced forward per trial), decode cache bytes / latency. Writes
`evaluation.{md,json,png}` and `decode.{md,json,png}` to `--output_dir` and prints the tables. Unless
`--update_model_cards false`, every linear-attention checkpoint evaluated also gets the numbers in its folder
(`evaluation.json`) and a model card (`README.md`) that shows them.
"""

from __future__ import annotations

from hf_linear_attn.training.command_line import exit_on_bad_input
from hf_linear_attn.training.data import DataArguments
from hf_linear_attn.training.evaluation import EvaluateArguments, evaluate_models, write_evaluation
from hf_linear_attn.training.host_memory import keep_freed_memory
from hf_linear_attn.training.recipes import parse_recipe_args


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # this process runs one job: reuse freed host memory (training.host_memory)
    args, data_args = parse_recipe_args((EvaluateArguments, DataArguments), argv)
    with exit_on_bad_input():
        write_evaluation(evaluate_models(args, data_args), args, data_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
