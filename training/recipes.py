"""Command-line parsing shared by the training scripts: dataclass fields over an optional YAML recipe.

`parse_recipe_args(Dataclass, argv)` reads `--config FILE.yaml` (or `default_recipe`) for defaults
and lets every flag on the command line override them, via `transformers.HfArgumentParser`. A
recipe key that is not a field of the dataclass is an error naming the allowed keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from transformers import HfArgumentParser

T = TypeVar("T")


def parse_recipe_args(dataclass_type: type[T], argv: list[str], default_recipe: Path | None = None) -> T:
    parser = HfArgumentParser(dataclass_type)
    recipe_path = default_recipe
    if "--config" in argv:
        at = argv.index("--config")
        if at + 1 >= len(argv):
            parser.error("--config needs a YAML file")
        recipe_path, argv = Path(argv[at + 1]), argv[:at] + argv[at + 2:]
    if recipe_path is not None:
        if not recipe_path.is_file():
            parser.error(f"--config {recipe_path}: no such file")
        recipe = yaml.safe_load(recipe_path.read_text()) or {}
        known = set(dataclass_type.__dataclass_fields__)
        unknown = sorted(set(recipe) - known)
        if unknown:
            parser.error(f"{recipe_path}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        parser.set_defaults(**recipe)
    (args,) = parser.parse_args_into_dataclasses(argv)
    return args
