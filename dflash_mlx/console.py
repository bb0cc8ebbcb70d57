"""What `generate` and `chat` do around the model on the command line: load with checks, warn, stream, summarize.

- `load_checked`: `api.load` after checking a local target folder (config.json, complete safetensors) and fetching
  a hub target with a clear line when the hub cannot be reached.
- `warn_before_run`: `warning:` lines for runs that go on, but not as the user expects.
- `stream_to_stdout`: print tokens as they come, with a prefill bar for long prompts; on Ctrl-C end the line and
  print the `--verbose` summary of what was generated, then let the KeyboardInterrupt go on to the caller.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

from . import api
from .refs import is_repo_id
from .validate import LONG_PROMPT_TOKENS, check_model_dir, prompt_length_warning, width_warning


def load_checked(model: str, draft: Optional[str], quant: Optional[str]):
    """`api.load(model, draft, quant=quant)`, with broken local files and an unreachable hub named first."""
    local = Path(model).expanduser()
    if is_repo_id(model):
        from .models.hub import fetch_target

        local = fetch_target(model)  # a hub repo id: an unreachable hub is named as such
        model = str(local)
    if local.is_dir():
        check_model_dir(local)
    return api.load(model, draft, quant=quant)


def warn(message: Optional[str]) -> None:
    if message:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def warn_before_run(target, drafter, prompt_tokens: int, width: Optional[int]) -> None:
    """An over-long prompt, a block larger than the drafter's: the run goes on, with one line saying so."""
    args = getattr(target, "args", None)
    warn(prompt_length_warning(prompt_tokens, getattr(args, "max_position_embeddings", None)))
    warn(width_warning(width, getattr(drafter, "block_size", None)))


class PrefillBar:
    """A progress bar for prompts over LONG_PROMPT_TOKENS, driven by a `prefill_progress(done, total)` callback."""

    def __init__(self, prompt_tokens: int):
        self.enabled = prompt_tokens > LONG_PROMPT_TOKENS
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="prefill", unit="tok", file=sys.stderr, leave=False, mininterval=0)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.bar.refresh()
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def stream_to_stdout(target, tokenizer, ids, drafter, *, verbose: bool, max_tokens: int, width: Optional[int],
                     lookup: Optional[bool], tree_budget, seed: Optional[int], temp: float, top_p: float, top_k: int,
                     min_p: float) -> None:
    """Print the generated text as it comes, then (with `verbose`) speed and acceptance. The decode options are
    `api.stream_generate`'s, passed on as given (the engine decides with them, in `decode.planner.build_planner`).

    Ctrl-C: the line is ended and the summary of what was generated so far is printed before the
    KeyboardInterrupt is re-raised.
    """
    bar = PrefillBar(len(ids))
    response = None
    try:
        for response in api.stream_generate(target, tokenizer, ids, drafter, max_tokens=max_tokens, width=width,
                                            lookup=lookup, tree_budget=tree_budget, seed=seed, temp=temp,
                                            top_p=top_p, top_k=top_k, min_p=min_p, prefill_progress=bar):
            print(response.text, end="", flush=True)
    except KeyboardInterrupt:
        try:  # a second Ctrl-C must not break the summary (cli.main restores the handler)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass
        bar.close()
        print(flush=True)
        if verbose and response is not None:
            api.print_stats(response)
        raise
    finally:
        bar.close()
    print()
    if verbose and response is not None:
        api.print_stats(response)
