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


def _encode_conversation(tokenizer, messages):
    """The whole conversation as the model should see it, rendered and encoded without the session's code."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _greedy_reply(model, tokenizer, prompt, n):
    """mlx-lm's greedy reply, up to and including EOS."""
    out = _greedy(model, prompt, n)
    stop = next((i + 1 for i, t in enumerate(out) if t in set(tokenizer.eos_token_ids)), len(out))
    return out[:stop]


# First turns whose greedy replies re-encode to the same tokens on this pair (asserted below), so the encoding of
# the whole conversation extends what the caches hold and the exact prefill count is known in advance.
@pytest.mark.parametrize("first,max_tokens", [("What is 2 + 2?", 6), ("def add(a, b):", 12)])
def test_second_turn_prefills_only_new_tokens_and_stays_lossless(pair, first, max_tokens):
    model, tokenizer, drafter = pair
    session = ChatSession(model, tokenizer, drafter, max_tokens=max_tokens)
    second = "And a second question"

    "".join(session.send(first))
    prompt1 = _encode_conversation(tokenizer, [{"role": "user", "content": first}])
    reply1 = _greedy_reply(model, tokenizer, prompt1, max_tokens)
    assert session.seen == prompt1 + reply1  # the first reply is plain greedy decoding
    assert session.state.target_cache[0].offset == len(prompt1) + len(reply1) - 1  # newest token not yet in it
    text1 = _text(tokenizer, reply1)
    assert session.messages[-1] == {"role": "assistant", "content": text1}

    text2 = "".join(session.send(second))
    full = _encode_conversation(tokenizer, [{"role": "user", "content": first},
                                            {"role": "assistant", "content": text1},
                                            {"role": "user", "content": second}])
    # The first reply re-encodes to the same tokens, so the conversation's encoding extends them ...
    assert full[: len(prompt1) + len(reply1)] == prompt1 + reply1
    # ... and the second turn feeds exactly the rest: the first reply's last token plus the new turn's tokens.
    assert session.last_prefill_tokens == len(full) - len(prompt1) - len(reply1) + 1
    # The second reply is exactly mlx-lm's greedy reply to the whole conversation, encoded from scratch.
    reply2 = _greedy_reply(model, tokenizer, full, max_tokens)
    assert session.seen == full + reply2
    assert text2.strip() == _text(tokenizer, reply2).strip()
    assert session.state.target_cache[0].offset == len(full) + len(reply2) - 1


def _text(tokenizer, tokens):
    return tokenizer.decode([t for t in tokens if t not in set(tokenizer.eos_token_ids)])


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

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN when run in the background
    run_repl(session, stdin=Stdin("tell me a long story\nnext\n/quit\n"), out=out)
    assert "[stopped]" in out.getvalue()
    roles = [m["role"] for m in session.messages]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert session.messages[0]["content"] == "tell me a long story"
    # The REPL went on after the interrupt, and the SIGINT handling it found is back.
    assert signal.getsignal(signal.SIGINT) is before
