"""What every command shares (the training scripts and the benchmarks): one exit style.

A command is `main(argv: list[str] | None = None) -> int` (argv: the command line's arguments when None), run by
`if __name__ == "__main__": raise SystemExit(main())`. Its dataclass arguments are parsed by `parse_dataclasses`,
which refuses an unknown flag as argparse does (usage, one line `error: ...` on stderr, exit status 2) where
`HfArgumentParser` alone raises. Bad input found later is raised as `hf_linear_attn.InputError` (a ValueError; its
subclasses are a TypeError and a FileNotFoundError too) naming the argument, and `exit_on_bad_input()` reports it the
same way: one `error: ...` line, status 2, no traceback. Any other exception (a failure inside torch, datasets or
transformers in the middle of a run, a bug) goes through with its traceback.
A renamed argument stays accepted for one release: the argument dataclass carries `@renamed(old="new")`, and the old
name, on the command line (`parse_dataclasses`), as a recipe key (`training.recipes`) or as a keyword of the
dataclass, does what the new one does, with a FutureWarning naming the new name; old and new names given together are
refused before any work, naming both.
Importing this module needs nothing outside the standard library and this package (yaml, for one, is not on the GPU
check's machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from hf_linear_attn.configuration_linear_attention import InputError

if TYPE_CHECKING:
    from transformers import HfArgumentParser


@dataclasses.dataclass(frozen=True)
class Renamed:
    """The new name of a renamed argument, and how an old value becomes a new one (None: unchanged). `convert` takes
    the value as given (a string on the command line, the parsed value in a recipe or a keyword) and returns the new
    argument's value (a list for a list argument)."""

    new: str
    convert: Callable[[Any], Any] | None = None


def renamed(**renames: str | Renamed) -> Callable[[type], type]:
    """Class decorator of a command's argument dataclass: each `old="new"` (or `old=Renamed("new", convert)`) keeps
    the old name working for one release. The dataclass takes the old keyword too (`rename_arguments`); the command
    line (`parse_dataclasses`) and recipes (`training.recipes`) read the table from `renamed_arguments`."""
    table = {old: rename if isinstance(rename, Renamed) else Renamed(rename) for old, rename in renames.items()}

    def decorate(cls: type) -> type:
        fields = {field.name for field in dataclasses.fields(cls)}
        if unknown := sorted({rename.new for rename in table.values()} - fields) or sorted(table.keys() & fields):
            raise TypeError(f"{cls.__name__}: renames {unknown} must lead from a name it lacks to one of its fields")
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **rename_arguments(table, kwargs, stacklevel=3))

        cls.__init__ = __init__
        cls.__renamed_arguments__ = {**getattr(cls, "__renamed_arguments__", {}), **table}
        return cls

    return decorate


def renamed_arguments(*dataclass_types: type) -> dict[str, Renamed]:
    """Old name -> `Renamed` of every renamed argument of `dataclass_types` (`@renamed`)."""
    return {old: rename for cls in dataclass_types for old, rename in getattr(cls, "__renamed_arguments__", {}).items()}


def check_deprecated(old: str, new: str, with_new: bool, stacklevel: int) -> None:
    """Refuse `old` given with `new` (InputError), else warn that `old` is deprecated for `new` (FutureWarning)."""
    if with_new:
        raise InputError(f"{old} and {new} are the same argument ({old} is its deprecated name): give only {new}")
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", FutureWarning,
                  stacklevel=stacklevel)


def rename_arguments(renames: dict[str, Renamed], given: dict[str, Any], stacklevel: int = 2) -> dict[str, Any]:
    """`given` ({name: value}: keywords, a recipe's keys) with each old name of `renames` replaced by its new one and
    the value converted, each with a FutureWarning; InputError for an old name given with its new one."""
    given = dict(given)
    for old, rename in renames.items():
        if old in given:
            check_deprecated(old, rename.new, rename.new in given, stacklevel + 1)
            value = given.pop(old)
            given[rename.new] = value if rename.convert is None else rename.convert(value)
    return given


def rename_flags(renames: dict[str, Renamed], argv: list[str]) -> list[str]:
    """The command line `argv` with each old flag of `renames` (`--old VALUE ...` or `--old=VALUE`) replaced by its
    new one and its values converted, each with a FutureWarning; InputError for an old flag given with its new one."""
    flags = {token[2:].split("=", 1)[0] for token in argv if token.startswith("--")}
    out: list[str] = []
    i = 0
    while i < len(argv):
        name, equals, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        rename = renames.get(name)
        i += 1
        if rename is None:
            out.append(argv[i - 1])
            continue
        check_deprecated(f"--{name}", f"--{rename.new}", rename.new in flags, 3)
        if rename.convert is None:
            out.append(f"--{rename.new}" + equals + value)
            continue
        values = [value] if equals else []
        while not equals and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        converted = rename.convert(values[0] if len(values) == 1 else values)
        out += [f"--{rename.new}", *(map(str, converted) if isinstance(converted, list) else [str(converted)])]
    return out


def parse_dataclasses(parser: HfArgumentParser, argv: list[str] | None = None) -> tuple[Any, ...]:
    """One instance of each of `parser`'s dataclasses from `argv` (default: the command line); an argument no
    dataclass has ends the command as argparse ends a bad flag, and so does a renamed flag given with its new name
    (`renamed`; the old one alone is read as the new one, with a FutureWarning)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = rename_flags(renamed_arguments(*parser.dataclass_types), argv)
    except InputError as error:
        parser.error(str(error))
    *parsed, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return tuple(parsed)


def offline_by_default() -> None:
    """Run without the network unless the caller chose otherwise: HF_HUB_OFFLINE=1 when neither it nor
    TRANSFORMERS_OFFLINE is set. huggingface_hub reads the variable once, when it is imported, and a command has
    imported it (through transformers) before `main` runs, so its flag is set too; setting the variable alone left
    the demo asking the Hub for the base model's card (and retrying for half a minute without a network)."""
    if "HF_HUB_OFFLINE" in os.environ or "TRANSFORMERS_OFFLINE" in os.environ:
        return
    os.environ["HF_HUB_OFFLINE"] = "1"  # for child processes
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


@contextlib.contextmanager
def exit_on_bad_input() -> Iterator[None]:
    """Run a command's work; an `InputError` (the package's bad-input error, which names the argument) becomes one
    `error: ...` line on stderr and exit status 2, as argparse reports a bad flag. Nothing else is caught."""
    try:
        yield
    except InputError as error:
        message = str(error).strip()
        cause = str(error.__cause__ or "").strip()
        if cause and cause not in message:  # e.g. the server's reason behind a rejected upload
            message += f"\n  caused by {type(error.__cause__).__name__}: {cause}"
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
