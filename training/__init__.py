"""Training scripts and their building blocks (run them from the repository root).

- `finetune.py`      the `accelerate launch` fine-tuning CLI (recipes in `configs/*.yaml`)
- `push_to_hub.py`   upload a saved checkpoint with a generated model card
- `data.py`          datasets pipeline: load documents, tokenise (cached), pack rows with document boundaries
- `loop.py`          the accelerate training loop, with a pluggable loss and trainable-parameter selection
- `checkpoints.py`   atomic, resumable checkpoints and the final export
- `model_card.py`    model-card rendering from `model_cards/`
- `demo.py`          the `make demo` script
"""
