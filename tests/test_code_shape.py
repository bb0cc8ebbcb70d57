"""The package's shape: no module over 500 lines, no import circle between its modules, and one loop over a
target's decoder layers (`targets.walk.walk`, which a pipeline stage walks through too).

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


# -- one layer walk ----------------------------------------------------------------------------------------------
# A per-layer loop is a loop over a decoder's layers (`.layers`, `.pipeline_layers`, or a name so called) whose
# body runs the layer: calls it, calls one of its submodules (`layer.mlp(h)`, not a method of nn.Module such as
# `layer.modules()`), or hands it to a function that does, a family hook (`family.call_layer`) included.
LAYER_LISTS = {"layers", "pipeline_layers"}
WALKED = ("targets", "distributed")
# Attribute names every nn.Module has; `layer.<one of these>(...)` asks the layer something, it does not run it.
MODULE_METHODS = {"modules", "children", "leaf_modules", "named_modules", "parameters", "trainable_parameters",
                  "items", "keys", "values", "get", "update", "freeze", "unfreeze", "apply", "apply_to_modules",
                  "set_dtype", "load_weights", "save_weights", "eval", "train", "update_modules"}


def _root(node: ast.expr):
    """(the name an attribute chain starts from, the first attribute after it) or (None, None)."""
    first = None
    while isinstance(node, ast.Attribute):
        first, node = node.attr, node.value
    return (node.id, first) if isinstance(node, ast.Name) else (None, None)


Runners = Dict[str, Set[str]]  # function or family hook -> the parameters it runs (by position "0" or by name)


def _runs(nodes, names: Set[str], runners: Runners, hooks: Runners) -> bool:
    """Whether any call under `nodes` runs a layer bound to one of `names`."""
    for node in (n for top in nodes for n in ast.walk(top)):
        if not isinstance(node, ast.Call):
            continue
        root, first = _root(node.func)
        if root in names and (first is None or first not in MODULE_METHODS):
            return True
        if isinstance(node.func, ast.Name):
            runs = runners.get(node.func.id, set())
        elif isinstance(node.func, ast.Attribute):  # a method, or a family hook
            runs = runners.get(node.func.attr, set()) | hooks.get(node.func.attr, set())
        else:
            runs = set()
        given = [(str(i), a) for i, a in enumerate(node.args)] + [(k.arg, k.value) for k in node.keywords]
        if any(where in runs and isinstance(a, ast.Name) and a.id in names for where, a in given):
            return True
    return False


def _runner(f: ast.FunctionDef, runners: Runners, hooks: Runners) -> Set[str]:
    """The parameters of `f` it runs, each by its position (a method's after `self`) and its name."""
    params = [a.arg for a in f.args.posonlyargs + f.args.args]
    params = params[1:] if params[:1] in (["self"], ["cls"]) else params
    run = {p for p in params + [a.arg for a in f.args.kwonlyargs] if _runs(f.body, {p}, runners, hooks)}
    return run | {str(i) for i, p in enumerate(params) if p in run}


def _layer_names(iterable: ast.expr, target: ast.expr) -> Set[str]:
    """The loop variables bound to a decoder layer in `for target in iterable` (through enumerate and zip)."""
    if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name) and isinstance(target, ast.Tuple):
        if iterable.func.id == "enumerate" and len(target.elts) == 2 and iterable.args:
            return _layer_names(iterable.args[0], target.elts[1])
        if iterable.func.id == "zip" and len(target.elts) == len(iterable.args):
            return set().union(*(_layer_names(a, t) for a, t in zip(iterable.args, target.elts)))
    while isinstance(iterable, ast.Subscript):  # a slice of the layers
        iterable = iterable.value
    named = iterable.attr if isinstance(iterable, ast.Attribute) else getattr(iterable, "id", None)
    return {target.id} if named in LAYER_LISTS and isinstance(target, ast.Name) else set()


