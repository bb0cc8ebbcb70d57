"""`dflash-mlx generate` and `chat` started as 2 ranks (as `mlx.launch` starts them, and by `mlx.launch` itself):
rank 0 prints the single process's output, rank 1 prints nothing, and every user mistake ends in one line on
rank 0 and a clean exit on every rank."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlx_lm.utils import save_config, save_model

from cache_compare import CONFIGS, build
from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.distributed.local import free_ports, run_local, write_hostfile
from dflash_mlx.drafters.io import save_drafter
from tiny import make_drafter

LIMIT = 120  # seconds per launch (a shared, loaded machine is slow; a hang is killed)
GENERATE = ["generate", "--prompt", "Hello there", "--max-tokens", "16", "--ignore-chat-template"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pair"))


def _save(model, config: dict, out: Path) -> Path:
    out.mkdir(parents=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


@pytest.fixture(scope="module")
def hybrid_pair(pair, tmp_path_factory):
    """A tiny random qwen3_5 target (it has pipeline support) with the tiny pair's tokenizer, and a drafter."""
    root = tmp_path_factory.mktemp("hybrid")
    vocab = json.loads((pair[0] / "config.json").read_text())["vocab_size"]
    config = json.loads(json.dumps(CONFIGS["qwen3_5"]))
    config["text_config"]["vocab_size"] = vocab
    model = build("qwen3_5", text_config=config["text_config"])
    target = _save(model, config, root / "target")
    for f in pair[0].iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja" or f.name == "special_tokens_map.json":
            shutil.copy(f, target / f.name)
    drafter, _ = make_drafter(model, block_size=4, mask_token_id=vocab - 1, vocab_size=vocab)
    return target, save_drafter(drafter, root / "drafter")


def _cli(*argv, ranks: int = 2, **kwargs):
    results = run_local([sys.executable, "-m", "dflash_mlx.cli", *argv], ranks=ranks, timeout=LIMIT, **kwargs)
    for r in results:
        assert not r.timed_out, f"rank {r.rank} hung: {r.stderr[-2000:]}"
    return results


def _one_line_error(results, *needles):
    """Rank 0: exit 2 and one 'error:' line naming the problem; the other ranks: exit 2, silent."""
    first, *others = results
    lines = [line for line in first.stderr.splitlines() if line.strip()]
    assert first.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), first.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    for r in others:
        assert r.returncode == 2, r.stderr
        assert r.stdout == r.stderr == "", (r.stdout, r.stderr)


def test_pipeline_ranks_print_the_single_process_output_once(hybrid_pair, capsys):
    # Greedy with no seed: the width of each pass is adaptive, so the ranks must choose alike (they pace their
    # widths by a seed drawn alike). Tensor parallel end to end: test_chat_under_mlx_launch_replies_like_one_process.
    target, drafter = hybrid_pair
    argv = [*GENERATE, "--model", str(target), "--draft", str(drafter)]
    capsys.readouterr()
    assert main(argv) == 0
    single = capsys.readouterr().out
    rank0, rank1 = _cli(*argv, "--pipeline")
    assert rank0.returncode == rank1.returncode == 0, rank0.stderr + rank1.stderr
    assert rank0.stdout == single and len(single.strip()) > 0
    assert rank1.stdout == rank1.stderr == ""


def test_model_without_tensor_parallel_support(pair, tmp_path):
    target = _save(build("qwen3_next"), CONFIGS["qwen3_next"], tmp_path / "qwen3_next")
    _one_line_error(_cli(*GENERATE, "--model", str(target), "--draft", str(pair[1])),
                    "qwen3_next", "cannot be split by heads", "--pipeline")


def test_unreachable_rank_times_out_with_one_line(pair, tmp_path):
    # The hostfile names 2 ranks; only rank 0 is started, so its peer never connects.
    hostfile = write_hostfile(tmp_path / "hosts.json", 2)
    (rank0,) = _cli(*GENERATE, "--model", str(pair[0]), "--draft", str(pair[1]), ranks=1, hostfile=hostfile,
                    env={"DFLASH_MLX_CONNECT_TIMEOUT": "2"})
    _one_line_error([rank0], "could not reach the other ranks within 2 s", "DFLASH_MLX_CONNECT_TIMEOUT")
    assert json.loads(hostfile.read_text())  # the hostfile named the missing peer


