"""`dflash-mlx bench`'s "identical" column, checked from outside: the tokens bench saves as plain decoding's output
are mlx-lm's own greedy tokens (generate_step on an independently encoded prompt), and the DFlash method it runs
yields those same tokens when run by itself."""

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

from dflash_mlx.bench.methods import DFlashMethod
from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.drafters.io import load_drafter

PROMPTS = [{"id": "a", "prompt": "What is 2 + 2?"}, {"id": "b", "prompt": "def add(a, b):"}]
MAX_TOKENS = 12
BLOCK = 4


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target, drafter = make_tiny_pair(root / "pair", block_size=BLOCK)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    code = main(["bench", "-m", str(target), "-d", str(drafter), "--prompts", str(prompts), "--num-prompts", "2",
                 "--max-tokens", str(MAX_TOKENS), "--widths", str(BLOCK), "--no-profile",
                 "--verify-prompts", "0", "--out", str(root / "out")])
    assert code == 0
    return target, drafter, json.loads((root / "out" / "bench.json").read_text())


def _independent(target):
    """Prompts encoded with the tokenizer's own chat template, and mlx-lm's greedy continuation of each."""
    model, tokenizer = mlx_lm_load(str(target))
    eos = set(tokenizer.eos_token_ids)
    out = []
    for p in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True)
        ref = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=MAX_TOKENS)]
        out.append((list(ids), ref[: next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))]))
    return model, tokenizer, out


def test_saved_reference_tokens_are_mlx_lm_greedy(bench_run):
    target, _, report = bench_run
    _, _, expected = _independent(target)
    assert [p["id"] for p in report["prompts"]] == ["a", "b"]
    for saved, (ids, ref) in zip(report["prompts"], expected):
        assert saved["prompt_tokens"] == len(ids)
        assert saved["reference"] == ref


def test_identical_column_agrees_with_an_independent_dflash_run(bench_run):
    target, drafter_dir, report = bench_run
    model, tokenizer, expected = _independent(target)
    drafter = load_drafter(str(drafter_dir))
    from dflash_mlx.api import prepare

    wrapped = prepare(model, drafter)
    method = DFlashMethod(wrapped, drafter, BLOCK)
    dflash = next(m for m in report["methods"] if m["kind"] == "dflash")
    assert dflash["identical"] == dflash["prompts"] == 2
    for ids, ref in expected:
        run = method.run(ids, MAX_TOKENS, sorted(tokenizer.eos_token_ids))
        assert run.tokens == ref
