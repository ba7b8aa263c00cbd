"""The output folder of a training run: atomic, verified, resumable checkpoints (`OUTPUT_DIR/checkpoint-STEP`),
the run's log, and the final model export.

A checkpoint is written by `accelerator.save_state` (model and optimizer, sharded under FSDP / DeepSpeed),
plus this module's JSON files: the LR scheduler (`scheduler.json`) and every random generator of each
process (`rng_state_RANK.json`: Python, NumPy, torch CPU and each accelerator device; the only RNG state a
checkpoint keeps: `save_state` always pickles the same states into `random_states_RANK.pkl`, with no option to
skip it, and that file is deleted before the commit, so `load_state` finds none and leaves the generators to the
JSON), then
`trainer_state.json` (step, tokens seen, the batch geometry, and the name and size of every file of the
checkpoint) as its last file, all into a hidden temporary folder `OUTPUT_DIR/.tmp-checkpoint-STEP`. The
main process then fsyncs every file and the folder and renames it to `checkpoint-STEP`: the rename is the
commit. A run killed at any moment leaves either the previous checkpoints or the new complete one. After
each save only the newest `save_total_limit` checkpoints are kept, and leftovers of interrupted saves are
removed.

Resuming verifies the checkpoint against its file list once, when `resolve_resume_checkpoint` names it (before
any model is loaded; `load_checkpoint` then takes the folder it returned): a missing, truncated or unlisted file
is named, and `--resume_from_checkpoint latest` falls back, with a warning, to the newest checkpoint that
verifies. Nothing loaded can run code: this module's state
is JSON, accelerate reads its tensors with safetensors or `torch.load(weights_only=True)`, and before
anything is loaded every pickle in the checkpoint is checked to reference only the plain data types those
loaders accept (`check_pickles`), so a crafted file is refused with an error rather than executed.

`check_output_dir` and `PreviousRun` guard an earlier run in the output folder: without
`--overwrite_output_dir` (or resuming) it is refused; with it, its checkpoints and log are moved aside just
before training starts and deleted only once the new run has committed its first checkpoint or finished
(restored if it fails before that).

In a multi-node run `OUTPUT_DIR` must be a filesystem shared by all nodes (every rank writes its RNG
state into the checkpoint). A run resumed on more processes than saved it (FSDP's sharded checkpoints reshard)
gives each process without an RNG state of its own rank 0's.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import json
import os
import pickle
import random
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import RNG_STATE_NAME
from transformers import PreTrainedTokenizerBase

from hf_linear_attn.configuration_linear_attention import InputError, InputNotFoundError

CHECKPOINT_PREFIX = "checkpoint-"
TEMPORARY_PREFIX = ".tmp-checkpoint-"
REPLACED_PREFIX = ".old-checkpoint-"
PREVIOUS_RUN_PREFIX = ".previous-run-"
STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.json"
RNG_FILE = "rng_state_{}.json"
LOG_FILE = "log.jsonl"
# What an earlier run leaves in its output folder (besides checkpoints), and what marks a finished one.
RUN_FILES = (LOG_FILE, "runs")
FINISHED_RUN_FILES = ("training_summary.json", "config.json", "adapter_config.json")
_CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")
logger = get_logger(__name__)


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def is_complete(checkpoint: Path) -> bool:
    """True for a folder whose trainer state (the last file `save_checkpoint` writes) is readable."""
    try:
        read_trainer_state(checkpoint)
    except (OSError, ValueError):
        return False
    return True


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed (a missing, truncated or unlisted file, named), or None."""
    checkpoint = Path(checkpoint)
    try:
        state = read_trainer_state(checkpoint)
    except (OSError, ValueError):
        return f"{STATE_FILE} is missing or unreadable (an interrupted save)"
    listed = state.get("files")
    present = {str(path.relative_to(checkpoint)): path.stat().st_size
               for path in checkpoint.rglob("*") if path.is_file() and path.name != STATE_FILE}
    if listed is None:  # written before checkpoints listed their files
        legacy = sorted(name for name in present if re.fullmatch(r"custom_checkpoint_\d+\.pkl", name))
        if legacy:
            return (f"it holds {legacy}, the LR scheduler as a pickle, which could run code when loaded; this "
                    "version keeps it as JSON and does not load such checkpoints (start the run over)")
        return None
    for name, size in sorted(listed.items()):
        if name not in present:
            return f"{name} is missing"
        if present[name] != size:
            return f"{name} is truncated or altered ({present[name]:,} bytes, {size:,} written)"
    unlisted = sorted(set(present) - set(listed))
    if unlisted:
        return f"it holds files its save did not write: {unlisted}"
    return None


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """The `checkpoint-STEP` folders of `output_dir` with a readable trainer state, oldest step first."""
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
    """The checkpoint folder that `--resume_from_checkpoint VALUE` names: `latest` (the newest checkpoint in
    `output_dir` that verifies, with a warning for each newer one that does not) or a folder. Raises, naming
    the file at fault, if there is nothing to resume."""
    if value == "latest":
        skipped = []
        for checkpoint in reversed(complete_checkpoints(Path(output_dir))):
            problem = checkpoint_problem(checkpoint)
            if problem is None:
                for name, reason in skipped:
                    logger.warning(f"--resume_from_checkpoint latest: skipping {name}: {reason}; resuming from "
                                   f"{checkpoint.name}.", main_process_only=True)
                return checkpoint
            skipped.append((checkpoint.name, problem))
        reasons = "".join(f"; {name}: {reason}" for name, reason in skipped)
        raise InputNotFoundError(
            f"--resume_from_checkpoint latest: no complete checkpoint ({CHECKPOINT_PREFIX}STEP with "
            f"{STATE_FILE}) in {output_dir}{reasons}."
        )
    path = Path(value)
    if not path.is_dir():
        raise InputNotFoundError(f"--resume_from_checkpoint {value}: no such folder.")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise InputError(f"--resume_from_checkpoint {value} is not a complete checkpoint: {problem}.")
    return path


