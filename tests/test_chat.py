"""The chat REPL on a tiny offline pair: cache reuse across turns, commands, and Ctrl-C keeping the conversation."""

import io
import json
import os
import signal

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx import load
from dflash_mlx.chat import ChatSession, run_repl
from dflash_mlx.demo import make_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("chat"))
    return load(str(target_dir), str(drafter_dir))


def _greedy(model, tokens, n):
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n)]


def test_second_turn_prefills_only_new_tokens_and_stays_lossless(pair):
    model, tokenizer, drafter = pair
    session = ChatSession(model, tokenizer, drafter, max_tokens=12)
    "".join(session.send("Hello there"))
    seen_after_first = len(session.seen)
    offset_after_first = session.state.target_cache[0].offset
    assert offset_after_first == seen_after_first - 1  # the last committed token is not in the cache yet

    "".join(session.send("And a second question"))
    new_prompt = session.last_prefill_tokens
    rendered = session._render(session.messages[:-1])
    full_prompt = tokenizer.encode(rendered, add_special_tokens=False)
    # Only the tokens the conversation added since the first reply were prefilled.
    assert new_prompt < len(full_prompt) // 2 + 2
    assert session.state.target_cache[0].offset == len(session.seen) - 1

    # The second reply is exactly what plain greedy decoding of the whole conversation gives.
    reply = session.seen[seen_after_first - 1 + new_prompt:]
    prompt = session.seen[: len(session.seen) - len(reply)]
    assert reply == _greedy(model, prompt, len(reply))[: len(reply)]


def test_reset_and_system_clear_the_conversation(pair):
    model, tokenizer, drafter = pair
    session = ChatSession(model, tokenizer, drafter, max_tokens=4)
    "".join(session.send("hi"))
    out = io.StringIO()
    run_repl(session, stdin=io.StringIO("/reset\n/quit\n"), out=out)
    assert session.messages == [] and session.state is None
    assert "conversation cleared" in out.getvalue()


def test_save_load_and_stats(pair, tmp_path):
    model, tokenizer, drafter = pair
    session = ChatSession(model, tokenizer, drafter, max_tokens=5)
    path = tmp_path / "conv.json"
    out = io.StringIO()
    run_repl(session, stdin=io.StringIO(f"hello\n/stats\n/temp 0.5\n/save {path}\n/quit\n"), out=out)
    text = out.getvalue()
    assert "tok/s" in text and "tau" in text
    saved = json.loads(path.read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    assert saved["sampling"]["temp"] == 0.5
    other = ChatSession(model, tokenizer, drafter)
    other.load(str(path))
    assert other.messages == saved["messages"] and other.state is None


class _InterruptOnFirstToken(io.StringIO):
    """An output stream that presses Ctrl-C (SIGINT to this process) when the reply's first text arrives."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def write(self, s):
        if self.armed and s:
            self.armed = False
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(s)


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(pair):
    model, tokenizer, drafter = pair
    session = ChatSession(model, tokenizer, drafter, max_tokens=500)
    out = _InterruptOnFirstToken()

    class Stdin(io.StringIO):
        def readline(self):
            line = super().readline()
            out.armed = line == "tell me a long story\n"
            return line

    run_repl(session, stdin=Stdin("tell me a long story\nnext\n/quit\n"), out=out)
    assert "[stopped]" in out.getvalue()
    roles = [m["role"] for m in session.messages]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert session.messages[0]["content"] == "tell me a long story"
    # The REPL went on after the interrupt, and Python's own SIGINT handling is back.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
