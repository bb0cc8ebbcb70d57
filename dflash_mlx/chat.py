"""`dflash-mlx chat`: a multi-turn REPL whose target and drafter caches carry over from turn to turn.

Each turn feeds only the tokens the conversation added since the last reply: the chat template is rendered for
the whole conversation and the part the model has already seen is cut off. When the rendering does not extend
what the model saw (some templates rewrite earlier turns, e.g. dropping thinking), the turn starts from fresh
caches instead: slower, never wrong. Ctrl-C stops the reply at a token boundary, so the caches stay exact.

No turn ends the chat: a line that is not UTF-8, a chat template that fails or refuses the conversation, a reply
that fails, each prints one `error:` line and the conversation goes on as it was; a failed turn is not recorded
(neither its user message nor an empty reply), so /save saves what really happened.
"""

from __future__ import annotations

import json
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

from . import console
from .decode.budget import DEFAULT_TREES
from .decode.lookup import drafter_model
from .decode.memory import PlannerMemory
from .decode.state import DecodeState
from .decode.stats import AcceptanceStats
from .chat_file import check_sampling, parse_conversation
from .errors import DFlashError
from .io_safety import write_text_atomic

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


class _PrefillStopped(Exception):
    """Raised from the prefill progress hook when the turn is stopped before its reply began."""


