"""The `dflash-mlx` command line on a tiny offline pair: it generates, and every bad input ends in one clear line."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

from dflash_mlx.cli import main
from dflash_mlx.drafters.config import DFlashConfig
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.drafters.io import build_drafter, save_drafter


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("pair"))
    return target, drafter


def _drafter_config(drafter_dir) -> dict:
    return json.loads((drafter_dir / "config.json").read_text())


def _variant(tmp_path, pair, **changes):
    """A random drafter whose config differs from the matching one by `changes`."""
    raw = _drafter_config(pair[1])
    raw.update({k: v for k, v in changes.items() if k != "dflash_config"})
    raw["dflash_config"] = {**raw["dflash_config"], **changes.get("dflash_config", {})}
    drafter = build_drafter(DFlashConfig.from_dict(raw))
    mx.eval(drafter.parameters())
    return save_drafter(drafter, tmp_path / "drafter")


def _run(capsys, *argv):
    capsys.readouterr()  # drop output of the test's own setup (progress bars)
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line_error(code, err, *needles):
    assert code != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_generate_verbose_prints_speed_and_acceptance(pair, capsys):
    code, out, err = _run(capsys, "generate", "--model", str(pair[0]), "--draft", str(pair[1]),
                          "--prompt", "Hello there", "--max-tokens", "10", "--verbose")
    assert code == 0, err
    assert "tokens-per-sec" in out
    assert "Acceptance: tau" in out
    assert "Peak memory" in out


def _steered_load(monkeypatch, pair, prompt, max_tokens, spoil_every=3):
    """api.load as the CLI calls it, but with the pair's drafter (same weights, same context cache) steered to
    propose mlx-lm's own greedy continuation, spoiled at every `spoil_every`-th position: drafts get accepted."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from dflash_mlx import api
    from dflash_mlx.drafters.io import read_config, read_weights
    from tiny import SteeredDFlashDrafter, corrupt_every

    model, tokenizer, _ = api.load(str(pair[0]), str(pair[1]))
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    greedy = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens)]
    eos = set(tokenizer.eos_token_ids)
    greedy = greedy[: next((i + 1 for i, t in enumerate(greedy) if t in eos), len(greedy))]
    drafter = SteeredDFlashDrafter(read_config(pair[1]))
    drafter.load_weights(list(read_weights(pair[1]).items()))
    drafter.steer(ids + greedy, corrupt_every(spoil_every))
    monkeypatch.setattr(api, "load", lambda *a, **k: (model, tokenizer, drafter))
    return tokenizer.decode([t for t in greedy if t not in eos])


@pytest.mark.parametrize("block", ["4", "8"])
def test_generate_prints_mlx_lm_greedy_text_with_accepted_drafts(pair, capsys, monkeypatch, block):
    expected = _steered_load(monkeypatch, pair, "Write a haiku", max_tokens=24)
    code, out, err = _run(capsys, "generate", "--model", str(pair[0]), "--draft", str(pair[1]), "--prompt",
                          "Write a haiku", "--max-tokens", "24", "--width", block, "--verbose")
    assert code == 0, err
    text, _, stats = out.partition("\n==========\n")
    assert text.strip() == expected.strip() and expected.strip()
    tau = float(stats.split("Acceptance: tau ")[1].split()[0])
    assert tau > 1.5, stats  # most drafts are accepted, so the output came through multi-token verify passes


def test_generate_block_size_one_equals_default(pair, capsys):
    args = ["generate", "--model", str(pair[0]), "--draft", str(pair[1]), "--prompt", "abc", "--max-tokens", "12"]
    code, plain, _ = _run(capsys, *args, "--width", "1")
    assert code == 0
    code, drafted, _ = _run(capsys, *args)
    assert code == 0
    assert plain == drafted


def test_hidden_size_mismatch(pair, tmp_path, capsys):
    raw = _drafter_config(pair[1])
    bad = _variant(tmp_path, pair, hidden_size=raw["hidden_size"] * 2, head_dim=raw["head_dim"])
    code, _, err = _run(capsys, "generate", "--model", str(pair[0]), "--draft", str(bad), "--prompt", "x")
    _assert_one_line_error(code, err, "hidden size")


