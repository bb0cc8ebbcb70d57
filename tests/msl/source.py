"""Kernel text for the MSL emulator: the signature MLX generates, the lint, and the rewrites g++ needs.

`signature` reproduces mx.fast.metal_kernel's generated source (mlx/backend/common/metal_kernel.cpp): template
parameters, `const device T*` inputs (`constant` below 8 elements, a reference for 0-d ones), `{name}_shape`,
`{name}_strides` and `{name}_ndim` only for names the body mentions, `device T*` outputs (`device atomic<T>*` with
atomic_outputs), then the thread attributes the body mentions. `lint` rejects what Metal forbids but g++ would
accept. `for_gcc` strips comments (keeping line numbers) and turns `threadgroup` declarations into
per-threadgroup storage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .dtypes import type_string

# Inputs with fewer elements are passed in the constant address space (MLX's max_constant_array_size).
MAX_CONSTANT_ARRAY_SIZE = 8

# MLX's metal_attributes table, in its order: (attribute, type).
ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]


class LintError(ValueError):
    """Kernel text that g++ would compile but Metal rejects."""


@dataclass(frozen=True)
class Param:
    """One kernel parameter in signature order: its C type as the emulator's entry point passes it."""

    name: str
    ctype: str  # element type, e.g. "float", "atomic<float>", "int64_t"
    by_ref: bool  # a 0-d input or `_ndim`: passed as `const T&`
    is_output: bool
    role: str = "data"  # "data", or what of input `source` it carries: "_shape", "_strides", "_ndim"
    source: int = -1  # index of the input (or output) it belongs to


def strip_comments(text: str) -> str:
    """Blank out // and /* */ comments, keeping every newline (so line numbers hold)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i: j + 1])  # strings stay (#include "x.h"); skipping them keeps "//" inside intact
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


_FUNC_DEF = re.compile(r"\b([A-Za-z_]\w*)\s*\(((?:[^;{}()]|\([^()]*\))*)\)\s*(?:const\s*)?\{")
_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "decltype", "static_assert"}


def _body_end(text: str, open_brace: int) -> int:
    depth = 0
    for k in range(open_brace, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(text)


def _recursion(text: str) -> list[str]:
    """A cycle in the call graph of the functions `text` defines (e.g. ["f", "g", "f"]), or []."""
    calls: dict[str, set[str]] = {}
    bodies = []
    for m in _FUNC_DEF.finditer(text):
        if m.group(1) not in _KEYWORDS:
            bodies.append((m.group(1), text[m.end(): _body_end(text, m.end() - 1)]))
    names = {f for f, _ in bodies}
    for func, body in bodies:
        called = {c for c in re.findall(r"(?<![\w.:>])([A-Za-z_]\w*)\s*\(", body) if c in names}
        calls.setdefault(func, set()).update(called)

    def walk(func: str, path: list[str]) -> list[str]:
        if func in path:
            return path[path.index(func):] + [func]
        for callee in sorted(calls.get(func, ())):
            found = walk(callee, path + [func])
            if found:
                return found
        return []

    for func in sorted(calls):
        found = walk(func, [])
        if found:
            return found
    return []


def lint(name: str, source: str, header: str) -> None:
    """Raise LintError for what Metal forbids but g++ compiles: `std::`, `double`, `new`/`delete`, `virtual`,
    exceptions, C library calls, or header functions that call themselves, directly or through each other."""
    problems = []
    for where, text in (("source", source), ("header", header)):
        clean = strip_comments(text)
        for pattern, why in (
            (r"\bstd\s*::", "`std::` (Metal has no C++ standard library; use metal::)"),
            (r"\bdouble\b", "`double` (Metal has no 64-bit floats)"),
            (r"\bnew\b", "`new` (Metal has no dynamic allocation)"),
            (r"\bdelete\b", "`delete` (Metal has no dynamic allocation)"),
            (r"\bvirtual\b", "`virtual` (Metal has no virtual functions)"),
            (r"\b(?:throw|try|catch)\b", "exceptions (Metal has none)"),
            (r"\b(?:printf|malloc|calloc|free|memcpy|memset|memmove|strlen)\s*\(",
             "a C library call (Metal has no C library)"),
        ):
            m = re.search(pattern, clean)
            if m:
                line = clean.count("\n", 0, m.start()) + 1
                problems.append(f"{where} line {line}: {why}")
    cycle = _recursion(strip_comments(header))
    if cycle:
        problems.append(f"header: {' -> '.join(f'`{f}`' for f in cycle)} (Metal forbids recursion)")
    if problems:
        raise LintError(f"kernel {name!r} is not valid Metal: " + "; ".join(problems))


_TG_DECL = re.compile(
    r"\bthreadgroup\s+(?P<type>[A-Za-z_][\w:]*(?:\s*<[^;{}]*?>)?)\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"(?P<dims>(?:\[[^\]]+\]\s*)*);"
)


# A `threadgroup` declaration the rewrite did not take (several names, an initializer): not a pointer or reference.
_TG_OTHER_DECL = re.compile(r"\bthreadgroup\s+[A-Za-z_][\w:]*(?:\s*<[^;{}]*?>)?\s+[A-Za-z_]\w*\s*[\[;,=]")
_HALF_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH](?!\w)")


def _half_literal(m: re.Match) -> str:
    number = m.group(1)
    if not any(c in number for c in ".eE"):
        number += ".0"
    return f"(half({number}f))"


def for_gcc(text: str, first_site: int = 0) -> tuple[str, int]:
    """Comment-free text with each `threadgroup T name[dims];` turned into a reference to storage shared by the
    threadgroup, every other `threadgroup` qualifier dropped, and half literals (`1.5h`) spelled for g++. Returns
    the text and the next free site id."""
    site = first_site

    def declaration(m: re.Match) -> str:
        nonlocal site
        site += 1
        dims = re.sub(r"\s+", "", m.group("dims"))
        return f"auto& {m.group('name')} = *msl_rt::tg_alloc<{m.group('type')}{dims}>({site});"

    text = _HALF_LITERAL.sub(_half_literal, _TG_DECL.sub(declaration, strip_comments(text)))
    left = _TG_OTHER_DECL.search(text)
    if left:  # dropping `threadgroup` here would silently make the array private to each thread
        line = text.count("\n", 0, left.start()) + 1
        raise LintError(f"line {line}: unsupported threadgroup declaration {left.group(0).strip()!r}: declare one "
                        f"threadgroup variable per statement, without an initializer")
    return re.sub(r"\bthreadgroup\b(?!_)", "", text), site


def template_text(template: list) -> tuple[str, str]:
    """`(parameter list, argument list)` for the kernel's template, as MLX writes them (bool as 0/1)."""
    params, args = [], []
    for tname, value in template:
        if isinstance(value, bool):
            params.append(f"bool {tname}")
            args.append(str(int(value)))
        elif isinstance(value, int):
            params.append(f"int {tname}")
            args.append(str(value))
        else:
            params.append(f"typename {tname}")
            args.append(type_string(value))
    return ", ".join(params), ", ".join(args)


