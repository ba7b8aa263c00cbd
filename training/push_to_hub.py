"""Upload a saved linear-attention checkpoint to the Hub with a generated model card.

    python training/push_to_hub.py CHECKPOINT REPO_ID [--private] [--license apache-2.0]

CHECKPOINT is a folder written by `training/finetune.py` (or any `save_pretrained` of a
`LinearAttentionForCausalLM`): weights (safetensors), the code files `auto_map` points to, tokenizer
and `training_summary.json`. The model card is rendered into `CHECKPOINT/README.md`
(`training/model_card.py`) and, once the Hub has validated its metadata, everything but training
leftovers (intermediate checkpoints, tensorboard runs, the metrics log) is uploaded in one commit.
The Hub address and token come from the usual `HF_ENDPOINT` / `HF_TOKEN` (or `hf auth login`).
"""

# ruff: noqa: E402 - the imports follow the sys.path set-up for running as a script
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `training` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from huggingface_hub import HfApi

from training.model_card import write_model_card

# Training leftovers in an output folder that do not belong in a model repository.
IGNORE_PATTERNS = ["checkpoint-*", ".tmp-checkpoint-*", ".old-checkpoint-*", "runs/*", "log.jsonl"]


@dataclass
class HubArguments:
    """Publishing options of `training/finetune.py` (names as in transformers' TrainingArguments)."""

    push_to_hub: bool = field(default=False, metadata={"help": "Upload the final model with its model card."})
    hub_model_id: str | None = field(default=None, metadata={"help": "Repository id, e.g. `user/my-model`."})
    hub_private_repo: bool = field(default=False, metadata={"help": "Create the repository as private."})
    license: str | None = field(
        default=None, metadata={"help": "Licence id for the card; default: the base model's licence."}
    )


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    license: str | None = None,
    commit_message: str = "Upload linear-attention model",
) -> str:
    """Render the model card, create the repository if needed and upload `folder` in one commit.

    `upload_folder` has the Hub validate the card's metadata before any file is sent (an invalid card
    raises ValueError and uploads nothing). Returns the URL of the commit."""
    folder = Path(folder)
    write_model_card(folder, repo_id=repo_id, license=license)
    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message=commit_message,
                               ignore_patterns=IGNORE_PATTERNS)
    return commit.commit_url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="The saved model folder.")
    parser.add_argument("repo_id", help="Repository id, e.g. user/my-model.")
    parser.add_argument("--private", action="store_true", help="Create the repository as private.")
    parser.add_argument("--license", default=None, help="Licence id; default: the recorded or base model's one.")
    parser.add_argument("--commit_message", default="Upload linear-attention model")
    args = parser.parse_args(argv)
    url = push_to_hub(args.checkpoint, args.repo_id, private=args.private, license=args.license,
                      commit_message=args.commit_message)
    print(f"Pushed {args.checkpoint} to {args.repo_id}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