def test_vocab_mismatch(pair, tmp_path, capsys):
    raw = _drafter_config(pair[1])
    bad = _variant(tmp_path, pair, vocab_size=raw["vocab_size"] + 5)
    code, _, err = _run(capsys, "generate", "--model", str(pair[0]), "--draft", str(bad), "--prompt", "x")
    _assert_one_line_error(code, err, "vocabulary")


def test_target_layer_ids_out_of_range(pair, tmp_path, capsys):
    bad = _variant(tmp_path, pair, dflash_config={"target_layer_ids": [1, 99]})
    code, _, err = _run(capsys, "generate", "--model", str(pair[0]), "--draft", str(bad), "--prompt", "x")
    _assert_one_line_error(code, err, "99")


def test_missing_drafter_safetensors(pair, tmp_path, capsys):
    broken = tmp_path / "drafter"
    shutil.copytree(pair[1], broken)
    (broken / "model.safetensors").unlink()
    code, _, err = _run(capsys, "generate", "--model", str(pair[0]), "--draft", str(broken), "--prompt", "x")
    _assert_one_line_error(code, err, "safetensors")


def test_missing_target_dir(pair, tmp_path, capsys):
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path / "nope"), "--draft", str(pair[1]), "--prompt", "x")
    _assert_one_line_error(code, err, "not found")


@pytest.mark.parametrize("model_type", ["gpt2", "no_such_arch"])
def test_unknown_architecture(pair, tmp_path, capsys, model_type):
    target = tmp_path / "target"
    shutil.copytree(pair[0], target)
    config = json.loads((target / "config.json").read_text())
    config["model_type"] = model_type
    if model_type == "gpt2":
        config.update(n_ctx=64, n_embd=config["hidden_size"], n_head=config["num_attention_heads"],
                      n_layer=config["num_hidden_layers"], n_positions=64, layer_norm_epsilon=1e-5)
    (target / "config.json").write_text(json.dumps(config))
    code, _, err = _run(capsys, "generate", "--model", str(target), "--draft", str(pair[1]), "--prompt", "x")
    _assert_one_line_error(code, err)
    assert "llama" in err or "not supported" in err


def test_invalid_flags(pair, capsys):
    base = ["generate", "--model", str(pair[0]), "--draft", str(pair[1]), "--prompt", "x"]
    code, _, err = _run(capsys, *base, "--width", "0")
    _assert_one_line_error(code, err, "--width")
    code, _, err = _run(capsys, *base, "--no-such-flag")
    _assert_one_line_error(code, err, "--no-such-flag")
    code, _, err = _run(capsys, *base, "--max-tokens", "0")
    _assert_one_line_error(code, err, "max-tokens")


def test_convert_bad_dtype(pair, tmp_path, capsys):
    code, _, err = _run(capsys, "convert", str(pair[1]), str(tmp_path / "out"), "--dtype", "int3")
    _assert_one_line_error(code, err, "--dtype")


def test_console_script_exit_code_and_help(pair):
    done = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", "generate", "--model", str(pair[0]),
                           "--draft", "/nonexistent/drafter", "--prompt", "x"], capture_output=True, text=True)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("error: ")
    done = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    assert "generate" in done.stdout and "convert" in done.stdout


def test_chat_subcommand_runs_a_stdin_script(pair, tmp_path, capsys, monkeypatch):
    import io

    saved = tmp_path / "conv.json"
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"hi\n/stats\nsecond turn\n/save {saved}\n/quit\n"))
    code, out, err = _run(capsys, "chat", "--model", str(pair[0]), "--draft", str(pair[1]), "--max-tokens", "6")
    assert code == 0, err
    assert "tau" in out and "saved 4 messages" in out
    assert [m["role"] for m in json.loads(saved.read_text())["messages"]] == ["user", "assistant"] * 2


def test_models_lists_offline_models_and_published_pairs(capsys):
    code, out, _ = _run(capsys, "models")
    assert code == 0
    assert "smollm2-135m" in out and "Qwen3.5-9B" in out and "z-lab/Qwen3.5-9B-DFlash" in out


def test_unknown_registry_name_suggests(pair, capsys):
    code, _, err = _run(capsys, "generate", "--model", "Qwen3.5-8B", "--prompt", "x")
    _assert_one_line_error(code, err, "did you mean", "Qwen3.5-9B")
