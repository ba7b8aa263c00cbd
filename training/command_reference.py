"""The reference of docs/reference.md, rendered from the code it documents so that it cannot drift from it.

Every command's flags come from the parser the command itself builds: its `main` runs until it parses its arguments,
where the parser is taken and the command stopped (`command_parser`), so a flag added, renamed or given an alias
shows up here without anyone copying it. The configuration's fields come from `LinearAttentionConfig`'s docstring,
its `__init__` signature and `AttentionOptions` (type, default, choices and help of each attention option).

    python -m hf_linear_attn.training.command_reference --output docs/reference.md   (what `make docs` runs)
    python -m hf_linear_attn.training.command_reference --check docs/reference.md    (status 1 when it differs)

The commands documented: the installed `hf-linear-attn-*` console scripts (this package's entry points), and, from
a checkout's root, the demo and tour scripts and the benchmarks (`python -m benchmarks.NAME`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import inspect
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from transformers import HfArgumentParser

from hf_linear_attn.configuration_linear_attention import AttentionOptions, LinearAttentionConfig
from hf_linear_attn.training.command_line import exit_on_bad_input, renamed_arguments

ROOT = Path(__file__).resolve().parents[1]  # the checkout (training/ is its top-level folder)
ENTRY_POINT_PREFIX = "hf_linear_attn.training."
CHECKOUT_SCRIPTS = ("training/demo.py", "training/tour.py")  # commands that stay in the checkout (make demo / tour)
BENCHMARKS = "benchmarks"
# The commands that parse `--config RECIPE` themselves, before their parser sees the rest, import this function.
RECIPE_PARSER = "parse_recipe_args"
# A command that starts one job calls this first thing (training.host_memory): a reference needs only its parser.
HOST_MEMORY_SETUP = "keep_freed_memory"
# How a flag's value is shown, by its parser's type (HfArgumentParser parses a bool with `string_to_bool`).
VALUE_NAMES = {"int": "INT", "float": "FLOAT", "Path": "PATH", "string_to_bool": "BOOL"}


@dataclass(frozen=True)
class Command:
    """One way to run a command: how it is invoked, the module whose `main` runs, and its sub-command (if any)."""

    invocation: str
    module: str
    subcommand: str | None = None


class _ParserTaken(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser taken")
        self.parser = parser


@contextlib.contextmanager
def _stop_at_parsing() -> Iterator[None]:
    """Within it, the first parse of arguments raises `_ParserTaken` with the parser instead of parsing."""
    original = argparse.ArgumentParser.parse_known_args

    def take(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _ParserTaken(self)

    argparse.ArgumentParser.parse_known_args = take
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original


def command_parser(command: Command) -> argparse.ArgumentParser:
    """The parser `command`'s `main` builds, taken when it parses (nothing after that runs)."""
    module = importlib.import_module(command.module)
    setup = getattr(module, HOST_MEMORY_SETUP, None)
    if setup is not None:  # a one-job process's malloc setting, not for the process that renders
        setattr(module, HOST_MEMORY_SETUP, lambda: None)
    try:
        with _stop_at_parsing():
            module.main([command.subcommand] if command.subcommand else [])
    except _ParserTaken as taken:
        return taken.parser
    finally:
        if setup is not None:
            setattr(module, HOST_MEMORY_SETUP, setup)
    raise RuntimeError(f"{command.invocation}: its main returned without parsing any argument")


def _subcommands(module: ModuleType) -> tuple[str, ...]:
    return tuple(getattr(module, "COMMANDS", ()))


def _with_subcommands(invocation: str, module_name: str) -> list[Command]:
    subcommands = _subcommands(importlib.import_module(module_name))
    if not subcommands:
        return [Command(invocation, module_name)]
    return [Command(f"{invocation} {name}", module_name, name) for name in subcommands]


def installed_commands() -> list[Command]:
    """The package's console scripts, by name."""
    points = sorted((point for point in importlib.metadata.entry_points(group="console_scripts")
                     if point.value.startswith(ENTRY_POINT_PREFIX)), key=lambda point: point.name)
    if not points:
        raise RuntimeError("no console script of hf-linear-attn is installed: pip install -e . first")
    return [command for point in points for command in _with_subcommands(point.name, point.value.split(":")[0])]


