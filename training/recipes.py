"""Command-line parsing shared by the training scripts: dataclass fields over an optional YAML recipe.

`parse_recipe_args((DataclassA, DataclassB), argv)` reads `--config FILE.yaml` (or `default_recipe`)
for defaults and lets every flag on the command line override them, via `transformers.HfArgumentParser`;
it returns one instance per dataclass. A recipe key that no dataclass has is an error naming the
allowed keys; a renamed one (`training.command_line.renamed`) is read as its new name, with a FutureWarning.
`recipe_dict(parsed)` flattens the parsed instances back into one dict, as run.

The attention options of a script's command line are the fields of `hf_linear_attn`'s `AttentionOptions`
(type, help and allowed values), with the script's own defaults: `attention_arguments(name, **defaults)`
makes that dataclass for the script's arguments to subclass, and `attention_options(args)` reads them back
as the keyword arguments of `convert_to_linear_attention`.

`--config` takes a YAML file or the name of a recipe shipped with the package (`configs/` of the repository, installed
as `hf_linear_attn.configs`: `--config gpu/llama-3.2-1b-recover`), so an installed command runs one without a
checkout.

Errors: a recipe that does not parse exits as a bad flag does (argparse's `error: ...`, status 2); the scripts
report the library's bad-input errors the same way (`training.command_line`).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from hf_linear_attn.configuration_linear_attention import ATTENTION_OPTIONS, AttentionOptions, InputError
from hf_linear_attn.training.command_line import parse_dataclasses, rename_arguments, renamed_arguments

SHIPPED_RECIPES = Path(str(importlib.resources.files("hf_linear_attn.configs")))
NOT_RECIPES = ("accelerate", "lm_eval", "models")  # shipped configs of other tools, not recipes of a command


def shipped_recipe_names() -> list[str]:
    """The names `--config` accepts for the shipped recipes (paths under `configs/` without `.yaml`)."""
    return sorted(str(path.relative_to(SHIPPED_RECIPES).with_suffix("")) for path in SHIPPED_RECIPES.rglob("*.yaml")
                  if path.relative_to(SHIPPED_RECIPES).parts[0] not in NOT_RECIPES)


def recipe_file(value: str) -> Path | None:
    """`value` as a file, else as the name of a shipped recipe (with or without `.yaml`); None when it is neither."""
    if Path(value).is_file():
        return Path(value)
    name = value.removesuffix(".yaml")
    return SHIPPED_RECIPES / f"{name}.yaml" if name in shipped_recipe_names() else None


def shipped_file(value: Any) -> Any:
    """A shipped recipe names the files it ships with as `configs/...` (the repository's path); they are read from
    the installed package, wherever the command runs."""
    if isinstance(value, str) and value.startswith("configs/"):
        shipped = SHIPPED_RECIPES / value.removeprefix("configs/")
        return str(shipped) if shipped.is_file() else value
    return value


def parse_recipe_args(dataclass_types: type | tuple[type, ...], argv: list[str] | None = None,
                      default_recipe: Path | None = None) -> Any:
    """One parsed instance of `dataclass_types` (or a tuple of them, when a tuple is given), from `argv`
    (default: the command line)."""
    types = dataclass_types if isinstance(dataclass_types, tuple) else (dataclass_types,)
    parser = HfArgumentParser(types)
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_path = default_recipe
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
            if value is None:
                parser.error("--config needs a YAML file or a shipped recipe's name")
            recipe_path = recipe_file(value)
            if recipe_path is None:
                parser.error(f"--config {value}: no such file, nor a shipped recipe; shipped: "
                             f"{', '.join(shipped_recipe_names())}")
            del argv[i : i + (1 if "=" in arg else 2)]
            break
    if recipe_path is not None:
        recipe = yaml.safe_load(recipe_path.read_text()) or {}
        if recipe_path.resolve().is_relative_to(SHIPPED_RECIPES.resolve()):
            recipe = {key: shipped_file(value) for key, value in recipe.items()}
        try:  # a renamed key is read as its new name, with a FutureWarning
            recipe = rename_arguments(renamed_arguments(*types), recipe, stacklevel=3)
        except InputError as error:
            parser.error(f"{recipe_path}: {error}")
        known = {name for t in types for name in t.__dataclass_fields__}
        unknown = sorted(set(recipe) - known)
        if unknown:
            parser.error(f"{recipe_path}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        parser.set_defaults(**recipe)
    parsed = parse_dataclasses(parser, argv)
    return parsed if isinstance(dataclass_types, tuple) else parsed[0]


def recipe_dict(args: tuple[Any, ...]) -> dict[str, Any]:
    """All fields of the parsed argument dataclasses, as a run used them (for logs and model cards)."""
    return {key: value for values in args for key, value in dataclasses.asdict(values).items()}


def attention_arguments(name: str, **defaults: Any) -> type:
    """A dataclass named `name` with the fields of `AttentionOptions` (types, help, choices) and `defaults` for
    some of them, for a script's argument dataclass to subclass. The defaults are checked here."""
    AttentionOptions(**defaults)
    types = typing.get_type_hints(AttentionOptions)
    specs = []
    for option in dataclasses.fields(AttentionOptions):
        default = defaults.get(option.name, dataclasses.MISSING)
        if default is dataclasses.MISSING:  # the declared default (or its factory)
            spec = dataclasses.field(default=option.default, default_factory=option.default_factory,
                                     metadata=option.metadata)
        elif isinstance(default, list):
            spec = dataclasses.field(default_factory=lambda default=default: list(default), metadata=option.metadata)
        else:
            spec = dataclasses.field(default=default, metadata=option.metadata)
        specs.append((option.name, types[option.name], spec))
    return dataclasses.make_dataclass(name, specs)


def attention_options(args: Any) -> dict[str, Any]:
    """The attention options of parsed arguments (a subclass of an `attention_arguments` dataclass)."""
    return {name: getattr(args, name) for name in ATTENTION_OPTIONS}
