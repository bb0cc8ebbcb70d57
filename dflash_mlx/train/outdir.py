"""Where a run may write: --out must be new, empty or a run of ours (`check_out`), an explicit --cache new, empty or
a feature cache (`check_cache_dir`); a run marks its --out (`claim_out`) before its first write there, so a later
run can tell it from a user's folder and never writes over a model or files it did not make."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import DFlashError
from .trainer import STATE_DIR


# What a training run of ours writes into --out. A folder holding anything else is not ours to write into.
RUN_MARKER = ".dflash-train-run.json"  # written before a run's first write into --out
RUN_FILES = ("config.json", "model.safetensors", "README.md", "tau_curve.png", "bench_figures.json")
MODEL_FILES = ("config.json", "model.safetensors")
CACHE_FILES = ("meta.json", "tokens.npy", "trainable.npy", "eval.json", "features.f16", "argmax.i32",
               "topk_ids.i32", "topk_logp.f16", "progress.json")  # features.py's layout
HARMLESS = (".DS_Store",)  # Finder's folder settings: not the user's data


def _is_state_dir(path: Path) -> bool:
    """A train_state/ as trainer.save writes it: latest.json and step-N folders (plus their temporaries)."""
    if not path.is_dir() or path.is_symlink():
        return False
    for p in path.iterdir():
        name = p.name.removesuffix(".tmp")
        if not (name == "latest.json" or name.lstrip(".").startswith("step-")):
            return False
    return True


def _is_cache_dir(path: Path) -> bool:
    """A folder holding only a feature cache's files (or nothing)."""
    return path.is_dir() and not path.is_symlink() and all(
        p.name.removesuffix(".tmp") in CACHE_FILES and p.is_file() for p in path.iterdir())


def check_out(out: Path) -> None:
    """--out must be new, empty, or a training run of ours: marked by RUN_MARKER, or (runs from before the marker)
    holding a train_state/. A run's folder may hold only what runs write (RUN_FILES, train_state/, features/);
    anything else, or a model no run of ours wrote (a target, a converted drafter), is refused untouched."""
    out = Path(out).expanduser()
    if not out.exists():
        return
    if not out.is_dir():
        raise DFlashError(f"--out '{out}' is a file; give a new or empty folder")
    names = sorted(p.name for p in out.iterdir() if p.name not in HARMLESS)
    ours = RUN_MARKER in names or (_is_state_dir(out / STATE_DIR) and (out / STATE_DIR / "latest.json").is_file())
    model = [n for n in names if n in MODEL_FILES or n.endswith(".safetensors")]
    if model and not ours:
        raise DFlashError(f"--out '{out}' holds a model ({', '.join(model)}) that no dflash-mlx train run wrote; "
                          "training would overwrite it: give a new or empty folder")

    def belongs(name: str) -> bool:
        path = out / name
        if name in (RUN_MARKER, RUN_MARKER + ".tmp") or name.removesuffix(".tmp") in RUN_FILES:
            return path.is_file()
        if name == STATE_DIR:
            return _is_state_dir(path)
        if _is_cache_dir(path):  # the default cache, or a --cache the user put inside a run of ours
            return ours or name == "features"
        return False

    foreign = [n for n in names if not belongs(n)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DFlashError(f"--out '{out}' holds files that are not part of a dflash-mlx train run ({shown}); "
                          "give a new or empty folder, or one a previous training run wrote")


def check_cache_dir(path: Path) -> None:
    """An explicit --cache must be new, empty, or a feature cache (features.py writes into it freely)."""
    path = Path(path).expanduser()
    if path.exists() and not _is_cache_dir(path):
        raise DFlashError(f"--cache '{path}' holds files that are not a feature cache; give a new or empty folder "
                          "or one a previous run built")


def claim_out(out: Path) -> None:
    """Mark --out as a run of ours before the first write into it, so later runs can tell it from a user's folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / RUN_MARKER
    if not marker.is_file():
        tmp = out / (RUN_MARKER + ".tmp")
        tmp.write_text(json.dumps({"written_by": "dflash-mlx train", "format": 1}) + "\n")
        os.replace(tmp, marker)


def inside(path: Path, root: Path) -> bool:
    """Whether `path` lies under `root` (both resolved: a link into a run counts as inside it)."""
    return Path(path).expanduser().resolve().is_relative_to(Path(root).expanduser().resolve())