def checkout_commands() -> list[Command]:
    """The demo and tour scripts and the benchmarks, which run from a checkout's root."""
    if not (ROOT / BENCHMARKS / "__init__.py").is_file():
        raise RuntimeError(f"{ROOT} is not a checkout of hf-linear-attn (no {BENCHMARKS}/): the reference documents "
                           "the checkout's scripts too, so render it from one")
    commands = [Command(f"python {path}", ENTRY_POINT_PREFIX + Path(path).stem) for path in CHECKOUT_SCRIPTS]
    for path in sorted((ROOT / BENCHMARKS).glob("*.py")):
        name = f"{BENCHMARKS}.{path.stem}"
        if hasattr(importlib.import_module(name), "main"):
            commands += _with_subcommands(f"python -m {name}", name)
    return commands


def all_commands() -> list[Command]:
    return installed_commands() + checkout_commands()


def takes_recipe(command: Command) -> bool:
    """Whether the command reads `--config RECIPE` (a YAML file or a shipped recipe's name) before its flags."""
    return hasattr(importlib.import_module(command.module), RECIPE_PARSER)


def deprecated_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """`--old`: `--new` for every renamed flag a command still accepts (with a FutureWarning; `renamed`)."""
    if not isinstance(parser, HfArgumentParser):
        return {}
    return {f"--{old}": f"--{rename.new}" for old, rename in renamed_arguments(*parser.dataclass_types).items()}


def command_flags(command: Command) -> set[str]:
    """Every `--flag` the command accepts (aliases and deprecated names included)."""
    parser = command_parser(command)
    flags = {option for action in parser._actions for option in action.option_strings if option.startswith("--")}
    return flags | set(deprecated_flags(parser)) | ({"--config"} if takes_recipe(command) else set())


# ---------------------------------------------------------------------------------------------------- rendering


