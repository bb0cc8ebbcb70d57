"""One exception type for every user-facing failure: its message is the single line the CLI prints."""

import sys
from typing import Callable


class DFlashError(Exception):
    """Bad input the user can fix: mismatched drafter and target, missing files, unsupported models, bad flags."""


def exit_code(run: Callable[[], int]) -> int:
    """A command's exit code: what `run` returns, or 2 after its `DFlashError` is printed as one line."""
    try:
        return run()
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
