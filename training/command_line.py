"""What every command shares (the training scripts and the benchmarks): one exit style.

A command is `main(argv: list[str] | None = None) -> int` (argv: the command line's arguments when None), run by
`if __name__ == "__main__": raise SystemExit(main())`. Bad input the user can fix is raised as a ValueError or
FileNotFoundError naming the argument, and `exit_on_bad_input()` reports it as argparse reports a bad flag: one line
`error: ...` on stderr and exit status 2, no traceback. Importing this module needs nothing outside the standard
library (the GPU check runs where only torch, triton and transformers are installed).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


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
