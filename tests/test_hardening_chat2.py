"""`dflash-mlx chat`, more rows: invalid sampling values refused when set or loaded, Ctrl-C during prefill, the
prefill bar and over-context warning `generate` shows, /save through a symlink, --history given a folder.
Tiny in-code pair, stdin fed in code."""

from __future__ import annotations

import io
import json
import os
import signal

import pytest

from dflash_mlx import console, load
from dflash_mlx.chat import ChatSession, run_repl
from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("hardening-chat2"))


@pytest.fixture(scope="module")
def session(pair):
    return ChatSession(*load(str(pair[0]), str(pair[1])), max_tokens=3)


def _repl(session, text: str) -> str:
    out = io.StringIO()
    run_repl(session, stdin=io.StringIO(text), out=out)
    return out.getvalue()


def _errors(text: str):
    assert "Traceback" not in text, text
    return [line for line in text.splitlines() if line.startswith("error: ")]


# -- 1. invalid sampling values ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "abc"])
def test_temp_refuses_invalid_values_and_keeps_the_previous_one(session, value):
    session.reset()
    session.sampling = {"temp": 0.0}
    text = _repl(session, f"/temp 0.5\n/temp {value}\nhello\n/quit\n")
    errors = _errors(text)
    assert len(errors) == 1 and "/temp" in errors[0] and "stays 0.5" in errors[0], text
    assert session.sampling["temp"] == 0.5
    assert [m["role"] for m in session.messages] == ["user", "assistant"]  # the reply did not fail
    session.sampling = {"temp": 0.0}


@pytest.mark.parametrize("bad", [{"repetition_penalty": -3}, {"temp": float("inf")}, {"seed": -1},
                                 {"repetition_context_size": 0}, {"top_p": 2}])
def test_load_refuses_invalid_sampling_and_changes_nothing(session, tmp_path, bad):
    session.reset()
    session.sampling = {"temp": 0.0}
    "".join(session.send("first"))
    kept = [dict(m) for m in session.messages]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"system": None, "messages": [{"role": "user", "content": "x"}], "sampling": bad}))
    text = _repl(session, f"/load {path}\nnext\n/quit\n")
    errors = _errors(text)
    assert len(errors) == 1 and "sampling" in errors[0] and "kept" in errors[0], text
    assert session.sampling == {"temp": 0.0}
    assert session.messages[:2] == kept and len(session.messages) == 4  # the next reply worked


# -- 2. prefill: Ctrl-C, bar, over-context warning ---------------------------------------------------------------
def _interrupting_bar(kind):
    class Bar:
        def __init__(self, prompt_tokens):
            pass

        def __call__(self, done, total):
            if kind == "raise":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C pressed during prefill

        def close(self):
            pass

    return Bar


@pytest.mark.parametrize("kind", ["raise", "sigint"])
def test_ctrl_c_during_prefill_stops_the_turn_and_keeps_the_conversation(session, monkeypatch, kind):
    session.reset()
    "".join(session.send("first"))
    kept = [dict(m) for m in session.messages]
    before = signal.getsignal(signal.SIGINT)
    with monkeypatch.context() as m:
        m.setattr(console, "PrefillBar", _interrupting_bar(kind))
        text = _repl(session, "a very long prompt\n/quit\n")
    assert "Traceback" not in text and not _errors(text)
    assert "stopped before the reply began" in text, text
    assert session.messages == kept  # the interrupted turn is not stored
    assert session.state is None
    assert signal.getsignal(signal.SIGINT) is before
    text = _repl(session, "again\n/quit\n")  # the chat goes on
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["first", "again"]


def test_long_prompt_shows_the_prefill_bar_and_the_over_context_warning(session, monkeypatch, capsys):
    session.reset()
    monkeypatch.setattr("dflash_mlx.console.LONG_PROMPT_TOKENS", 2)
    monkeypatch.setattr(session.model.args, "max_position_embeddings", 4)
    capsys.readouterr()
    _repl(session, "a prompt longer than four tokens\n/quit\n")
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "max_position_embeddings" in warnings[0], err
    assert "prefill" in err, err
    assert [m["role"] for m in session.messages] == ["user", "assistant"]


# -- 3. /save through a symlink ----------------------------------------------------------------------------------
def test_save_onto_a_symlink_writes_through_it(session, tmp_path):
    session.reset()
    real = tmp_path / "real" / "conv.json"
    real.parent.mkdir()
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    text = _repl(session, f"hello\n/save {link}\n/quit\n")
    assert not _errors(text)
    assert link.is_symlink() and os.readlink(link) == str(real)
    saved = json.loads(real.read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    assert [p.name for p in real.parent.iterdir()] == ["conv.json"]  # no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real"]


# -- 4. --history given a folder ---------------------------------------------------------------------------------
def test_chat_history_that_is_a_folder(pair, tmp_path, capsys):
    capsys.readouterr()
    code = main(["chat", "-m", str(pair[0]), "-d", str(pair[1]), "--history", str(tmp_path)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "is a folder" in lines[0] and "/save" in lines[0] and "does not exist" not in lines[0], err
