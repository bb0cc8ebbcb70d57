"""One exception type for every user-facing failure: its message is the single line the CLI prints."""


class DFlashError(Exception):
    """Bad input the user can fix: mismatched drafter and target, missing files, unsupported models, bad flags."""
