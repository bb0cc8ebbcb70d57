"""`dflash-mlx chat` survives every per-turn failure: invalid UTF-8 on stdin, a chat template that does not compile
or refuses the conversation, a reply that fails. Each prints one `error:` line, the chat goes on, and a failed turn
leaves no trace in the conversation (so /save saves what really happened). Tiny in-code pair, stdin fed in code."""

from __future__ import annotations

import io
import json
from contextlib import contextmanager

import pytest

from dflash_mlx import load
from dflash_mlx.chat import ChatSession, run_repl
from dflash_mlx.demo import CHAT_TEMPLATE, make_tiny_pair
from dflash_mlx.errors import DFlashError

NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             + CHAT_TEMPLATE)
ALTERNATE = ("{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
             "{% endif %}{% endfor %}" + CHAT_TEMPLATE)
BROKEN = "{% for message in messages %}{{ message['content'] }"  # does not compile


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("hardening-chat"))
    return ChatSession(*load(str(target_dir), str(drafter_dir)), max_tokens=3)


@contextmanager
def _template(session, text):
    hf = session.tokenizer._tokenizer
    before = hf.chat_template
    hf.chat_template = text
    try:
        yield
    finally:
        hf.chat_template = before


def _repl(session, text: str = "", raw: bytes = None):
    """Run the REPL on these stdin lines (`raw`: bytes, decoded as a terminal's UTF-8 stdin); returns its output."""
    stdin = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8") if raw is not None else io.StringIO(text)
    out = io.StringIO()
    run_repl(session, stdin=stdin, out=out)
    return out.getvalue()


def _errors(text: str):
    assert "Traceback" not in text, text
    return [line for line in text.splitlines() if line.startswith("error: ")]


def _saved(path):
    return json.loads(path.read_text())["messages"]


def test_invalid_utf8_line_is_one_error_and_the_chat_goes_on(session, tmp_path):
    session.reset()
    path = tmp_path / "conv.json"
    text = _repl(session, raw=b"hello\n\xff\xfe broken \xc3\n/save " + str(path).encode() + b"\nagain\n/quit\n")
    errors = _errors(text)
    assert len(errors) == 1 and "UTF-8" in errors[0], text
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["hello", "again"]
    assert [m["content"] for m in _saved(path) if m["role"] == "user"] == ["hello"]


def test_template_that_does_not_compile(session, tmp_path):
    session.reset()
    path = tmp_path / "conv.json"
    with _template(session, BROKEN):
        text = _repl(session, f"hello\nagain\n/save {path}\n/quit\n")
    errors = _errors(text)
    assert len(errors) == 2 and all("chat template" in e for e in errors), text
    assert session.messages == [] and _saved(path) == []  # failed turns are not stored, not even the user's line


def test_system_role_not_supported_after_system(session, tmp_path):
    session.set_system(None)
    path = tmp_path / "conv.json"
    with _template(session, NO_SYSTEM):
        text = _repl(session, f"hello\n/system be brief\nsecond\n/system\nthird\n/save {path}\n/quit\n")
    errors = _errors(text)
    assert len(errors) == 1 and "System role not supported" in errors[0] and "/system" in errors[0], text
    # /system starts a new conversation; the refused turn left nothing in it; the chat went on after clearing it.
    assert [m["content"] for m in _saved(path) if m["role"] == "user"] == ["third"]
    assert all(m["content"] or m["role"] != "assistant" for m in _saved(path))
    session.set_system(None)


def test_roles_must_alternate_after_load(session, tmp_path):
    session.reset()
    conversation = tmp_path / "two-users.json"
    conversation.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                                     {"role": "user", "content": "b"}]}))
    path = tmp_path / "conv.json"
    with _template(session, ALTERNATE):
        text = _repl(session, f"/load {conversation}\nnext\n/save {path}\n/quit\n")
    errors = _errors(text)
    assert len(errors) == 1 and "must alternate" in errors[0], text
    assert _saved(path) == [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]  # intact
    session.reset()


@pytest.mark.parametrize("failure", [DFlashError("the prompt is too long"), RuntimeError("out of memory\nat x")])
def test_a_failed_reply_is_not_stored(session, tmp_path, monkeypatch, failure):
    import dflash_mlx.api as api

    session.reset()
    "".join(session.send("first"))
    kept = [dict(m) for m in session.messages]
    real = api.stream_generate

    def failing(*args, **kwargs):
        yield from []
        raise failure

    monkeypatch.setattr(api, "stream_generate", failing)
    text = _repl(session, "second\n/quit\n")
    errors = _errors(text)
    assert len(errors) == 1 and str(failure).splitlines()[0] in errors[0], text
    assert session.messages == kept and session.state is None  # caches that saw the failed turn are dropped
    monkeypatch.setattr(api, "stream_generate", real)
    "".join(session.send("third"))  # the session works on
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["first", "third"]