# Pickles ---------------------------------------------------------------------------------------------------------

# What the pickles of a checkpoint may reference: tensors and their storages, plain containers, NumPy arrays
# (accelerate's RNG states, in checkpoints written before they were deleted at save), in
# torch.distributed.checkpoint's `.metadata`, paths and its own dataclasses and enums, and in DeepSpeed's states
# three records of its own (a dataclass, an enum, and a class without __setstate__ whose fields are set as data)
# and, under ZeRO-3, tensors carrying attributes (`_rebuild_from_type_v2` calls the rebuild function and sets the
# attributes on the type the pickle names: both are globals of the pickle, checked here in turn).
_SAFE_GLOBALS = {
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"), ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("_codecs", "encode"), ("numpy", "ndarray"),
    ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}
_SAFE_CLASS_MODULES = ("torch.distributed.checkpoint.", "numpy.dtypes")


def _is_safe_global(module: str, name: str) -> bool:
    if (module, name) in _SAFE_GLOBALS or (module == "torch" and name.endswith("Storage")):
        return True
    if not module.startswith(("torch", "numpy")):
        return False
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    if isinstance(found, torch.dtype):
        return True
    # Plain records: dataclasses and enums of torch.distributed.checkpoint, NumPy's dtype classes.
    return (isinstance(found, type) and module.startswith(_SAFE_CLASS_MODULES)
            and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum) or module == "numpy.dtypes"))


class _Placeholder:
    """Stands in for every global a checked pickle references: the check runs nothing of the pickle."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


class _CheckingUnpickler(pickle.Unpickler):
    """Walks a pickle, refusing every global outside `_SAFE_GLOBALS`; builds placeholders, runs nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if not _is_safe_global(module, name):
            raise pickle.UnpicklingError(f"it references {module}.{name}, which is not plain data")
        return _Placeholder

    def persistent_load(self, pid: Any) -> None:
        return None


