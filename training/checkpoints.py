"""Atomic, resumable training checkpoints (`OUTPUT_DIR/checkpoint-STEP`) and the final model export.

A checkpoint is written by `accelerator.save_state` (model, optimizer, LR scheduler and every other
object registered for checkpointing, the RNG states of every process) into a hidden temporary folder
`OUTPUT_DIR/.tmp-checkpoint-STEP`, followed by `trainer_state.json` (step, tokens seen, the batch
geometry) as its last file. The main process then fsyncs every file and the folder and renames it to
`checkpoint-STEP`: the rename is the commit. A run killed at any moment leaves either the previous
checkpoints or the new complete one; a checkpoint folder without `trainer_state.json` (not written by
this module) is never chosen by `--resume_from_checkpoint latest`. After each save only the newest
`save_total_limit` checkpoints are kept, and leftovers of interrupted saves are removed.

In a multi-node run `OUTPUT_DIR` must be a filesystem shared by all nodes (every rank writes its RNG
state into the checkpoint).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

CHECKPOINT_PREFIX = "checkpoint-"
TEMPORARY_PREFIX = ".tmp-checkpoint-"
REPLACED_PREFIX = ".old-checkpoint-"
STATE_FILE = "trainer_state.json"
_CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(root: Path) -> None:
    """Flush every file and folder below `root` (and `root` itself) to disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def is_complete(checkpoint: Path) -> bool:
    """True for a folder written in full by `save_checkpoint` (its trainer state is the last file)."""
    try:
        read_trainer_state(checkpoint)
    except (OSError, ValueError):
        return False
    return True


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """The complete `checkpoint-STEP` folders of `output_dir`, oldest step first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        match = _CHECKPOINT_NAME.match(path.name)
        if match and path.is_dir() and is_complete(path):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resolve_resume_checkpoint(output_dir: str | Path, value: str) -> Path:
    """The checkpoint folder that `--resume_from_checkpoint VALUE` names: `latest` (the newest complete
    checkpoint in `output_dir`) or a folder. Raises if there is no complete checkpoint to resume."""
    if value == "latest":
        found = complete_checkpoints(Path(output_dir))
        if not found:
            raise FileNotFoundError(
                f"--resume_from_checkpoint latest: no complete checkpoint ({CHECKPOINT_PREFIX}STEP with "
                f"{STATE_FILE}) in {output_dir}."
            )
        return found[-1]
    path = Path(value)
    if not path.is_dir():
        raise FileNotFoundError(f"--resume_from_checkpoint {value}: no such folder.")
    if not is_complete(path):
        raise ValueError(
            f"--resume_from_checkpoint {value} is not a complete checkpoint (no readable {STATE_FILE}); it may "
            "be the remains of an interrupted save."
        )
    return path


def _remove_stale(output_dir: Path, keep_last: int | None) -> None:
    """Drop leftovers of interrupted saves and all but the newest `keep_last` complete checkpoints."""
    for path in output_dir.iterdir():
        if path.name.startswith((TEMPORARY_PREFIX, REPLACED_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)
    if keep_last:
        for path in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(path)


def save_checkpoint(
    accelerator: Accelerator, output_dir: str | Path, state: dict[str, Any], keep_last: int | None = None
) -> Path:
    """Atomically write `OUTPUT_DIR/checkpoint-{state['global_step']}` (see the module docstring).

    Every process must call this (the state of each is saved). Returns the checkpoint folder.
    """
    output_dir = Path(output_dir)
    final = output_dir / f"{CHECKPOINT_PREFIX}{state['global_step']}"
    temporary = output_dir / f"{TEMPORARY_PREFIX}{state['global_step']}"
    replaced = output_dir / f"{REPLACED_PREFIX}{state['global_step']}"
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
        shutil.rmtree(replaced, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(temporary))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (temporary / STATE_FILE).write_text(json.dumps(state, indent=2))
        _fsync_tree(temporary)
        if final.exists():  # the same step saved again (a resumed run re-doing steps): swap it out
            os.replace(final, replaced)
        os.replace(temporary, final)
        _fsync(output_dir)
        _remove_stale(output_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, checkpoint: str | Path) -> dict[str, Any]:
    """Restore everything `save_checkpoint` saved into the prepared objects; returns the trainer state."""
    accelerator.load_state(str(checkpoint))
    return read_trainer_state(Path(checkpoint))


def export_model(
    accelerator: Accelerator,
    model: Any,
    output_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    merge_lora: bool = True,
) -> None:
    """Write the trained model as an ordinary Hugging Face checkpoint into `output_dir`.

    A PEFT model is merged into its base weights (`merge_lora`) and saved as a full
    `LinearAttentionForCausalLM` (safetensors + remote code), or saved as a PEFT adapter. Under FSDP or
    DeepSpeed ZeRO-3 the full state dict is gathered first, so every process must call this.
    """
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    if merge_lora and hasattr(unwrapped, "merge_and_unload"):
        if accelerator.is_main_process:
            unwrapped.merge_and_unload().save_pretrained(output_dir)
    else:
        state_dict = accelerator.get_state_dict(model)
        unwrapped.save_pretrained(
            output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
            state_dict=state_dict,
        )
    if tokenizer is not None and accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()