# The checks behind those lines, in process (each 2-rank launch costs seconds).
@pytest.mark.parametrize("kind,changes,pipeline,needles", [
    ("qwen3_next", {}, False, ["'qwen3_next' cannot be split by heads", "use --pipeline"]),
    ("gemma3_text", {}, False, ["cannot be split by heads", "run it on one machine"]),
    ("gemma3_text", {}, True, ["'gemma3_text' cannot be split into pipeline stages", "drop --pipeline"]),
    ("qwen3_moe", {"num_attention_heads": 3, "num_key_value_heads": 1}, False, ["num_attention_heads (3)", "(3)"]),
    ("qwen3_moe", {"num_key_value_heads": 1}, False, ["num_key_value_heads (1)"]),
    ("qwen3_moe", {"moe_intermediate_size": 33}, False, ["moe_intermediate_size (33)", "(3, 11)"]),
])
def test_shardability_checks(kind, changes, pipeline, needles):
    from dflash_mlx.distributed import check_shardable
    from dflash_mlx.errors import DFlashError

    with pytest.raises(DFlashError) as e:
        check_shardable(build(kind, **changes), 2, pipeline=pipeline)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_shardable_models_pass_the_checks():
    from dflash_mlx.distributed import check_shardable

    for kind in ("qwen3_5", "qwen3_moe", "deepseek_v3", "gpt_oss"):
        check_shardable(build(kind), 2)
    # qwen3_5 copies a key/value head to each rank when there are more ranks than heads.
    one_kv_head = dict(CONFIGS["qwen3_5"]["text_config"], num_key_value_heads=1)
    check_shardable(build("qwen3_5", text_config=one_kv_head), 2)
    check_shardable(build("qwen3_next"), 2, pipeline=True)
    check_shardable(build("qwen3_5"), 4, pipeline=True)


