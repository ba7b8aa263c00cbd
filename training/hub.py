"""Publishing a saved linear-attention checkpoint on the Hub with its generated model card.

`push_to_hub(folder, repo_id)` renders the model card (`training.model_card`), has the Hub validate its
metadata (licence id, tags, model-index) before the repository is created, then writes it as
`folder/README.md` and uploads everything but training leftovers (intermediate checkpoints, tensorboard
runs, the metrics log) in one commit. A failed push leaves the folder's previous README.md as it was.
`training/finetune.py --push_to_hub` and `training/push_to_hub.py` call it. The Hub address and token come
from the usual `HF_ENDPOINT` / `HF_TOKEN` (or `hf auth login`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import HfApi

from hf_linear_attn.checkpoint_code import checkpoint_code_problems
from hf_linear_attn.configuration_linear_attention import REPAIR_COMMAND, InputError
from hf_linear_attn.training.checkpoints import (
    CHECKPOINT_PREFIX,
    LOG_FILE,
    PREVIOUS_RUN_PREFIX,
    REPLACED_PREFIX,
    TEMPORARY_PREFIX,
)
from hf_linear_attn.training.model_card import render_model_card

# Training leftovers in an output folder that do not belong in a model repository.
IGNORE_PATTERNS = [f"{CHECKPOINT_PREFIX}*", f"{TEMPORARY_PREFIX}*", f"{REPLACED_PREFIX}*", f"{PREVIOUS_RUN_PREFIX}*",
                   "runs/*", LOG_FILE]


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
    """Render the model card, have the Hub validate it, create the repository if needed and upload `folder`
    with the card as README.md in one commit. Returns the URL of the commit.

    An invalid card (e.g. a licence id the Hub does not know) raises ValueError before the repository is
    created; if the upload fails, `folder/README.md` is restored to what it was."""
    folder = Path(folder)
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise InputError(f"{folder} holds a LoRA adapter, not a model: merge it into its base first "
                         f"(hf-linear-attn-export --model_name_or_path {folder} --output_dir MERGED_DIR), then push "
                         "MERGED_DIR.")
    card = render_model_card(folder, repo_id=repo_id, license=license)
    if problems := checkpoint_code_problems(folder):
        raise InputError(f"{folder} would not load from the Hub with trust_remote_code=True: "
                         + "; ".join(problems) + ". Repair it first (config.json and code files only): "
                         + REPAIR_COMMAND.format(folder=folder))
    try:
        card.validate(repo_type="model")
    except ValueError as error:
        raise InputError(f"The Hub refuses the model card's metadata (--license {card.data.license!r}?): "
                         f"{error}") from None
    readme = folder / "README.md"
    previous = readme.read_bytes() if readme.is_file() else None
    card.save(readme)
    try:
        api = HfApi()
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message=commit_message,
                                   ignore_patterns=IGNORE_PATTERNS)
    except BaseException:
        if previous is None:
            readme.unlink(missing_ok=True)
        else:
            readme.write_bytes(previous)
        raise
    return commit.commit_url
