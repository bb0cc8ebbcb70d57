"""Fixtures for the DDTree builder: the reference implementation's `build_ddtree` run on small random logits.

Run once with the reference's ddtree.py at hand (it needs only mlx):
    python benchmarks/ddtree_reference.py /path/to/mlx_vlm/speculative/ddtree.py
It writes tests/fixtures/ddtree/cases.json: for each case the drafter logits [D, V] (float32 values), the budget,
and the reference's nodes as block slots (tokens[i] is slot i+1, parents[i] its parent slot, 0 = root). The test
(tests/test_tree.py) normalizes the logits the way the reference does and compares `decode.tree.build_ddtree`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "ddtree" / "cases.json"


def load_reference(path: str):
    spec = importlib.util.spec_from_file_location("ddtree_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_ddtree


def cases():
    """(name, logits [D, V] float32, budget): random, ties (also at the top-K boundary), budget > V, budget 1, D = 1,
    -inf entries."""
    rng = np.random.default_rng(2024)
    f32 = lambda a: np.asarray(a, dtype=np.float32)
    yield "random", f32(rng.standard_normal((4, 20)) * 2), 10
    yield "random_wide", f32(rng.standard_normal((8, 50)) * 1.5), 64
    yield "sharp", f32(rng.standard_normal((6, 30)) * 6), 24
    yield "flat", f32(rng.standard_normal((5, 12)) * 0.2), 40
    yield "ties_integer", f32(rng.integers(0, 3, size=(3, 8))), 12  # equal logits and equal prefix sums
    yield "ties_all_equal", f32(np.zeros((3, 4))), 10
    yield "ties_top_k", f32(rng.integers(0, 4, size=(4, 30))), 8  # ties across the top-K boundary
    yield "ties_top_k_deep", f32(rng.integers(0, 2, size=(6, 40))), 16
    yield "ties_rows_repeat", f32(np.tile(rng.integers(0, 4, size=(1, 6)), (4, 1))), 20
    yield "budget_over_vocab", f32(rng.standard_normal((3, 4))), 30
    yield "budget_over_tree", f32(rng.standard_normal((2, 3))), 50  # only 3 + 9 prefixes exist
    yield "budget_1", f32(rng.standard_normal((5, 10))), 1
    yield "depth_1", f32(rng.standard_normal((1, 12))), 5
    yield "depth_1_over_vocab", f32(rng.standard_normal((1, 5))), 9
    masked = f32(rng.standard_normal((3, 10)))
    masked[:, 4:] = -np.inf  # a filtered distribution: tokens the drafter gives probability 0
    yield "neg_inf", masked, 25


def main(path: str) -> None:
    build = load_reference(path)
    out = []
    for name, logits, budget in cases():
        nodes = build(mx.array(logits)[None], budget, slot_offset=0)
        out.append({
            "name": name,
            "budget": budget,
            "logits": [[float(x) for x in row] for row in logits],
            "tokens": [int(node.token_ids[-1]) for node in nodes],
            "parents": [int(node.parent) + 1 for node in nodes],  # flat index -> block slot (root 0)
        })
        print(f"{name}: {len(nodes)} nodes")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=None, separators=(",", ":")) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ref/vlm/mlx_vlm/speculative/ddtree.py")
