"""A new user's mistakes, one test per row: each ends in one `error:` / `warning:` line that says what to do, a
non-zero exit where nothing useful ran, and nothing of the user's lost or half-written.

Runs on the tiny offline demo pair; Ctrl-C and hub rows run the CLI in subprocesses.
"""

import errno
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dflash_mlx.chat import ChatSession, run_repl
from dflash_mlx.cli import main
from dflash_mlx.console import PrefillBar
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.errors import DFlashError
from dflash_mlx.validate import check_max_tokens, check_safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pair"))


def _run(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err, prefix="error: "):
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line and "tensor/s]" not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix) and "Traceback" not in err, err
    return lines[0]


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _env(**extra):
    env = dict(os.environ, DFLASH_MLX_NO_BLAS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


# -- convert: existing and non-empty outputs, atomic writes, full disk ---------------------------------------------
def test_convert_refuses_an_existing_model_folder(pair, tmp_path, capsys):
    out = tmp_path / "model"
    shutil.copytree(pair[0], out)
    before = _snapshot(out)
    code, _, err = _run(capsys, "convert", pair[1], out)
    assert code == 2 and "already holds a model" in _one_line(err) and "--force" in err
    assert _snapshot(out) == before  # the target's config and weights are untouched


def test_convert_refuses_a_non_empty_folder_unless_forced(pair, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = _run(capsys, "convert", pair[1], out)
    assert code == 2 and "not empty" in _one_line(err)
    assert (out / "notes.txt").read_text() == "mine"
    code, _, err = _run(capsys, "convert", pair[1], out, "--force")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left behind


def test_convert_on_a_full_disk_leaves_nothing_behind(pair, tmp_path, capsys, monkeypatch):
    from dflash_mlx.drafters import io as drafter_io

    real_open = open

    def full_disk_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if "w" in mode and str(file).endswith(".tmp"):
            def write(_data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            handle.write = write
        return handle

    monkeypatch.setattr(drafter_io, "open", full_disk_open, raising=False)
    code, _, err = _run(capsys, "convert", pair[1], tmp_path / "out")
    line = _one_line(err)
    assert code == 2 and "no space left" in line and "free some space" in line
    assert list(tmp_path.iterdir()) == []  # no half-written output, no temporary folder


def test_failed_forced_conversion_keeps_the_old_folder(pair, tmp_path, capsys):
    out = tmp_path / "out"
    assert _run(capsys, "convert", pair[1], out)[0] == 0
    before = _snapshot(out)
    broken = tmp_path / "broken"
    shutil.copytree(pair[1], broken)
    (broken / "model.safetensors").write_bytes(b"")
    code, _, err = _run(capsys, "convert", broken, out, "--force")
    assert code == 2 and "empty" in _one_line(err)
    assert _snapshot(out) == before


# -- weights files: 0 bytes, truncated; configs that disagree with weights; unknown model types -------------------
@pytest.mark.parametrize("which", ["target", "drafter"])
@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_broken_weights_file_is_named_with_its_fix(pair, tmp_path, capsys, which, damage):
    folder = tmp_path / which
    shutil.copytree(pair[0] if which == "target" else pair[1], folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    target, drafter = (folder, pair[1]) if which == "target" else (pair[0], folder)
    code, _, err = _run(capsys, "generate", "-m", target, "-d", drafter, "-p", "hi", "--max-tokens", "2")
    line = _one_line(err)
    assert code == 2 and str(weights) in line and ("download" in line or "convert" in line), line


def test_check_safetensors_rejects_a_garbled_header(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes((16).to_bytes(8, "little") + b"{not json at all")
    with pytest.raises(DFlashError, match="garbled header"):
        check_safetensors(bad)


@pytest.mark.parametrize("change,needle", [
    ({"intermediate_size": 96}, "do not match"),  # same layer count, other widths
    ({"num_hidden_layers": 1, "layer_types": ["full_attention"]}, "unexpected tensor"),
    ({"num_hidden_layers": 3}, "layer_types"),
])
def test_drafter_config_that_disagrees_with_its_weights(pair, tmp_path, capsys, change, needle):
    drafter = tmp_path / "drafter"
    shutil.copytree(pair[1], drafter)
    config = json.loads((drafter / "config.json").read_text())
    config.update(change)
    (drafter / "config.json").write_text(json.dumps(config))
    code, _, err = _run(capsys, "generate", "-m", pair[0], "-d", drafter, "-p", "hi")
    line = _one_line(err)
    assert code == 2 and needle in line and ("config.json" in line), line


@pytest.mark.parametrize("model_type", [None, "mamba_x"])
def test_target_without_or_with_unknown_model_type(pair, tmp_path, capsys, model_type):
    target = tmp_path / "target"
    shutil.copytree(pair[0], target)
    config = json.loads((target / "config.json").read_text())
    config.pop("model_type")
    if model_type:
        config["model_type"] = model_type
    (target / "config.json").write_text(json.dumps(config))
    code, _, err = _run(capsys, "generate", "-m", target, "-d", pair[1], "-p", "hi")
    line = _one_line(err)
    assert code == 2 and ("no model_type" in line if model_type is None else "mamba_x" in line), line


def test_drafter_that_is_another_kind_of_model(pair, capsys):
    # A target folder passed as the drafter: its config is an mlx-lm model's, not a DFlash drafter's.
    code, _, err = _run(capsys, "generate", "-m", pair[0], "-d", pair[0], "-p", "hi")
    assert code == 2 and "not a DFlash drafter" in _one_line(err)


# -- flags ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-5", "-2"])
def test_max_tokens_takes_minus_one_or_a_positive_count(pair, capsys, value):
    for command in (["generate", "-p", "hi"], ["chat"]):
        code, _, err = _run(capsys, *command, "-m", pair[0], "-d", pair[1], "--max-tokens", value)
        assert code == 2 and "-1 for no limit" in _one_line(err) and value in err
    check_max_tokens(-1)
    check_max_tokens(1)


def test_width_past_the_drafters_block_warns(pair, capsys):
    code, out, err = _run(capsys, "generate", "-m", pair[0], "-d", pair[1], "-p", "hi", "--max-tokens", "3",
                          "--width", "1000")
    assert code == 0, err
    line = _one_line(err, prefix="warning: ")
    assert "--width 1000" in line and "block size 4" in line and "--width 4" in line
    assert out.strip()


def test_prompt_longer_than_the_target_was_trained_for_warns(pair, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(pair[0], target)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = 16
    (target / "config.json").write_text(json.dumps(config))
    code, _, err = _run(capsys, "generate", "-m", target, "-d", pair[1], "-p", "word " * 40, "--max-tokens", "2")
    assert code == 0, err
    line = _one_line(err, prefix="warning: ")
    assert "max_position_embeddings (16)" in line and "shorten the prompt" in line


def test_bench_prompts_file_that_does_not_exist(pair, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    code, _, err = _run(capsys, "bench", "-m", pair[0], "-d", pair[1], "--prompts", missing)
    line = _one_line(err)
    assert code == 2 and "does not exist" in line and str(missing) in line


def test_bench_prompts_that_are_neither_a_set_nor_a_file(tmp_path):
    from dflash_mlx.bench.prompts import load_prompts

    with pytest.raises(DFlashError, match="neither humaneval nor mtbench nor editing nor an existing .jsonl file"):
        load_prompts("humaneva")
    with pytest.raises(DFlashError, match="is a folder"):
        load_prompts(str(tmp_path))


def test_chat_history_that_does_not_exist(pair, tmp_path, capsys):
    code, _, err = _run(capsys, "chat", "-m", pair[0], "-d", pair[1], "--history", tmp_path / "none.json")
    assert code == 2 and "does not exist" in _one_line(err)


# -- chat commands never end the session ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def session(pair):
    from dflash_mlx import load

    return ChatSession(*load(str(pair[0]), str(pair[1])), max_tokens=3)


BAD_CONVERSATIONS = {
    "messages_not_a_list": {"messages": 5},
    "messages_not_objects": {"messages": [1, 2]},
    "unknown_role": {"messages": [{"role": "robot", "content": "x"}]},
    "content_not_text": {"messages": [{"role": "user", "content": ["x"]}]},
    "bad_sampling": {"messages": [], "sampling": {"temp": -3}},
    "top_level_list": [],
}


@pytest.mark.parametrize("name", list(BAD_CONVERSATIONS) + ["not_json", "missing"])
def test_chat_load_of_a_bad_file_keeps_the_conversation(session, tmp_path, name):
    path = tmp_path / f"{name}.json"
    if name == "not_json":
        path.write_text("{oops")
    elif name != "missing":
        path.write_text(json.dumps(BAD_CONVERSATIONS[name]))
    session.reset()
    out = io.StringIO()
    run_repl(session, stdin=io.StringIO(f"first\n/load {path}\nsecond\n/quit\n"), out=out)
    errors = [line for line in out.getvalue().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(path) in errors[0] and "kept" in errors[0], out.getvalue()
    # The conversation went on: both turns are there, and the bad file changed nothing.
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["first", "second"]


def test_chat_save_to_a_bad_path_keeps_the_conversation(session, tmp_path):
    session.reset()
    out = io.StringIO()
    bad = "/nonexistent/dir/x.json"
    run_repl(session, stdin=io.StringIO(f"hello\n/save {bad}\n/save\nagain\n/quit\n"), out=out)
    lines = out.getvalue().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and bad in errors[0] and "does not exist" in errors[0], lines
    assert "usage: /save FILE" in lines
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2


def test_chat_save_on_a_full_disk_keeps_the_old_file(session, tmp_path, monkeypatch):
    path = tmp_path / "conv.json"
    path.write_text('{"messages": []}')

    def full_disk(fd, *args, **kwargs):
        handle = io.TextIOWrapper(io.FileIO(fd, "w"))

        def write(_data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        handle.write = write
        return handle

    monkeypatch.setattr(os, "fdopen", full_disk)
    with pytest.raises(DFlashError, match="no space left"):
        session.save(str(path))
    monkeypatch.undo()
    assert path.read_text() == '{"messages": []}'
    assert [p.name for p in tmp_path.iterdir()] == ["conv.json"]  # the temporary file is gone


def test_chat_round_trip_after_validation(session, tmp_path):
    session.reset()
    "".join(session.send("hi"))
    path = tmp_path / "ok.json"
    session.save(str(path))
    other = ChatSession(session.model, session.tokenizer, session.drafter)
    other.load(str(path))
    assert other.messages == session.messages and other.sampling == session.sampling


# -- prefill progress bar ----------------------------------------------------------------------------------------
def test_prefill_bar_only_for_long_prompts(capsys):
    short = PrefillBar(100)
    short(50, 100)
    short(100, 100)
    assert capsys.readouterr().err == ""
    long = PrefillBar(5000)
    for done in (2048, 4096, 5000):
        long(done, 5000)
    err = capsys.readouterr().err
    assert "prefill" in err and "4096/5000" in err and "5000/5000" in err


def test_cli_drives_the_prefill_bar_when_the_engine_reports_progress(pair, capsys):
    code, _, err = _run(capsys, "generate", "-m", pair[0], "-d", pair[1], "-p", "hello " * 1200,
                        "--ignore-chat-template", "--max-tokens", "2")
    assert code == 0 and "prefill" in err


# -- an unreachable hub ------------------------------------------------------------------------------------------
@pytest.fixture()
def no_hub(tmp_path, monkeypatch):
    """An empty hub cache and drafter cache; huggingface_hub reads its settings at call time from `constants`."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "home"))
    return constants


@pytest.mark.parametrize("setting", ["offline", "closed-port"])
@pytest.mark.parametrize("which", ["target", "drafter"])
def test_unreachable_hub_is_one_line(pair, no_hub, monkeypatch, capsys, setting, which):
    if setting == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(no_hub, "HF_HUB_OFFLINE", True)
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(no_hub, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(no_hub, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
        monkeypatch.setattr(no_hub, "HUGGINGFACE_CO_URL_TEMPLATE", "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}")
    target, drafter = ("someorg/no-such-target", pair[1]) if which == "target" else (pair[0], "someorg/no-drafter")
    code, _, err = _run(capsys, "generate", "-m", target, "-d", drafter, "-p", "hi")
    line = _one_line(err)
    assert code == 2 and line.startswith("error: could not download " + which), line
    assert ("offline" in line) if setting == "offline" else ("cannot be reached" in line), line


# -- Ctrl-C ------------------------------------------------------------------------------------------------------
_INTERRUPT_ON_IMPORT = """
import os, signal, sys
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Hook())
from dflash_mlx.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_ctrl_c_during_imports_exits_quietly(pair):
    # While the CLI module loads its parts (SIGINT as it imports its first package module; the heavy ones, such as
    # the train command's mlx-lm, load in the same window). Imports inside a command take the path tested below.
    module = "dflash_mlx.models.offline"
    done = subprocess.run([sys.executable, "-c", _INTERRUPT_ON_IMPORT, module, "generate", "-m", str(pair[0]),
                           "-d", str(pair[1]), "-p", "hi"], capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr


def test_ctrl_c_during_generation_ends_the_line_and_prints_stats(pair):
    proc = subprocess.Popen([sys.executable, "-m", "dflash_mlx.cli", "generate", "-m", str(pair[0]), "-d",
                             str(pair[1]), "-p", "tell me a story", "--max-tokens", "-1", "--verbose"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    try:
        text, deadline = b"", time.time() + 90
        while len(text) < 20 and time.time() < deadline:  # wait for generated text
            if select.select([proc.stdout], [], [], 1.0)[0]:
                text += os.read(proc.stdout.fileno(), 4096)
        assert text, "no output before the deadline"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    out, err = (text + out).decode(errors="replace"), err.decode(errors="replace")
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted", err
    assert "\n==========\n" in out and "Generation:" in out and "Acceptance: tau" in out, out
    generated = int(out.split("Generation: ")[1].split(" tokens")[0])
    assert generated > 0


def test_a_real_full_disk_when_a_tmpfs_can_be_mounted(pair, tmp_path, capsys):
    # The monkeypatched rows above run everywhere; this one fills a real 160 KB tmpfs, where mounting is allowed.
    from test_gguf import CONFIGS, _export, _tiny

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        # The drafter converter (Python writes) and the GGUF converter (MLX's writer) on a disk too small for them.
        code, _, err = _run(capsys, "convert", pair[1], disk / "drafter", "--dtype", "fp32")
        assert code == 2 and "no space left" in _one_line(err)
        gguf = _export(_tiny("llama"), CONFIGS["llama"], "llama", tmp_path / "m.gguf")  # about 330 KB of fp32
        code, _, err = _run(capsys, "convert", "--gguf", gguf, disk / "model")
        assert code == 2 and "no space left" in _one_line(err)
        assert list(disk.iterdir()) == []  # nothing half-written left on the full disk
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