def _pickle_streams(path: Path) -> list[bytes]:
    """The pickles inside `path`: a torch.save zip archive's `data.pkl`, or the file itself."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            return [archive.read(name) for name in archive.namelist() if name.endswith("data.pkl")]
    data = path.read_bytes()
    return [data] if data[:1] == b"\x80" else []  # a pickle starts with PROTO


def check_pickles(checkpoint: Path) -> None:
    """Raise ValueError naming the file if a pickle of `checkpoint` references anything but plain data
    (`_SAFE_GLOBALS`): such a file could run code when loaded. Reads only the pickles, never tensor data."""
    for path in sorted(Path(checkpoint).rglob("*")):
        if not path.is_file() or path.suffix in (".safetensors", ".json"):
            continue
        for stream in _pickle_streams(path):
            try:
                _CheckingUnpickler(io.BytesIO(stream)).load()
            except Exception as error:
                raise InputError(f"Refusing to resume from {checkpoint}: {path.relative_to(checkpoint)} is not a "
                                 f"plain-data pickle ({error}); loading it could run code.") from None


# Random generators and the LR scheduler, as JSON -----------------------------------------------------------------


def _device_rng_modules() -> dict[str, Any]:
    """The accelerator device kinds present, each with `get_rng_state` / `set_rng_state` per device index."""
    found = {}
    for name in ("cuda", "xpu", "mps"):
        module = getattr(torch, name, None)
        if module is not None and module.is_available():
            found[name] = module
    return found


def rng_state() -> dict[str, Any]:
    """Every random generator a training process uses (Python, NumPy, torch CPU, each accelerator device), as
    JSON-ready values."""
    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss], "numpy": [kind, keys.tolist(), position, has_gauss, cached],
             "torch": torch.get_rng_state().tolist(), "devices": {}}
    for name, module in _device_rng_modules().items():
        count = module.device_count() if hasattr(module, "device_count") else 1
        state["devices"][name] = [(module.get_rng_state(i) if name != "mps" else module.get_rng_state()).tolist()
                                  for i in range(count)]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned; raises (KeyError / ValueError / TypeError) on a damaged state."""
    version, internal, gauss = state["python"]
    kind, keys, position, has_gauss, cached = state["numpy"]
    python_state = (version, tuple(internal), gauss)
    numpy_state = (kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached)
    torch_state = torch.tensor(state["torch"], dtype=torch.uint8)
    devices = _device_rng_modules()
    for name in state["devices"]:
        if name not in devices:
            raise InputError(f"the run used {name} devices, which this machine lacks")
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    for name, states in state["devices"].items():
        module = devices[name]
        for index, device_state in enumerate(states):
            tensor = torch.tensor(device_state, dtype=torch.uint8)
            module.set_rng_state(tensor) if name == "mps" else module.set_rng_state(tensor, index)


# Saving and loading ----------------------------------------------------------------------------------------------


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