def test_pipeline_without_a_launcher_is_one_line(pair, capsys):
    code = main([*GENERATE, "--model", str(pair[0]), "--draft", str(pair[1]), "--pipeline"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "mlx.launch" in err, err


def _mlx_launch():
    for candidate in (shutil.which("mlx.launch"), Path(sys.executable).parent / "mlx.launch",
                      Path(sys.base_prefix) / "bin" / "mlx.launch"):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def _run_with_limit(argv, stdin: str) -> subprocess.CompletedProcess:
    # Bytes, not text mode: text mode would turn a generated "\r" into "\n".
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        out, err = p.communicate(stdin.encode(), timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the launcher and the ranks it started
        out, err = p.communicate()
        pytest.fail(f"{argv[0]} hung: {err.decode(errors='replace')[-2000:]}")
    return subprocess.CompletedProcess(argv, p.returncode, out.decode(errors="replace"),
                                       err.decode(errors="replace"))


@pytest.mark.skipif(_mlx_launch() is None, reason="MLX's launcher (mlx.launch) is not installed")
def test_chat_under_mlx_launch_replies_like_one_process(pair, monkeypatch, capsys):
    """The real launcher, tensor parallel: it starts 2 ring ranks and copies the typed lines to both; rank 0
    replies exactly as one process does, once."""
    options = ["--model", str(pair[0]), "--draft", str(pair[1]), "--max-tokens", "12", "--temp", "1.0", "--seed", "1"]
    typed = "Hello there\n/exit\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(typed))
    capsys.readouterr()
    assert main(["chat", *options]) == 0
    single = capsys.readouterr().out
    port = free_ports(1)[0]  # the launcher listens on this port and the next
    launched = _run_with_limit([_mlx_launch(), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
                                "--starting-port", str(port), "--", sys.executable, "-m", "dflash_mlx.cli", "chat",
                                *options], typed)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert launched.stdout == single and "dflash-mlx chat" in single


@pytest.fixture(scope="module")
def qwen2_pair(tmp_path_factory):
    """A tiny pair whose target mlx-lm splits both ways: by heads and into pipeline stages."""
    return make_tiny_pair(tmp_path_factory.mktemp("qwen2"), arch="qwen2")


# Bytes rank 0 moves per plain decoding pass (one token, hidden 64, fp32: 256-byte activations). Tensor parallel:
# each of 8 all-sums sends and receives 256 bytes. Pipeline: rank 0 (the last stage) receives the hand-off and
# all-gathers the last hidden state (sends 256, receives 256).
PLAIN_PASS_BYTES = {"tensor": 8 * 2 * 256, "pipeline": 256 + 2 * 256}


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_bench_distributed_reports_traffic_and_matches_one_process(qwen2_pair, tmp_path, split):
    """`bench --distributed` on 2 ranks: rank 0 alone prints and writes the report; every method commits the single
    process's tokens; plain decoding moves exactly its collectives' bytes per pass."""
    from dflash_mlx.bench import BenchConfig, run_bench

    pair = qwen2_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Write a function that adds two numbers."}) + "\n")
    options = dict(model=str(pair[0]), draft=str(pair[1]), oracle=True, prompts=str(prompts), max_tokens=10)
    single = run_bench(BenchConfig(**options, profile=False, verify_prompts=0, progress=False))
    out = tmp_path / "out"
    rank0, rank1 = _cli("bench", "--distributed", "--model", options["model"], "--draft", options["draft"],
                        "--oracle", "--prompts", str(prompts), "--max-tokens", "10", "--no-profile",
                        "--verify-prompts", "1", "--out", str(out), *(["--pipeline"] if split == "pipeline" else []))
    assert rank0.returncode == rank1.returncode == 0, rank0.stderr[-2000:] + rank1.stderr[-2000:]
    assert rank1.stdout == rank1.stderr == ""
    assert f"communication, 2 ranks, {split} parallel" in rank0.stdout and "KB/pass" in rank0.stdout
    assert "verify cost vs one decode step" in rank0.stdout and "drafting cost per block" in rank0.stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["prompts"][0]["reference"] == single["prompts"][0]["reference"]
    assert [m["name"] for m in report["methods"]] == [m["name"] for m in single["methods"]]
    assert all(m["identical"] == 1 for m in report["methods"]), report["notes"]
    comm = report["communication"]
    assert comm["counted"] and comm["mode"] == split
    assert [m["name"] for m in comm["methods"]] == [m["name"] for m in single["methods"]]
    plain = comm["methods"][0]
    assert plain["passes"] > 0 and abs(plain["bytes_per_pass"] - PLAIN_PASS_BYTES[split]) < 64, plain
    for m in comm["methods"][1:]:  # a verify pass moves a block of several tokens
        assert m["bytes_per_pass"] > plain["bytes_per_pass"] and m["comm_ms_per_pass"] > 0, m


def test_bench_distributed_without_a_launcher_is_one_line(pair, capsys):
    code = main(["bench", "--model", str(pair[0]), "--draft", str(pair[1]), "--distributed"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "mlx.launch" in err, err


def test_serve_refuses_a_rank_count_that_does_not_divide_the_heads(pair, tmp_path):
    # 3 attention heads over 2 ranks: one line on rank 0 before any port is opened, a silent exit 2 on rank 1.
    model = build("qwen3_moe", num_attention_heads=3, num_key_value_heads=1)
    target = _save(model, CONFIGS["qwen3_moe"] | {"num_attention_heads": 3, "num_key_value_heads": 1},
                   tmp_path / "three_heads")
    _one_line_error(_cli("serve", "--model", str(target), "--draft", str(pair[1]), "--port", str(free_ports(1)[0])),
                    "2 ranks cannot split the target's num_attention_heads (3) evenly", "(3)")


def test_serve_pipeline_without_a_launcher_is_one_line(pair, capsys):
    code = main(["serve", "--model", str(pair[0]), "--draft", str(pair[1]), "--pipeline"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "mlx.launch" in err, err


@pytest.mark.slow
def test_connecting_rank_alone_gives_up_with_one_line(pair, tmp_path):
    # Rank 1 connects (rank 0 accepts): MLX retries for about 30 s and cannot be interrupted; the line says so.
    hostfile = write_hostfile(tmp_path / "hosts.json", 2)
    env = dict(os.environ, MLX_RANK="1", MLX_HOSTFILE=str(hostfile), DFLASH_MLX_CONNECT_TIMEOUT="2")
    p = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", *GENERATE, "--model", str(pair[0]), "--draft",
                        str(pair[1])], env=env, capture_output=True, text=True, timeout=LIMIT)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 could not "), p.stderr


def test_hub_targets_are_fetched_with_one_line_errors(monkeypatch, tmp_path):
    from dflash_mlx.distributed.sharding import target_path
    from dflash_mlx.errors import DFlashError

    assert target_path(str(tmp_path)) == tmp_path
    with pytest.raises(DFlashError, match="not found: give a local model directory"):
        target_path(str(tmp_path / "missing"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(DFlashError, match="could not download target .nobody/no-such-model.: "):
        target_path("nobody/no-such-model")