class ChatSession:
    """A conversation with one target/drafter pair; usable without the REPL (tests, notebooks)."""

    def __init__(self, model, tokenizer, drafter, *, system: Optional[str] = None, max_tokens: int = 1024,
                 width: Optional[int] = None, sampling: Optional[Dict] = None, thinking: Optional[bool] = None,
                 lookup: Optional[bool] = None, tree_budget=DEFAULT_TREES):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.model = model
        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
        self.drafter = drafter
        self.system = system
        self.max_tokens = max_tokens
        self.width = width  # verify width per pass (None: chosen each pass)
        self.lookup = lookup  # drafts copied from the conversation (earlier turns included); see api.stream_generate
        self.tree_budget = tree_budget  # drafted blocks verified as trees (None: chains); see api.stream_generate
        # What a turn measured (pass costs, acceptance, tree budgets) starts the next turn's planner.
        self.memory = PlannerMemory()
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
        """Write the conversation as JSON, atomically; a failed write raises a one-line DFlashError."""
        write_text_atomic(path, json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n")

    def load(self, path: str) -> None:
        """Replace the conversation with one saved by `save`; a bad file raises a DFlashError and changes nothing."""
        file = Path(path).expanduser()
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except OSError as e:
            raise DFlashError(f"cannot read {path}: {e.strerror or e}; check the path") from None
        except ValueError as e:  # bad JSON or bad UTF-8
            raise DFlashError(f"{path} is not valid JSON ({e}); give a file saved with /save") from None
        system, messages, sampling, thinking = parse_conversation(data, path)
        self.system, self.messages = system, messages
        self.sampling = dict(sampling or self.sampling)
        if "thinking" in data:
            self.thinking = thinking
        self._drop_caches()

    # -- one turn ----------------------------------------------------------------------------------------------
    def _render(self, messages: List[Dict[str, str]]) -> str:
        conversation = ([{"role": "system", "content": self.system}] if self.system else []) + messages
        extra = {} if self.thinking is None else {"enable_thinking": self.thinking}
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                      **extra)
        except Exception as e:  # a template that does not compile, or raises on this conversation (jinja, HF)
            reason = _one_line(e)
            if type(e).__name__ == "TemplateSyntaxError":
                hint = "the model's chat template does not compile: fix chat_template in its tokenizer_config.json"
            elif self.system and "system" in reason.lower():
                hint = "a bare /system clears the system prompt"
            else:
                hint = "/reset starts a new conversation"
            raise DFlashError(f"the chat template failed ({reason}); the message was not sent and the conversation "
                              f"is kept; {hint}") from None

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

        drafter = drafter_model(self.drafter)[0]  # "lookup": no drafter cache
        return DecodeState.fresh(prepare(self.model, drafter), drafter)

    def send(self, text: str, should_stop: Callable[[], bool] = lambda: False, *,
             prefill_progress: Optional[Callable[[int, int], None]] = None,
             warn: Optional[Callable[[str], None]] = None) -> Iterator[str]:
        """Add a user message and stream the reply's text; `should_stop` is polled between tokens and after each
        prefill chunk.

        The turn (user message and reply) is recorded when the reply ends or is stopped; a turn that fails (the
        template refuses the conversation, generation raises) records nothing and re-raises. A turn stopped
        before its first token (`should_stop` during prefill, or a KeyboardInterrupt there) records nothing
        either: `should_stop` ends the stream quietly, a KeyboardInterrupt is re-raised.
        `prefill_progress(done, total)` is called after each prefill chunk (a progress bar); `warn(line)` gets the
        over-context warning when the conversation is longer than the target's max_position_embeddings.
        """
        from .api import stream_generate
        from .validate import prompt_length_warning

        user = {"role": "user", "content": text}
        new = self._new_tokens(self._render(self.messages + [user]))
        if warn is not None:
            args = getattr(self.model, "args", None)
            message = prompt_length_warning(len(self.seen) + len(new), getattr(args, "max_position_embeddings", None))
            if message:
                warn(message)

        def progress(done: int, total: int) -> None:
            if prefill_progress is not None:
                prefill_progress(done, total)
            if should_stop():
                raise _PrefillStopped

        reply, response, stopped, failed = [], None, False, False
        try:
            if self.state is None:
                self.state = self._fresh_state()
            self.last_prefill_tokens = len(new) + (1 if self.seen else 0)
            self.seen.extend(new)
            stream = stream_generate(self.model, self.tokenizer, new, self.drafter, max_tokens=self.max_tokens,
                                     width=self.width, state=self.state, prefill_progress=progress,
                                     lookup=self.lookup, tree_budget=self.tree_budget, memory=self.memory,
                                     **self.sampling)
            try:
                for response in stream:
                    self.seen.append(response.token)
                    reply.append(response.token)
                    yield response.text
                    if should_stop():
                        stopped = True
                        break
            finally:
                stream.close()  # rolls back any queued cycle
        except _PrefillStopped:  # stopped before the reply began: the turn is not recorded
            failed = True
        except KeyboardInterrupt:  # Ctrl-C: a stop, kept, unless no token came yet (then nothing is recorded)
            failed = response is None
            raise
        except Exception:  # a failure; a close (GeneratorExit) is a stop: kept
            failed = True
            raise
        finally:
            if failed or stopped or response is None or response.finish_reason is None:
                # Stopped inside a verify pass (or failed): the caches hold tokens the reply never showed. Start the
                # next turn from fresh caches rather than trim what may not be trimmable (recurrent layers).
                self._drop_caches()
            if not failed:
                # The record holds the tokens' exact text (a streaming detokenizer may drop a leading space), so the
                # next turn's rendering extends what the caches saw and they are reused.
                eos = set(self.tokenizer.eos_token_ids)
                self.messages += [user, {"role": "assistant",
                                         "content": self.tokenizer.decode([t for t in reply if t not in eos])}]
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


def _one_line(e: BaseException) -> str:
    """An exception as one line: its message with whitespace collapsed (DFlashError's text as is, else the type
    first, since a bare message such as 'out of memory' may not say where it came from)."""
    text = " ".join(str(e).split())
    if isinstance(e, DFlashError):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


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
        current = session.sampling.get("temp") or 0.0
        try:
            value = float(arg)
            check_sampling({"temp": value})
        except (ValueError, DFlashError):
            print(f"error: /temp takes a finite number >= 0 (0 = greedy), got {arg!r}; the temperature stays "
                  f"{current}", file=out)
            return True
        session.sampling["temp"] = value
        print(f"temperature {value}", file=out)
    elif name == "/think":
        session.thinking = not (session.thinking if session.thinking is not None else True)
        session._drop_caches()
        print(f"thinking {'on' if session.thinking else 'off'}", file=out)
    elif name in ("/save", "/load") and not arg:
        print(f"usage: {name} FILE", file=out)
    elif name == "/save":
        try:
            session.save(arg)
            print(f"saved {len(session.messages)} messages to {arg}", file=out)
        except DFlashError as e:  # the conversation stays as it was
            print(f"error: {e}", file=out)
    elif name == "/load":
        try:
            session.load(arg)
            print(f"loaded {len(session.messages)} messages from {arg}", file=out)
        except DFlashError as e:
            print(f"error: {e}; the current conversation is kept", file=out)
    elif name == "/help":
        print(HELP, file=out)
    else:
        print(f"unknown command {line.strip()!r}; /help lists them", file=out)
    return True


