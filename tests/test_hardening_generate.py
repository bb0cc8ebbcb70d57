"""Bad input to `generate`, `chat` and `bench` ends in one `error:` line before any model work: text that is not
UTF-8, a chat template that fails, seeds MLX cannot take, a bench report that could not be written."""

import json
import subprocess
import sys

import pytest

from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.errors import DFlashError
from dflash_mlx.decode.sampling import check_seed


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pair"))


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def _run(args, capsys):
    code = main(args)
    return code, _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("flag", ["--prompt", "--system-prompt"])
def test_text_that_is_not_utf8(pair, capsys, flag):
    # Python keeps undecodable argv bytes as lone surrogates (surrogateescape); that is what main() receives.
    args = ["generate", "--model", str(pair[0]), "--draft", str(pair[1]), "--max-tokens", "2", "--prompt", "hi",
            flag, "bad \udcff text"]  # the later --prompt wins
    code, line = _run(args, capsys)
    assert code == 2 and flag in line and "UTF-8" in line


def test_stdin_prompt_that_is_not_utf8(pair):
    proc = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", "generate", "--model", str(pair[0]), "--draft",
                           str(pair[1]), "--prompt", "-", "--max-tokens", "2"], input=b"hello \xff\xfe world",
                          capture_output=True, timeout=120)
    line = _one_line(proc.stderr.decode())
    assert proc.returncode == 2 and "standard input is not valid UTF-8" in line


@pytest.mark.parametrize("template", ["{% if %}", "{{ raise_exception('System role not supported') }}"])
def test_chat_template_that_fails(tmp_path, capsys, template):
    target, drafter = make_tiny_pair(tmp_path)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    code, line = _run(["generate", "--model", str(target), "--draft", str(drafter), "--prompt", "hi",
                       "--max-tokens", "2"], capsys)
    assert code == 2 and "chat template failed" in line and "--ignore-chat-template" in line


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_seeds_mlx_cannot_take(pair, capsys, command, seed):
    args = [command, "--model", str(pair[0]), "--draft", str(pair[1]), "--seed", seed]
    if command == "generate":
        args += ["--prompt", "hi"]
    code, line = _run(args, capsys)
    assert code == 2 and "--seed must be an integer from 0 to 2**64-1" in line


def test_seed_range_is_checked_where_sampling_starts():
    check_seed(0), check_seed(2**64 - 1), check_seed(None)
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(DFlashError, match="from 0 to 2"):
            check_seed(bad)
    from dflash_mlx.decode.acceptance import make_acceptor

    with pytest.raises(DFlashError, match="seed must be"):
        make_acceptor(temp=0.5, seed=-3)


def test_bench_seed_leaves_room_for_every_prompt(pair, capsys):
    code, line = _run(["bench", "--model", str(pair[0]), "--draft", str(pair[1]), "--seed", str(2**64 - 1),
                       "--num-prompts", "3"], capsys)
    assert code == 2 and "prompt index" in line


def test_bench_out_checked_before_the_run(pair, tmp_path, capsys):
    a_file = tmp_path / "report"
    a_file.write_text("mine")
    for out in (a_file, a_file / "sub"):
        code, line = _run(["bench", "--model", str(pair[0]), "--draft", str(pair[1]), "--out", str(out),
                           "--num-prompts", "1", "--max-tokens", "2"], capsys)
        assert code == 2 and "--out" in line
    assert a_file.read_text() == "mine"


def test_bench_binary_prompts_file(pair, tmp_path, capsys):
    binary = tmp_path / "prompts.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    code, line = _run(["bench", "--model", str(pair[0]), "--draft", str(pair[1]), "--prompts", str(binary),
                       "--num-prompts", "1", "--max-tokens", "2"], capsys)
    assert code == 2 and "not UTF-8 text" in line


def test_collapse_needs_a_few_drafting_passes_to_judge():
    """A generation whose planner drafted once or twice (lookup or plain decoding did the rest) has not shown that
    the drafter collapsed, however many passes it ran; four drafting passes with nothing accepted have."""
    from dflash_mlx.decode.stats import AcceptanceStats, CollapseWatch

    stats = AcceptanceStats(adaptive=True)
    for _ in range(40):
        stats.record(7, 8, "lookup")
    for _ in range(3):
        stats.record(0, 4)
    assert CollapseWatch().check(stats) is None
    stats.record(0, 4)
    message = CollapseWatch().check(stats)
    assert message is not None and "0.00 drafts accepted per drafting pass over 4 passes" in message


def test_collapse_warning_waits_for_the_end_of_the_text(pair, caplog):
    """A warning must not split the streamed text: nothing is logged while responses are still coming."""
    import logging

    from dflash_mlx import api
    from dflash_mlx.decode.width import WidthPolicy, nominal_cost

    model, tokenizer, drafter = api.load(str(pair[0]), str(pair[1]))  # random drafter: drafts never accepted
    width = WidthPolicy(drafter.block_size, cost=nominal_cost)
    seen_during = []
    with caplog.at_level(logging.WARNING, logger="dflash_mlx"):
        responses = []
        for r in api.stream_generate(model, tokenizer, "hello", drafter, max_tokens=80, planner=width):
            responses.append(r)
            seen_during.append(any("acceptance collapsed" in x.getMessage() for x in caplog.records))
        after = [x for x in caplog.records if "acceptance collapsed" in x.getMessage()]
    assert responses[-1].finish_reason is not None
    assert not any(seen_during) and len(after) == 1


def test_collapse_causes_fit_what_the_engine_knows(pair):
    """The drafter picked for a target by name was made for it: the warning blames the prompt, not the pairing."""
    from dflash_mlx import api
    from dflash_mlx.decode.stats import AcceptanceStats, CollapseWatch

    stats = AcceptanceStats(adaptive=True)
    for _ in range(40):
        stats.record(0, 4)
    known = CollapseWatch(made_for="qwen2.5-coder-0.5b").check(stats)
    unknown = CollapseWatch().check(stats)
    assert "made for qwen2.5-coder-0.5b predicts it poorly on this kind of prompt" in known
    assert "another" not in known and "fine-tune" not in known
    assert "Likely causes" in unknown and "another fine-tune of this target" in unknown
    _, _, drafter = api.load(str(pair[0]), str(pair[1]))  # a drafter the user named: nothing is known of it
    assert drafter.made_for is None
