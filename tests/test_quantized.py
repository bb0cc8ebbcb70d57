"""Quantized targets: `dflash-mlx convert --target DIR OUT --q-bits 4|8`, then greedy DFlash on the quantized
weights must equal mlx-lm's greedy decoding on the same weights.

The contract (README, "Losslessness"): equal token for token, except where a verify pass of B rows rounds
differently from mlx-lm's one-row decode at a near-tie. Such a flip is not hidden: the test reports the logit
margin at the first difference, and it only passes as an expected failure when both passes call it a near-tie
(gap below `NEAR_TIE`); any wider gap is a bug and fails.
"""

import json

import dflash_mlx  # noqa: F401  (first: OpenBLAS before mlx)
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

from dflash_mlx import api
from dflash_mlx.cli import main
from dflash_mlx.convert.target import convert_target
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.decode.loop import dflash_generate_step
from dflash_mlx.errors import DFlashError
from dflash_mlx.drafters.oracle import OracleDrafter
from dflash_mlx.targets import TargetModel

MAX_TOKENS = 40
NEAR_TIE = 1e-3  # log-prob gap between the two top tokens below which rounding may pick either
PROMPTS = ["Hello! How are you today?", "def add(a, b):"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    target_dir, drafter_dir = make_tiny_pair(root / "pair", arch="qwen3", block_size=16)
    return root, target_dir, drafter_dir


@pytest.fixture(scope="module", params=[4, 8], ids=["4bit", "8bit"])
def quantized(pair, request):
    root, target_dir, drafter_dir = pair
    out = convert_target(str(target_dir), root / f"q{request.param}", q_bits=request.param, q_group_size=32)
    return request.param, out, drafter_dir


def _reference(model, prompt, max_tokens, eos):
    """mlx-lm greedy decoding (one row per step): tokens and their log-prob rows."""
    tokens, rows = [], []
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tokens.append(int(token))
        rows.append(logprobs)
        if tokens[-1] in eos:
            break
    return tokens, rows


def _check(ours, our_rows, ref, ref_rows, what):
    """Equal, or a near-tie flip reported with its margins; anything else fails with the same report."""
    if ours == ref:
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    if i == min(len(ours), len(ref)):
        pytest.fail(f"{what}: lengths differ ({len(ours)} vs {len(ref)}) with equal prefix")
    a, b = ours[i], ref[i]
    decode_gap = (ref_rows[i][b] - ref_rows[i][a]).item()  # mlx-lm's 1-row pass: how much it preferred b
    verify_gap = (our_rows[i][a] - our_rows[i][b]).item()  # the verify pass: how much it preferred a
    report = (f"{what}: first difference at token {i}: DFlash {a}, mlx-lm {b}; log-prob margin "
              f"{decode_gap:.3g} in the 1-row decode, {verify_gap:.3g} in the verify pass")
    if max(decode_gap, verify_gap) < NEAR_TIE:
        pytest.xfail("near-tie rounding flip, allowed by the contract: " + report)
    pytest.fail(report)


def test_convert_writes_quantized_target(quantized):
    bits, out, _ = quantized
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 32
    model, _ = mlx_lm_load(str(out))
    assert "scales" in dict(model.model.layers[0].self_attn.q_proj.parameters())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_dflash_equals_mlx_lm_on_quantized_target(quantized, prompt):
    bits, out, drafter_dir = quantized
    model, tokenizer, drafter = api.load(str(out), str(drafter_dir))
    ids = tokenizer.encode(prompt)
    eos = set(tokenizer.eos_token_ids)
    ref, ref_rows = _reference(model, ids, MAX_TOKENS, eos)
    for block in (4, 16):
        responses = list(api.stream_generate(model, tokenizer, ids, drafter, max_tokens=MAX_TOKENS,
                                             width=block))
        _check([r.token for r in responses], [r.logprobs for r in responses], ref, ref_rows,
               f"{bits}-bit, random drafter, B={block}")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_oracle_full_blocks_on_quantized_target(quantized, prompt):
    # The oracle's blocks are accepted whole, so every one of the 16 verify rows commits a token.
    bits, out, _ = quantized
    model, tokenizer = mlx_lm_load(str(out))
    ids = tokenizer.encode(prompt)
    ref, ref_rows = _reference(model, ids, MAX_TOKENS, set())
    oracle = OracleDrafter(ids + ref, vocab_size=model.args.vocab_size, block_size=16)
    ours, rows = [], []
    for cycle in dflash_generate_step(mx.array(ids), TargetModel(model), oracle, max_tokens=MAX_TOKENS):
        ours += cycle.tokens
        rows += [cycle.logits[i] - mx.logsumexp(cycle.logits[i]) for i in range(len(cycle.tokens))]
    _check(ours, rows, ref, ref_rows, f"{bits}-bit, oracle drafter, B=16")


def test_cli_quantizes_target(pair, tmp_path, capsys):
    _, target_dir, _ = pair
    assert main(["convert", "--target", str(target_dir), str(tmp_path / "q8"), "--q-bits", "8"]) == 0
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"]["bits"] == 8
    # Refusals: already quantized, bad bits, nothing to do, a missing source.
    assert main(["convert", "--target", str(tmp_path / "q8"), str(tmp_path / "q4"), "--q-bits", "4"]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert main(["convert", "--target", str(target_dir), str(tmp_path / "x"), "--q-bits", "3"]) == 2
    assert "4 or 8" in capsys.readouterr().err
    with pytest.raises(DFlashError, match="nothing to do"):
        convert_target(str(target_dir), tmp_path / "y")
    assert main(["convert", "--target", str(tmp_path / "nope"), str(tmp_path / "z"), "--q-bits", "4"]) == 2
    assert "not found" in capsys.readouterr().err
