"""Publishing a saved linear-attention checkpoint on the Hub with its generated model card.

`push_to_hub(folder, repo_id)` renders the model card into `folder/README.md` (`training.model_card`)
and, once the Hub has validated its metadata, uploads everything but training leftovers (intermediate
checkpoints, tensorboard runs, the metrics log) in one commit. `training/finetune.py --push_to_hub`
and `training/push_to_hub.py` call it. The Hub address and token come from the usual `HF_ENDPOINT` /
`HF_TOKEN` (or `hf auth login`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import HfApi

from training.checkpoints import CHECKPOINT_PREFIX, REPLACED_PREFIX, TEMPORARY_PREFIX
from training.loop import LOG_FILE
from training.model_card import write_model_card

# Training leftovers in an output folder that do not belong in a model repository.
IGNORE_PATTERNS = [f"{CHECKPOINT_PREFIX}*", f"{TEMPORARY_PREFIX}*", f"{REPLACED_PREFIX}*", "runs/*", LOG_FILE]


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
