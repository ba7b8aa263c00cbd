"""What every command shares (the training scripts and the benchmarks): one exit style.

A command is `main(argv: list[str] | None = None) -> int` (argv: the command line's arguments when None), run by
`if __name__ == "__main__": raise SystemExit(main())`. Its dataclass arguments are parsed by `parse_dataclasses`,
which refuses an unknown flag as argparse does (usage, one line `error: ...` on stderr, exit status 2) where
`HfArgumentParser` alone raises. Bad input found later is raised as a ValueError or FileNotFoundError naming the
argument, and `exit_on_bad_input()` reports it the same way: one `error: ...` line, status 2, no traceback.
Importing this module needs nothing outside the standard library (yaml, for one, is not on the GPU check's machine).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import HfArgumentParser


def parse_dataclasses(parser: HfArgumentParser, argv: list[str] | None = None) -> tuple[Any, ...]:
    """One instance of each of `parser`'s dataclasses from `argv` (default: the command line); an argument no
    dataclass has ends the command as argparse ends a bad flag."""
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
    """Run a command's work; a ValueError or FileNotFoundError (the library's bad-input errors, which name
    the argument) becomes one `error: ...` line on stderr and exit status 2, as argparse reports a bad flag."""
    try:
        yield
    except (ValueError, FileNotFoundError) as error:
        message = str(error).strip()
        cause = str(error.__cause__ or "").strip()
        if cause and cause not in message:  # e.g. the server's reason behind a rejected upload
            message += f"\n  caused by {type(error.__cause__).__name__}: {cause}"
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
