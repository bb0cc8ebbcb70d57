"""`--draft mtp` and `load(target, drafter="mtp")` end to end, on a tiny Qwen3.5 checkpoint folder that carries
`mtp.*` tensors and a tokenizer: the API, the command line and the server reply as plain greedy decoding does;
a checkpoint without MTP layers is one clear line."""

from __future__ import annotations

import shutil

import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import generate_step

from benchmarks.mtp_reference import save_checkpoint
from dflash_mlx import load, stream_generate
from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.drafters.mtp import MTPDrafter
from dflash_mlx.server import ServerSettings, create_app, start_in_thread


def _with_tokenizer(tmp_path, name, with_mtp=True):
    target_dir, _ = make_tiny_pair(tmp_path / "pair")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(target_dir)))
    folder = save_checkpoint("qwen3_5", tmp_path / name, vocab_size=vocab, with_mtp=with_mtp)
    for f in target_dir.iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _with_tokenizer(tmp_path_factory.mktemp("mtp"), "qwen3_5")


def _plain(model, ids, n):
    return [int(t) for t, _ in generate_step(mx.array(ids, dtype=mx.int32), model, max_tokens=n)]


def test_load_mtp_and_stream_generate_equal_plain_decoding(folder):
    model, tokenizer, drafter = load(str(folder), drafter="mtp")
    assert isinstance(drafter, MTPDrafter)
    ids = tokenizer.encode("def add(a, b):")
    want = _plain(model, ids, 24)
    for width in (None, 2, 4):
        got = [r.token for r in stream_generate(model, tokenizer, ids, drafter, max_tokens=24, width=width,
                                                lookup=False)]
        assert got == want, width
    sources = {r.source for r in stream_generate(model, tokenizer, ids, drafter, max_tokens=24, width=3)}
    assert "mtp" in sources


def test_cli_generate_with_draft_mtp(folder, capsys):
    assert main(["generate", "--model", str(folder), "--draft", "mtp", "-p", "hello", "--max-tokens", "16",
                 "--ignore-chat-template", "--width", "1"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "--model", str(folder), "--draft", "mtp", "-p", "hello", "--max-tokens", "16",
                 "--ignore-chat-template", "--width", "3"]) == 0
    assert capsys.readouterr().out == plain


def test_server_with_mtp_replies_as_plain_decoding(folder):
    model, tokenizer, drafter = load(str(folder), drafter="mtp")
    messages = [{"role": "user", "content": "hi"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = tokenizer.decode(_plain(model, ids, 12))
    running = start_in_thread(create_app(model, tokenizer, drafter, ServerSettings(model_name="m")))
    try:
        client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=300)
        for _ in range(2):  # the second time from the prefix cache
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
            assert want.startswith(reply.choices[0].message.content)
    finally:
        running.stop()


def test_checkpoint_without_mtp_is_one_line(tmp_path, capsys):
    folder = _with_tokenizer(tmp_path, "bare", with_mtp=False)
    assert main(["generate", "--model", str(folder), "--draft", "mtp", "-p", "hi", "--max-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no MTP layers" in err[0]


def test_bench_runs_mtp_beside_plain_decoding(folder):
    from dflash_mlx.bench import BenchConfig, format_table, run_bench

    report = run_bench(BenchConfig(model=str(folder), draft="mtp", num_prompts=1, max_tokens=12, profile=False,
                                   verify_prompts=0, warmup=False, progress=False, lookup=False,
                                   chat_template=False, tree_budgets=["auto"]))
    table = format_table(report)
    rows = [line.split() for line in table.splitlines() if line.startswith(("mlx-lm", "mtp ")) and ":" not in line]
    assert {" ".join(r[:-10]) for r in rows} == {"mlx-lm", "mtp adaptive", "mtp adaptive tree=auto", "mtp B=4"}
    assert all(r[-1] == "1/1" for r in rows)  # every method's output equals plain decoding's
