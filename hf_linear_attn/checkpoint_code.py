"""The code a saved checkpoint carries: this package's configuration and modeling files and every module they import,
copied beside the weights by `save_pretrained` and named by config.json's `auto_map`, so that
`from_pretrained(..., trust_remote_code=True)` loads the checkpoint where the package is not installed.

`checkpoint_code_problems` says what in a folder breaks that (an `auto_map` naming other code, code files that are not
this package's, a missing one): an older version saved a model wrapped by FSDP2 as torch's FSDP class, with torch's
source files as the model's code. `repair_checkpoint_code` rewrites the folder's config.json and code files only (the
weights are not touched): `hf-linear-attn-export --model_name_or_path DIR --output_dir DIR` runs it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_import_files

from .configuration_linear_attention import AUTO_MAP, LinearAttentionConfig, foreign_auto_map

PACKAGE_DIR = Path(__file__).resolve().parent
ENTRY_FILES = ("configuration_linear_attention.py", "modeling_linear_attention.py")


def code_files() -> dict[str, Path]:
    """File name -> source path of every module a checkpoint carries (the entry files and their relative imports)."""
    files = {}
    for entry in ENTRY_FILES:
        for path in (PACKAGE_DIR / entry, *map(Path, get_relative_import_files(str(PACKAGE_DIR / entry)))):
            files[path.name] = path
    return files


def is_project_checkpoint(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a config.json of this package's model type."""
    config = Path(folder) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == LinearAttentionConfig.model_type


def checkpoint_code_problems(folder: str | os.PathLike) -> list[str]:
    """What keeps the checkpoint in `folder` (a config of this package's model type) from loading with
    trust_remote_code=True where the package is not installed, one sentence each; empty when nothing does."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    problems = []
    if foreign := foreign_auto_map(config.get("auto_map")):
        problems.append(f"config.json's auto_map names code that is not hf-linear-attn's: {foreign}")
    if missing := [key for key in AUTO_MAP if key not in (config.get("auto_map") or {})]:
        problems.append(f"config.json's auto_map has no entry for {missing}")
    present = {path.name for path in folder.glob("*.py")}
    expected = code_files()
    if foreign_files := sorted(present - expected.keys()):
        problems.append(f"code files that are not hf-linear-attn's: {foreign_files}")
    if missing_files := sorted(expected.keys() - present):
        problems.append(f"hf-linear-attn code files missing: {missing_files}")
    return problems


def _write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as stream:
        stream.write(text)
    os.replace(stream.name, path)


def repair_checkpoint_code(folder: str | os.PathLike) -> list[str]:
    """Make `folder`'s remote code this package's: config.json's `auto_map` set to the package's classes, every code
    file rewritten from this version, any other `.py` file removed. The weights, tokenizer and every other file stay
    as they are. Returns what was changed, one line each (empty for a folder that needed nothing)."""
    folder = Path(folder)
    if not is_project_checkpoint(folder):
        raise ValueError(f"{folder} holds no config.json of model_type {LinearAttentionConfig.model_type!r}: not a "
                         "hf-linear-attn checkpoint.")
    problems = checkpoint_code_problems(folder)
    if not problems:
        return []
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = dict(AUTO_MAP)
    _write_atomically(folder / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    expected = code_files()
    for path in folder.glob("*.py"):
        if path.name not in expected:
            path.unlink()
    for name, source in expected.items():
        _write_atomically(folder / name, source.read_text())
    return problems