NOT_UTF8 = "the line is not valid UTF-8 text; it was ignored and the conversation is kept"


@contextmanager
def _tolerant_decoding(stdin):
    """Decode stdin with surrogateescape while the REPL runs: a line of invalid UTF-8 then arrives as text with
    lone surrogates (refused by `_valid_text`) instead of raising mid-read, which can drop the lines buffered
    after it. Streams that cannot be reconfigured are left as they are."""
    reconfigure = getattr(stdin, "reconfigure", None)
    errors = getattr(stdin, "errors", None)
    try:
        if reconfigure is None or errors != "strict":
            raise ValueError
        reconfigure(errors="surrogateescape")
    except (ValueError, OSError):  # io refuses while decoded text is pending: `run_repl` catches the error then
        yield
        return
    try:
        yield
    finally:
        try:
            reconfigure(errors=errors)
        except (ValueError, OSError):  # text still pending (the user quit mid-input): the stream stays tolerant
            pass


STOPPED_IN_PREFILL = "[stopped before the reply began; the message was not sent and the conversation is kept]"


class _ChatPrefillBar:
    """`console.PrefillBar` for one turn, made on the first prefill chunk (when the prompt's size is known)."""

    def __init__(self):
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = console.PrefillBar(total)
        self.bar(done, total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _valid_text(line: str) -> bool:
    try:
        line.encode("utf-8")
        return True
    except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8
        return False


def run_repl(session: ChatSession, stdin=None, out=None) -> None:
    """Read user lines until /quit or end of input; stream each reply. A failing line or turn prints one
    `error:` line and the chat goes on."""
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    with _tolerant_decoding(stdin):
        _loop(session, stdin, out)


def _loop(session: ChatSession, stdin, out) -> None:
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
        except UnicodeDecodeError:  # a stream `_tolerant_decoding` could not reconfigure
            print(f"error: {NOT_UTF8}", file=out, flush=True)
            continue
        if not line:
            break
        if not line.strip():
            continue
        if not _valid_text(line):
            print(f"error: {NOT_UTF8}", file=out, flush=True)
            continue
        if line.startswith("/"):
            try:
                if not _command(session, line, out):
                    break
            except Exception as e:  # a command's unexpected failure (its expected ones print their own line)
                print(f"error: {_one_line(e)}; the conversation is kept", file=out, flush=True)
            continue
        stop = [False]
        printed = False
        bar = _ChatPrefillBar()
        turns = len(session.messages)
        try:
            with _sigint_sets_flag(stop):
                try:
                    for segment in session.send(line.rstrip("\n"), should_stop=lambda: stop[0],
                                                prefill_progress=bar, warn=console.warn):
                        bar.close()
                        print(segment, end="", file=out, flush=True)
                        printed = printed or bool(segment)
                finally:
                    bar.close()
        except KeyboardInterrupt:  # raised by a prefill hook; Ctrl-C itself sets `stop`
            stop[0] = True
        except Exception as e:  # a template or a reply that fails: say so in one line, keep the session
            message = _one_line(e)
            if not isinstance(e, DFlashError):
                message += "; the reply failed and the conversation is kept"
            print(f"{chr(10) if printed else ''}error: {message}", file=out, flush=True)
            continue
        if stop[0] and len(session.messages) == turns:
            print(f"{chr(10) if printed else ''}{STOPPED_IN_PREFILL}", file=out, flush=True)
        else:
            print("\n[stopped]" if stop[0] else "", file=out, flush=True)
