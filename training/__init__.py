"""The training package, installed as `hf_linear_attn.training`: scripts and the library modules they are thin command
lines over.

Scripts (`python training/NAME.py`, `python -m hf_linear_attn.training.NAME`, `accelerate launch training/NAME.py`, or
the installed commands `hf-linear-attn-convert`, `-distill`, `-finetune`, `-evaluate`, `-export`, `-push`,
`-long-context`); each parses its
arguments and calls library functions, none imports another, all exit alike (`command_line.py`):
- `convert.py`       softmax checkpoint -> linear-attention checkpoint
- `distill.py`       stage 1, attention transfer
- `finetune.py`      the `accelerate launch` fine-tuning CLI (recipes in `configs/*.yaml`)
- `evaluate.py`      perplexity (short rows and by context on long held-out texts), passkey retrieval and
                     decode cost against the softmax teacher and its sliding-window baseline
- `long_context.py`  `hf-linear-attn-long-context prepare|needles`: the held-out long texts, the lm-eval
                     needle data
- `push_to_hub.py`   upload a saved checkpoint with a generated model card
- `export.py`        merge a LoRA adapter into its base, or repair a checkpoint's code files
- `demo.py`, `tour.py`  the `make demo` and `make tour` scripts

Library modules:
- `command_line.py`  what every command shares: unknown flags and bad input end it with one `error: ...` line
- `recipes.py`       command lines over YAML recipes
- `checkpoint_conversion.py`  a converted checkpoint written as a folder, softmax layers restored by rank
- `stages.py`        `distill` (stage 1) and `finetune` (stage 2), over their argument dataclasses
- `models.py`        the model a run trains: config, tokenizer, weights, LoRA, the distillation teacher
- `data.py`          datasets pipeline: load documents, tokenise (cached), pack rows with document boundaries
- `losses.py`        per-row losses over packed rows (cross-entropy, logit distillation) and their weighted mean
- `loop.py`          the accelerate training loop, with a pluggable loss and trainable-parameter selection
- `attention_transfer.py`  stage 1's loss: hooks on the linear layers comparing them with their softmax teacher
- `checkpoints.py`   atomic, resumable checkpoints and the final export
- `evaluation.py`    `evaluate_models`: the measurements behind `evaluate.py`, as rows
- `long_context_data.py`  held-out long texts (prepared from Debian packages), long documents, passkey prompts,
                     the lm-eval needle data
- `long_context_metrics.py`  perplexity by context, passkey accuracy, cache bytes by context, the sliding-window
                     baseline
- `measure.py`       cache bytes and decode latency after a context; cache memory of a layout
- `report.py`        tables (one cell format) written as Markdown, JSON and plots
- `model_card.py`    model cards rendered from `model_cards/model_card.md`, the runs' records and the config
- `hub.py`           `push_to_hub`: card, repository, one upload
- `adapters.py`      merging a LoRA adapter into its base, shard by shard
"""
