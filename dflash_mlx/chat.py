"""`dflash-mlx chat`: a multi-turn REPL whose target and drafter caches carry over from turn to turn.

Each turn feeds only the tokens the conversation added since the last reply: the chat template is rendered for
the whole conversation and the part the model has already seen is cut off. When the rendering does not extend
what the model saw (some templates rewrite earlier turns, e.g. dropping thinking), the turn starts from fresh
caches instead: slower, never wrong. Ctrl-C stops the reply at a token boundary, so the caches stay exact.
"""

from __future__ import annotations

import json
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

from .engine import DecodeState
from .errors import DFlashError
from .stats import AcceptanceStats

HELP = """commands:
  /reset           forget the conversation (keeps the system prompt)
  /stats           speed and acceptance of the last reply
  /system TEXT     set the system prompt (starts a new conversation)
  /temp T          sampling temperature (0 = greedy)
  /think           toggle the thinking mode of models that have one
  /save FILE       save the conversation as JSON
  /load FILE       load a conversation saved with /save
  /help            this text
  /quit            leave (Ctrl-D works too)
Ctrl-C stops the current reply and keeps the conversation."""


class ChatSession:
    """A conversation with one target/drafter pair; usable without the REPL (tests, notebooks)."""

    def __init__(self, model, tokenizer, drafter, *, system: Optional[str] = None, max_tokens: int = 1024,
                 block_size: Optional[int] = None, sampling: Optional[Dict] = None, thinking: Optional[bool] = None):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.model = model
        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
        self.drafter = drafter
        self.system = system
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.sampling: Dict = dict(sampling or {})
        self.thinking = thinking
        self.messages: List[Dict[str, str]] = []
        self.last_stats: Optional[AcceptanceStats] = None
        self.last_speed = (0.0, 0.0, 0)  # prompt tok/s, generation tok/s, tokens
        self.last_prefill_tokens = 0
        self.reset()

    # -- conversation state ----------------------------------------------------------------------------------
    def reset(self) -> None:
        self.messages = []
        self._drop_caches()

    def _drop_caches(self) -> None:
        self.state: Optional[DecodeState] = None
        self.seen: List[int] = []  # every token the caches have seen, plus the last committed one

    def set_system(self, text: Optional[str]) -> None:
        self.system = text or None
        self.reset()

    def to_json(self) -> Dict:
        return {"system": self.system, "messages": self.messages, "sampling": self.sampling,
                "thinking": self.thinking}

    def save(self, path: str) -> None:
        Path(path).expanduser().write_text(json.dumps(self.to_json(), indent=2, ensure_ascii=False))

    def load(self, path: str) -> None:
        try:
            data = json.loads(Path(path).expanduser().read_text())
            messages = data["messages"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DFlashError(f"cannot load a conversation from {path}: {e}") from e
        self.system = data.get("system")
        self.sampling = dict(data.get("sampling") or self.sampling)
        self.thinking = data.get("thinking", self.thinking)
        self.messages = list(messages)
        self._drop_caches()

    # -- one turn ----------------------------------------------------------------------------------------------
    def _render(self, messages: List[Dict[str, str]]) -> str:
        conversation = ([{"role": "system", "content": self.system}] if self.system else []) + messages
        extra = {} if self.thinking is None else {"enable_thinking": self.thinking}
        return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **extra)

    def _new_tokens(self, rendered: str) -> List[int]:
        """Tokens to feed this turn; drops the caches when the rendering does not extend what was seen."""
        if self.state is not None and self.seen:
            seen_text = self.tokenizer.decode(self.seen)
            if rendered.startswith(seen_text):
                suffix = rendered[len(seen_text):]
                if suffix:
                    return self.tokenizer.encode(suffix, add_special_tokens=False)
        self._drop_caches()
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def _fresh_state(self) -> DecodeState:
        from .api import prepare

        return DecodeState.fresh(prepare(self.model, self.drafter), self.drafter)

    def send(self, text: str, should_stop: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Add a user message and stream the reply's text; `should_stop` is polled between tokens."""
        from .api import stream_generate

        self.messages.append({"role": "user", "content": text})
        new = self._new_tokens(self._render(self.messages))
        if self.state is None:
            self.state = self._fresh_state()
        self.last_prefill_tokens = len(new) + (1 if self.seen else 0)
        self.seen.extend(new)
        reply, response, stopped = "", None, False
        stream = stream_generate(self.model, self.tokenizer, new, self.drafter, max_tokens=self.max_tokens,
                                 block_size=self.block_size, state=self.state, **self.sampling)
        try:
            for response in stream:
                self.seen.append(response.token)
                reply += response.text
                yield response.text
                if should_stop():
                    stopped = True
                    break
        finally:
            stream.close()  # rolls back any queued cycle
            if stopped or response is None or response.finish_reason is None:
                # Stopped inside a verify pass: the caches hold tokens the reply never showed. Start the next
                # turn from fresh caches rather than trim what may not be trimmable (recurrent layers).
                self._drop_caches()
            self.messages.append({"role": "assistant", "content": reply})
            if response is not None:
                self.last_stats = response.stats
                self.last_speed = (response.prompt_tps, response.generation_tps, response.generation_tokens)

    def stats_text(self) -> str:
        if self.last_stats is None:
            return "no reply yet"
        prompt_tps, gen_tps, n = self.last_speed
        s = self.last_stats
        lines = [f"last reply: {n} tokens, {gen_tps:.2f} tok/s (prompt {prompt_tps:.1f} tok/s, "
                 f"{self.last_prefill_tokens} new prompt tokens)"]
        if s.cycles:
            lines.append(f"tau {s.tau:.2f} over {s.cycles} verify passes; tokens committed per pass:")
            lines.append(s.format_histogram())
        return "\n".join(lines)


@contextmanager
def _sigint_sets_flag(flag: List[bool]):
    """While active, Ctrl-C sets flag[0] instead of raising, so a reply stops between two tokens."""
    def handler(signum, frame):
        flag[0] = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _command(session: ChatSession, line: str, out) -> bool:
    """Run a /command; returns False when the REPL should end."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/reset":
        session.reset()
        print("conversation cleared", file=out)
    elif name == "/stats":
        print(session.stats_text(), file=out)
    elif name == "/system":
        session.set_system(arg)
        print(f"system prompt {'set' if arg else 'cleared'}; new conversation", file=out)
    elif name == "/temp":
        try:
            value = float(arg)
            if value < 0:
                raise ValueError
        except ValueError:
            print("usage: /temp T with T >= 0", file=out)
            return True
        session.sampling["temp"] = value
        print(f"temperature {value}", file=out)
    elif name == "/think":
        session.thinking = not (session.thinking if session.thinking is not None else True)
        session._drop_caches()
        print(f"thinking {'on' if session.thinking else 'off'}", file=out)
    elif name == "/save" and arg:
        session.save(arg)
        print(f"saved {len(session.messages)} messages to {arg}", file=out)
    elif name == "/load" and arg:
        try:
            session.load(arg)
            print(f"loaded {len(session.messages)} messages from {arg}", file=out)
        except DFlashError as e:
            print(f"error: {e}", file=out)
    elif name == "/help":
        print(HELP, file=out)
    else:
        print(f"unknown command {line.strip()!r}; /help lists them", file=out)
    return True


def run_repl(session: ChatSession, stdin=None, out=None) -> None:
    """Read user lines until /quit or end of input; stream each reply."""
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    interactive = stdin.isatty()
    print("dflash-mlx chat: /help for commands, /quit to leave.", file=out, flush=True)
    while True:
        if interactive:
            print(">> ", end="", file=out, flush=True)
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            print("", file=out)
            continue
        if not line:
            break
        if not line.strip():
            continue
        if line.startswith("/"):
            if not _command(session, line, out):
                break
            continue
        stop = [False]
        with _sigint_sets_flag(stop):
            for segment in session.send(line.rstrip("\n"), should_stop=lambda: stop[0]):
                print(segment, end="", file=out, flush=True)
        print("\n[stopped]" if stop[0] else "", file=out, flush=True)