def kernel_name(name: str, template_args: str, inputs: list, output_dtypes: list) -> str:
    """MLX's host name: custom_kernel_{name}, then `_` and its template hash (`<float, 4>` -> `_float_4`), then
    each input's dtype (suffix `s` for 0-d, `c` for constant-space inputs) and each output's dtype."""
    out = "custom_kernel_" + name
    if template_args:
        out += "_" + ("<" + template_args + ">").replace("<", "_").replace(">", "_").replace(", ", "_")[:-1]
    for x in inputs:
        out += "_" + type_string(x.dtype)
        out += "s" if x.ndim == 0 else ("c" if x.size < MAX_CONSTANT_ARRAY_SIZE else "")
    for d in output_dtypes:
        out += "_" + type_string(d)
    return out


def instantiation(func: str, template_args: str) -> str:
    """The explicit instantiation MLX appends for a templated kernel (Metal syntax; not compiled by g++)."""
    if not template_args:
        return ""
    full = f"{func}<{template_args}>"
    return f'\ntemplate [[host_name("{func}")]] [[kernel]] decltype({full}) {full};\n'


def signature(func: str, source: str, input_names: list, inputs: list, output_names: list, output_dtypes: list,
              template_params: str, atomic_outputs: bool) -> tuple[str, list[Param]]:
    """The text MLX puts between the header and the body, and the parameters in order."""
    lines, params = [], []
    index = 0
    for i, (name, x) in enumerate(zip(input_names, inputs)):
        dtype = type_string(x.dtype)
        location = "constant" if x.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if x.ndim == 0 else "*"
        lines.append(f"  const {location} {dtype}{ref} {name} [[buffer({index})]]")
        params.append(Param(name, dtype, x.ndim == 0, False, "data", i))
        index += 1
        if x.ndim > 0:
            for suffix, decl, ctype, by_ref in (
                ("_shape", "const constant int*", "int", False),
                ("_strides", "const constant int64_t*", "int64_t", False),
                ("_ndim", "const constant int&", "int", True),
            ):
                if name + suffix in source:
                    lines.append(f"  {decl} {name}{suffix} [[buffer({index})]]")
                    params.append(Param(name + suffix, ctype, by_ref, False, suffix, i))
                    index += 1
    for i, (name, d) in enumerate(zip(output_names, output_dtypes)):
        ctype = f"atomic<{type_string(d)}>" if atomic_outputs else type_string(d)
        lines.append(f"  device {ctype}* {name} [[buffer({index})]]")
        params.append(Param(name, ctype, False, True, "data", i))
        index += 1
    for attr, atype in ATTRIBUTES:
        if attr in source:
            lines.append(f"  {atype} {attr} [[{attr}]]")
    head = f"template <{template_params}>\n" if template_params else ""
    return head + f"[[kernel]] void {func}(\n" + ",\n".join(lines) + ") {\n", params


def used_attributes(source: str) -> list[str]:
    return [attr for attr, _ in ATTRIBUTES if attr in source]
