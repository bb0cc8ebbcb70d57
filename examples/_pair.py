"""Shared by the examples: the target/drafter to use (argv, or a tiny offline demo pair built on the fly)."""

import sys
import tempfile


def model_and_drafter():
    """`python example.py TARGET [DRAFTER]`; with no arguments, a tiny random pair (runs offline, text is gibberish)."""
    if len(sys.argv) > 1:
        return sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    from dflash_mlx.demo import make_tiny_pair

    target, drafter = make_tiny_pair(tempfile.mkdtemp(prefix="dflash-example-"))
    return str(target), str(drafter)
