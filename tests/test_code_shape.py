"""The package's shape: no module over 500 lines, and no import circle between its modules.

Modules are read as text (nothing is imported). Every import counts, a function's deferred one included: a circle
through a deferred import still ties two modules into one. Each module's imports of the package are resolved as
Python resolves them (relative levels, `from package import submodule`, the package folders `pyproject.toml` maps
elsewhere: `dflash_mlx.metal` is metal/, `dflash_mlx.convert` is convert/).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dflash_mlx"
MAX_LINES = 500

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def modules() -> Dict[str, Tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's __init__), for every folder the package is built from."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = config["tool"]["setuptools"].get("package-dir", {PACKAGE: PACKAGE})
    found: Dict[str, Tuple[Path, bool]] = {}
    for package, folder in folders.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = [package] + list(path.relative_to(base).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_init else parts)
            found[name] = (path, is_init)
    return found


def imports(name: str, path: Path, is_init: bool, known: Dict[str, Tuple[Path, bool]]) -> Set[str]:
    """The package modules `name` imports, anywhere in its text."""
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_init else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from package import name`: the submodule when there is one, else the package itself
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name and target.split(".")[0] == PACKAGE:
                out.add(target)
    return out


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The groups of modules that import each other round a circle (strongly connected, more than one)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    groups: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return groups


def test_no_module_is_over_500_lines():
    long = {name: n for name, (path, _) in modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


def test_no_import_circles_between_modules():
    known = modules()
    assert f"{PACKAGE}.decode.step" in known and f"{PACKAGE}.metal.block_attention" in known
    graph = {name: imports(name, path, is_init, known) for name, (path, is_init) in known.items()}
    assert f"{PACKAGE}.metal.block_attention" in graph[f"{PACKAGE}.drafters.dflash"]  # the mapped folders resolve
    found = circles(graph)
    detail = "; ".join(" -> ".join(g) + f" ({', '.join(sorted(graph[g[0]] & set(g)))} from {g[0]})" for g in found)
    assert not found, f"import circles: {detail}"


def test_a_circle_is_found(tmp_path):
    """The check itself: a deferred import back is a circle; a chain is not."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    known = {"dflash_mlx.p": (None, True), "dflash_mlx.p.x": (None, False), "dflash_mlx.p.y": (None, False)}
    x = tmp_path / "x.py"
    x.write_text("from . import y\n\n\ndef f():\n    from ..p import z\n")
    assert imports("dflash_mlx.p.x", x, False, known) == {"dflash_mlx.p.y", "dflash_mlx.p"}