def _remove_stale(output_dir: Path, keep_last: int | None) -> None:
    """Drop leftovers of interrupted saves and all but the newest `keep_last` complete checkpoints."""
    for path in output_dir.iterdir():
        if path.name.startswith((TEMPORARY_PREFIX, REPLACED_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)
    if keep_last:
        for path in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(path)


def save_checkpoint(
    accelerator: Accelerator, output_dir: str | Path, state: dict[str, Any], scheduler: Any = None,
    keep_last: int | None = None,
) -> Path:
    """Atomically write `OUTPUT_DIR/checkpoint-{state['global_step']}` with the prepared objects, `scheduler`
    (its `state_dict` must be JSON data) and the RNG states (see the module docstring).

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
    (temporary / f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl").unlink(missing_ok=True)  # the JSON's twin
    (temporary / RNG_FILE.format(accelerator.process_index)).write_text(json.dumps(rng_state()))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if scheduler is not None:
            (temporary / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict()))
        files = {str(path.relative_to(temporary)): path.stat().st_size
                 for path in sorted(temporary.rglob("*")) if path.is_file()}
        (temporary / STATE_FILE).write_text(json.dumps({**state, "files": files}, indent=2))
        _fsync_tree(temporary)
        if final.exists():  # the same step saved again (a resumed run re-doing steps): swap it out
            os.replace(final, replaced)
        os.replace(temporary, final)
        _fsync(output_dir)
        _remove_stale(output_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, checkpoint: str | Path, scheduler: Any = None) -> dict[str, Any]:
    """Restore everything `save_checkpoint` saved into the prepared objects, `scheduler` and the RNG states of
    this process; returns the trainer state. `checkpoint` is what `resolve_resume_checkpoint` returned (verified
    against its file list). Raises ValueError naming the file for a checkpoint that holds a pickle that could
    run code, before anything is loaded, or whose state is damaged."""
    checkpoint = Path(checkpoint)
    check_pickles(checkpoint)
    try:
        accelerator.load_state(str(checkpoint))
    except Exception as error:
        raise InputError(f"Cannot resume from {checkpoint}: {type(error).__name__}: {error}") from error
    state = read_trainer_state(checkpoint)
    # Every process starts from the same seed: on more processes than the run saved, a process without a state of
    # its own continues rank 0's (exact without dropout; with it, the random draws differ from the saved run's).
    saved_processes = state.get("geometry", {}).get("num_processes", accelerator.num_processes)
    rank = accelerator.process_index if accelerator.process_index < saved_processes else 0
    if saved_processes != accelerator.num_processes:
        logger.warning(f"Resuming on {accelerator.num_processes} processes a run saved by {saved_processes}: the "
                       "weights and data order continue exactly, the random draws (dropout) do not.",
                       main_process_only=True)
    for name, restore in ((SCHEDULER_FILE, scheduler.load_state_dict if scheduler is not None else None),
                          (RNG_FILE.format(rank), set_rng_state)):
        if restore is None or (name == SCHEDULER_FILE and "files" not in state):
            continue
        try:
            restore(json.loads((checkpoint / name).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise InputError(f"Cannot resume from {checkpoint}: {name} is missing or damaged ({error}); the "
                             "resumed run would not continue the interrupted one exactly.") from None
    return state


# The output folder -------------------------------------------------------------------------------------------


def earlier_run(output_dir: str | Path) -> list[str]:
    """What an earlier run left in `output_dir` (checkpoints, log, a finished model), by name."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    return sorted(path.name for path in output_dir.iterdir()
                  if path.name.startswith(CHECKPOINT_PREFIX) or path.name in (*RUN_FILES, *FINISHED_RUN_FILES))


def check_output_dir(output_dir: str | Path, overwrite: bool, resume: str | None) -> str | None:
    """Check a run's output folder before anything is loaded; returns the resolved checkpoint to resume (or
    None). An earlier run there is refused unless the run resumes it or `overwrite` replaces it."""
    if resume:
        return str(resolve_resume_checkpoint(output_dir, resume))
    found = earlier_run(output_dir)
    if found and not overwrite:
        what = ("checkpoints of an earlier run" if any(n.startswith(CHECKPOINT_PREFIX) for n in found)
                else "a finished run")
        raise InputError(f"{output_dir} already holds {what} ({', '.join(found[:6])}): continue it with "
                         "--resume_from_checkpoint latest, or replace it with --overwrite_output_dir.")
    return None


class PreviousRun:
    """An earlier run's checkpoints and log, moved aside (`OUTPUT_DIR/.previous-run-*`) on the main process
    when a new run replaces it (`move`; without it nothing happens): `discard()` deletes them (once the new
    run has a checkpoint or has finished), `restore()` puts them back (the new run failed before that). The
    finished model files are not moved: the new run's export replaces them."""

    def __init__(self, accelerator: Accelerator, output_dir: str | Path, move: bool = True) -> None:
        self.output_dir, self.aside = Path(output_dir), None
        if move and accelerator.is_main_process and earlier_run(self.output_dir):
            self.aside = Path(tempfile.mkdtemp(prefix=PREVIOUS_RUN_PREFIX, dir=self.output_dir))
            for path in self.output_dir.iterdir():
                prefixes = (CHECKPOINT_PREFIX, TEMPORARY_PREFIX, REPLACED_PREFIX)
                if path.name.startswith(prefixes) or path.name in RUN_FILES:
                    path.rename(self.aside / path.name)
        accelerator.wait_for_everyone()

    def discard(self) -> None:
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)
            self.aside = None

    def restore(self) -> None:
        if self.aside is not None:
            for path in self.aside.iterdir():
                target = self.output_dir / path.name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
                path.rename(target)
            self.aside.rmdir()
            self.aside = None


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