def per_layer_loops(trees: Dict[str, ast.Module]) -> Set[str]:
    """'module:function' of every per-layer loop in `trees` (module name -> parsed text)."""
    functions = [f for tree in trees.values() for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)]
    runners: Runners = {}
    hooks: Runners = {}
    while True:  # functions that run a layer they are given, and the family hooks set to one, to a fixed point
        found: Runners = {}
        for f in functions:
            found.setdefault(f.name, set()).update(_runner(f, runners, hooks))
        found = {name: run for name, run in found.items() if run}
        # A family hook (`Family(call_layer=...)`, or a field's default) runs what the functions set to it run.
        set_to = [(k.arg, k.value) for tree in trees.values() for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Family" for k in node.keywords]
        set_to += [(node.target.id, node.value) for tree in trees.values() for node in ast.walk(tree)
                   if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None]
        found_hooks: Runners = {}
        for hook, value in set_to:
            if isinstance(value, ast.Name) and value.id in found:
                found_hooks.setdefault(hook, set()).update(found[value.id])
        if (found, found_hooks) == (runners, hooks):
            break
        runners, hooks = found, found_hooks
    loops = set()
    for name, tree in trees.items():
        for f in (f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)):
            for node in ast.walk(f):
                if isinstance(node, ast.For):
                    body = node.body
                    generators = [node]
                elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                    body = [node.elt] if not isinstance(node, ast.DictComp) else [node.key, node.value]
                    generators = node.generators
                else:
                    continue
                if any(_runs(body, _layer_names(g.iter, g.target), runners, hooks) for g in generators):
                    loops.add(f"{name}:{f.name}")
    return loops


def test_the_layer_walk_is_the_only_per_layer_loop():
    """`targets.walk.walk` is the one loop over a target's decoder layers (a pipeline stage walks through it too)."""
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, (path, _) in modules().items()
             if name.startswith(tuple(f"{PACKAGE}.{folder}." for folder in WALKED))}
    assert f"{PACKAGE}.distributed.pipeline" in trees and f"{PACKAGE}.targets.families" in trees
    assert per_layer_loops(trees) == {f"{PACKAGE}.targets.walk:walk"}


def test_a_second_per_layer_loop_is_found():
    """The check itself: a stage's own loop (through a family hook or a helper) is one; asking layers is not."""
    families = ast.parse(
        "def _call_layer(layer, h, mask, cache):\n    return layer(h, mask, cache)\n"
        "class Family:\n    call_layer: Callable = _call_layer\n"
    )
    own = ast.parse(
        "def forward(self, h, masks, cache):\n"
        "    for i, (layer, mask, c) in enumerate(zip(self.layers, masks, cache)):\n"
        "        h = self.family.call_layer(layer, h, mask, c)\n"
    )
    helper = ast.parse(
        "def _block(layer, h):\n    return h + layer.mlp(h)\n"
        "def forward(inner, h):\n    for layer in inner.pipeline_layers[1:]:\n        h = _block(layer, h)\n"
        "class Stage:\n    def _run(self, h, layer):\n        return layer(h)\n"
        "    def call(self, h):\n        for layer in self.layers:\n            h = self._run(h, layer=layer)\n"
        "    def misplaced(self, h):\n        for layer in self.layers:\n            h = self._run(layer, h)\n"
    )
    asking = ast.parse(
        "def masks(inner, h, cache):\n"
        "    for layer in inner.layers:\n        for m in layer.modules():\n            print(type(m))\n"
        "    for layer, c in zip(inner.layers, cache):\n        make_mask(h, c, layer.layer_type)\n"
        "    return [getattr(layer, 'use_sliding', False) for layer in inner.layers]\n"
    )
    assert per_layer_loops({"f": families, "own": own}) == {"own:forward"}
    assert per_layer_loops({"helper": helper}) == {"helper:forward", "helper:call"}
    assert per_layer_loops({"f": families, "asking": asking}) == set()
