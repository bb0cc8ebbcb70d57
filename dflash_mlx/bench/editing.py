"""The "editing" prompt set: code-editing requests whose answers repeat most of their input.

Twenty small Python functions written for this benchmark (not taken from HumanEval, MBPP, the standard library or
any other training source of the shipped drafter), each with an instruction that makes the answer rewrite the
whole function with a small change: type hints, a docstring, a rename, a guard clause. They measure what drafting
from the context (`lookup.py`) gains where answers copy; HumanEval measures what it costs where they do not.
"""

from __future__ import annotations

from typing import List

_FUNCTIONS = [
    ("Add type hints to every parameter and to the return value", '''
def merge_intervals(spans):
    ordered = sorted(spans, key=lambda s: s[0])
    merged = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            last_start, last_end = merged[-1]
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged
'''),
    ("Rename the parameter `rows` to `records` everywhere", '''
def group_totals(rows, key_field, value_field):
    totals = {}
    for row in rows:
        key = row.get(key_field)
        if key is None:
            continue
        amount = float(row.get(value_field, 0) or 0)
        totals[key] = totals.get(key, 0.0) + amount
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    return [{"key": k, "total": round(v, 2)} for k, v in ranked]
'''),
    ("Add a docstring that explains the arguments and the return value", '''
def parse_duration(text):
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    total, number = 0, ""
    for char in text.strip().lower():
        if char.isdigit():
            number += char
        elif char in units and number:
            total += int(number) * units[char]
            number = ""
        elif not char.isspace():
            raise ValueError(f"unexpected character {char!r} in {text!r}")
    if number:
        total += int(number)
    return total
'''),
    ("Add type hints to every parameter and to the return value", '''
def chunk_text(text, width, overlap=0):
    if width <= overlap:
        raise ValueError("width must be larger than overlap")
    pieces = []
    start = 0
    while start < len(text):
        piece = text[start:start + width]
        pieces.append(piece)
        if start + width >= len(text):
            break
        start += width - overlap
    return pieces
'''),
    ("Replace the string concatenations with f-strings", '''
def describe_order(order):
    lines = ["Order " + str(order["id"]) + " for " + order["customer"]]
    for item in order["items"]:
        lines.append("  " + item["name"] + " x" + str(item["qty"]) + " at " + str(item["price"]))
    subtotal = sum(item["qty"] * item["price"] for item in order["items"])
    lines.append("Subtotal: " + str(round(subtotal, 2)))
    if order.get("discount"):
        lines.append("Discount: " + str(order["discount"]) + "%")
        subtotal = subtotal * (100 - order["discount"]) / 100
    lines.append("Total: " + str(round(subtotal, 2)))
    return "\\n".join(lines)
'''),
    ("Add a guard at the top that raises ValueError when `grid` is empty", '''
def count_islands(grid):
    height, width = len(grid), len(grid[0])
    seen = set()
    islands = 0
    for y in range(height):
        for x in range(width):
            if grid[y][x] != 1 or (y, x) in seen:
                continue
            islands += 1
            stack = [(y, x)]
            while stack:
                cy, cx = stack.pop()
                if (cy, cx) in seen:
                    continue
                seen.add((cy, cx))
                for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                    if 0 <= ny < height and 0 <= nx < width and grid[ny][nx] == 1:
                        stack.append((ny, nx))
    return islands
'''),
    ("Add type hints to every parameter and to the return value", '''
def rolling_average(values, window):
    if window < 1:
        raise ValueError("window must be at least 1")
    averages = []
    running = 0.0
    for index, value in enumerate(values):
        running += value
        if index >= window:
            running -= values[index - window]
        count = min(index + 1, window)
        averages.append(running / count)
    return averages
'''),
    ("Rename the function to `normalize_headers` and the variable `out` to `normalized`", '''
def clean_headers(raw):
    out = {}
    for name, value in raw.items():
        key = "-".join(part.capitalize() for part in name.strip().replace("_", "-").split("-"))
        if isinstance(value, (list, tuple)):
            value = ", ".join(str(v).strip() for v in value)
        else:
            value = str(value).strip()
        if key in out:
            out[key] = out[key] + ", " + value
        else:
            out[key] = value
    return out
'''),
    ("Add a docstring that explains the arguments and the return value", '''
def schedule_tasks(tasks, workers):
    loads = [0.0] * workers
    plan = [[] for _ in range(workers)]
    for name, cost in sorted(tasks, key=lambda t: t[1], reverse=True):
        target = min(range(workers), key=lambda w: loads[w])
        plan[target].append(name)
        loads[target] += cost
    return plan, max(loads) if loads else 0.0
'''),
    ("Add logging: log a warning with the line number for every line that is skipped", '''
def read_settings(lines):
    settings = {}
    section = "default"
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            continue
        if "=" not in line:
            continue
        key, value = line.split("=", 1)
        settings.setdefault(section, {})[key.strip()] = value.strip()
    return settings
'''),
    ("Add type hints to every parameter and to the return value", '''
def shortest_path(graph, start, goal):
    frontier = [(0, start, [start])]
    visited = set()
    while frontier:
        frontier.sort(key=lambda entry: entry[0])
        cost, node, path = frontier.pop(0)
        if node == goal:
            return cost, path
        if node in visited:
            continue
        visited.add(node)
        for neighbour, weight in graph.get(node, {}).items():
            if neighbour not in visited:
                frontier.append((cost + weight, neighbour, path + [neighbour]))
    return None
'''),
    ("Rename the variable `acc` to `checksum` everywhere", '''
def luhn_valid(number):
    digits = [int(c) for c in str(number) if c.isdigit()]
    if len(digits) < 2:
        return False
    acc = 0
    for position, digit in enumerate(reversed(digits)):
        if position % 2 == 1:
            digit *= 2
            if digit > 9:
                digit -= 9
        acc += digit
    return acc % 10 == 0
'''),
    ("Add a docstring that explains the arguments and the return value", '''
def diff_inventories(before, after):
    added = {k: after[k] for k in after if k not in before}
    removed = {k: before[k] for k in before if k not in after}
    changed = {}
    for key in before:
        if key in after and before[key] != after[key]:
            changed[key] = (before[key], after[key])
    return {"added": added, "removed": removed, "changed": changed}
'''),
    ("Make the function skip `None` values in `readings` instead of failing", '''
def summarize_readings(readings, threshold):
    high = [r for r in readings if r > threshold]
    low = [r for r in readings if r <= threshold]
    mean = sum(readings) / len(readings)
    spread = max(readings) - min(readings)
    return {
        "count": len(readings),
        "mean": round(mean, 3),
        "spread": round(spread, 3),
        "above": len(high),
        "below": len(low),
    }
'''),
    ("Add type hints to every parameter and to the return value", '''
def wrap_words(text, limit):
    lines, current = [], []
    length = 0
    for word in text.split():
        extra = len(word) + (1 if current else 0)
        if current and length + extra > limit:
            lines.append(" ".join(current))
            current, length = [word], len(word)
        else:
            current.append(word)
            length += extra
    if current:
        lines.append(" ".join(current))
    return lines
'''),
    ("Rename the parameter `items` to `entries` and `limit` to `capacity` everywhere", '''
def pack_knapsack(items, limit):
    best = [0] * (limit + 1)
    keep = [[False] * (limit + 1) for _ in items]
    for index, (weight, value) in enumerate(items):
        for room in range(limit, weight - 1, -1):
            if best[room - weight] + value > best[room]:
                best[room] = best[room - weight] + value
                keep[index][room] = True
    chosen, room = [], limit
    for index in range(len(items) - 1, -1, -1):
        if keep[index][room]:
            chosen.append(index)
            room -= items[index][0]
    return best[limit], sorted(chosen)
'''),
    ("Add a docstring that explains the arguments and the return value", '''
def tokenize_expression(source):
    tokens, number = [], ""
    for char in source:
        if char.isdigit() or char == ".":
            number += char
            continue
        if number:
            tokens.append(("num", float(number)))
            number = ""
        if char in "+-*/()":
            tokens.append(("op", char))
        elif not char.isspace():
            raise SyntaxError(f"bad character {char!r}")
    if number:
        tokens.append(("num", float(number)))
    return tokens
'''),
    ("Replace the `for` loop that builds `pairs` with a list comprehension and keep the rest unchanged", '''
def match_students(students, mentors, max_per_mentor):
    pairs = []
    for student in students:
        pairs.append((student["name"], student["topic"]))
    load = {m["name"]: 0 for m in mentors}
    matches = {}
    for name, topic in pairs:
        fitting = [m for m in mentors if topic in m["topics"] and load[m["name"]] < max_per_mentor]
        if not fitting:
            matches[name] = None
            continue
        mentor = min(fitting, key=lambda m: load[m["name"]])
        load[mentor["name"]] += 1
        matches[name] = mentor["name"]
    return matches
'''),
    ("Add type hints to every parameter and to the return value", '''
def render_table(headers, rows, padding=1):
    columns = len(headers)
    widths = [len(str(h)) for h in headers]
    for row in rows:
        for i in range(columns):
            widths[i] = max(widths[i], len(str(row[i])))
    space = " " * padding
    def line(cells):
        return "|" + "|".join(space + str(c).ljust(w) + space for c, w in zip(cells, widths)) + "|"
    rule = "+" + "+".join("-" * (w + 2 * padding) for w in widths) + "+"
    out = [rule, line(headers), rule]
    out += [line(row) for row in rows]
    out.append(rule)
    return "\\n".join(out)
'''),
    ("Add a `retries` parameter (default 3) and retry the call that many times on ConnectionError", '''
def fetch_all(client, paths, timeout):
    results = {}
    failures = []
    for path in paths:
        try:
            response = client.get(path, timeout=timeout)
        except ConnectionError:
            failures.append(path)
            continue
        if response.status == 200:
            results[path] = response.body
        else:
            failures.append(path)
    return results, failures
'''),
]


def editing_prompts() -> List[dict]:
    """The set as jsonl-like records: {"id": "editing/i", "prompt": ...}."""
    return [{"id": f"editing/{i}",
             "prompt": f"{instruction} in this Python function. Reply with the complete updated function only.\n"
                       f"\n```python\n{code.strip()}\n```"}
            for i, (instruction, code) in enumerate(_FUNCTIONS)]