def _cell(text: Any) -> str:
    """One Markdown table cell: one line, pipes escaped, paths inside the checkout written relative to it."""
    value = str(text).replace(str(ROOT) + "/", "")
    return " ".join(value.split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.default is None or action.default is argparse.SUPPRESS or action.required:
        return ""
    if isinstance(action.default, (list, tuple)):
        return " ".join(_cell(value) for value in action.default) if action.default else "(none)"
    if isinstance(action.default, Path):
        return _cell(action.default)
    return _cell(action.default)


def _value(action: argparse.Action) -> str:
    """What a flag takes: nothing (a switch), a choice, or a kind of value; `...` for one or more."""
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        shown = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        shown = VALUE_NAMES.get(getattr(action.type, "__name__", ""), "TEXT")
    if action.nargs in ("+", "*"):
        return shown + " ..."
    return f"[{shown}]" if action.nargs == "?" else shown


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if text is argparse.SUPPRESS:
        return ""
    if "%(" in text:
        text = text % {**vars(action), "prog": ""}
    return _cell(text)


def _shown_options(action: argparse.Action) -> list[str]:
    """A flag's names as the reference lists them: HfArgumentParser's `--a-b` twin of each `--a_b` left out (the
    command's heading says that every flag takes either spelling)."""
    options = action.option_strings
    return [option for option in options if not ("-" in option[2:] and option.replace("-", "_")[2:] in
                                                 {other[2:] for other in options if other != option})]


def render_command(command: Command) -> str:
    parser = command_parser(command)
    description = inspect.cleandoc(parser.description or "").split("\n\n")[0]
    lines = [f"### `{command.invocation}`", ""]
    if description:
        lines += [" ".join(description.split()), ""]
    if isinstance(parser, HfArgumentParser):  # it gives every `--a_b` a `--a-b` twin
        lines += ["Every flag below also takes `-` for `_` (`--output-dir` for `--output_dir`).", ""]
    positionals = [action for action in parser._actions if not action.option_strings]
    options = [action for action in parser._actions
               if action.option_strings and not isinstance(action, argparse._HelpAction)]
    if positionals:
        lines += ["| argument | value | help |", "|---|---|---|"]
        lines += [f"| `{action.dest}` | {_value(action) or 'TEXT'} | {_help(action)} |" for action in positionals]
        lines.append("")
    rows = []
    if takes_recipe(command):
        rows.append("| `--config` | FILE or NAME | | A YAML recipe, or a shipped recipe's name (its path under "
                    "`configs/` without `.yaml`), whose keys set the defaults of the flags below; flags given on the "
                    "command line override it. |")
    named = {}
    for action in options:
        shown = _shown_options(action)
        flags = ", ".join(f"`{option}`" for option in shown)
        value = _value(action) + (" (required)" if action.required else "")
        first = named.setdefault(action.dest, shown[0])
        help_text = _help(action) if first == shown[0] else f"Sets `{first}` to false."
        rows.append(f"| {flags} | {value} | {_default(action) if first == shown[0] else ''} | {help_text} |")
    if rows:
        lines += ["| flag | value | default | help |", "|---|---|---|---|", *rows, ""]
    deprecated = deprecated_flags(parser)
    if deprecated:
        lines += ["Deprecated names, still read (with a warning) as the new ones: "
                  + ", ".join(f"`{old}` (`{new}`)" for old, new in sorted(deprecated.items())) + ".", ""]
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def render_configuration() -> str:
    doc = inspect.cleandoc(LinearAttentionConfig.__doc__ or "")
    first, _, rest = doc.partition("\n\n")
    signature = inspect.signature(LinearAttentionConfig.__init__)
    decoder = [parameter for name, parameter in signature.parameters.items()
               if name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD]
    types = typing.get_type_hints(AttentionOptions)
    lines = ["## `LinearAttentionConfig`", "", " ".join(first.replace("[`", "`").replace("`]", "`").split()), "",
             "### Decoder and conversion fields", "",
             "| field | default |", "|---|---|"]
    lines += [f"| `{parameter.name}` | `{parameter.default!r}` |" for parameter in decoder]
    lines += ["", "### Attention options (`AttentionOptions`)", "",
              "Keyword arguments of the config, of `convert_to_linear_attention` and flags of every training "
              "command that builds a model.", "",
              "| option | type | default | allowed | help |", "|---|---|---|---|---|"]
    for option in dataclasses.fields(AttentionOptions):
        default = option.default if option.default is not dataclasses.MISSING else option.default_factory()
        choices = option.metadata.get("choices")
        allowed = ", ".join(f"`{choice}`" for choice in choices) if choices else ""
        lines.append(f"| `{option.name}` | `{_cell(_type_name(types[option.name]))}` | `{default!r}` | {allowed} | "
                     f"{_cell(option.metadata.get('help', ''))} |")
    lines += ["", "### The docstring", "", "```text", rest.rstrip(), "```", ""]
    return "\n".join(lines)


def render() -> str:
    installed, checkout = installed_commands(), checkout_commands()
    parts = ["# Reference", "",
             "<!-- Generated by `make docs` (python -m hf_linear_attn.training.command_reference) from the code; "
             "do not edit: tests/test_docs.py fails when this file differs from what the code renders. -->", "",
             "- [`LinearAttentionConfig`](#linearattentionconfig): every field of a model's configuration",
             "- [Installed commands](#installed-commands): the `hf-linear-attn-*` console scripts",
             "- [Checkout commands](#checkout-commands): the demo, the tour and the benchmarks, run from a "
             "checkout's root", "",
             render_configuration(),
             "## Installed commands", "",
             "Each also runs as `python -m hf_linear_attn.training.NAME` (and under `accelerate launch`). Bad input "
             "ends a command with one `error: ...` line on stderr and exit status 2.", ""]
    parts += [render_command(command) for command in installed]
    parts += ["## Checkout commands", ""]
    parts += [render_command(command) for command in checkout]
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--output", type=Path, help="Write the reference to this file.")
    target.add_argument("--check", type=Path, help="Compare this file with the reference; status 1 if it differs.")
    args = parser.parse_args(argv)
    with exit_on_bad_input():
        text = render()
        if args.output is not None:
            args.output.write_text(text)
            print(f"wrote {args.output}")
            return 0
        if not args.check.is_file():
            raise FileNotFoundError(f"--check {args.check}: no such file (make docs writes it)")
        if args.check.read_text() != text:
            print(f"{args.check} differs from the code's reference: run `make docs`", file=sys.stderr)
            return 1
        print(f"{args.check} is the code's reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
