"""The `dflash-mlx` command line: generate, chat, serve, convert, models, bench, train.

Every user mistake ends in one line on stderr that says what is wrong and what to do, and a non-zero exit.
"""

from __future__ import annotations

import signal
import sys


def _exit_quietly(signum, frame):
    # Ctrl-C while the modules below load: nothing has started, so leave at once, without a traceback.
    print(file=sys.stderr, flush=True)
    raise SystemExit(130)


def _swap_sigint(handler):
    """Install a SIGINT handler; returns the previous one (None where signals cannot be set, off the main thread)."""
    try:
        return signal.signal(signal.SIGINT, handler)
    except ValueError:
        return None


_SIGINT_AT_IMPORT = _swap_sigint(_exit_quietly)  # restored at the end of this module

import logging  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import List, Optional  # noqa: E402

import typer  # noqa: E402

from .cli_options import (DRAFT_OPTION, MIN_P_OPTION, MODEL_OPTION, NO_LOOKUP_OPTION, PIPELINE_HELP,  # noqa: E402
                          QUANT_OPTION, TOP_K_OPTION, TOP_P_OPTION, TREE_BUDGET_OPTION, tree_budget_value)
from .errors import DFlashError  # noqa: E402

app = typer.Typer(
    name="dflash-mlx",
    help="DFlash speculative decoding for mlx-lm models: a block-diffusion drafter proposes a block of tokens, "
    "the target verifies it in one pass. Output is exactly the target's own.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _check_text(text: str, flag: str) -> None:
    """Text from the command line must be UTF-8: Python keeps undecodable bytes as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DFlashError(f"{flag} is not valid UTF-8 (character {e.start}); pass UTF-8 text") from None


def _read_stdin() -> str:
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DFlashError(f"--prompt -: standard input is not valid UTF-8 (byte {e.start}); convert the text to "
                          "UTF-8 first") from None


def _chat_prompt(tokenizer, prompt: str, system: Optional[str], use_template: bool) -> list:
    """Apply the chat template the way `mlx_lm.generate` does, then encode."""
    prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        prompt = _read_stdin()
    _check_text(prompt, "--prompt")
    if system is not None:
        _check_text(system, "--system-prompt")
    use_template = use_template and tokenizer.has_chat_template
    if use_template:
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": prompt})
        try:
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that does not compile, or raises on these messages
            raise DFlashError(f"the model's chat template failed: {' '.join(str(e).split())}; fix the template "
                              "or pass --ignore-chat-template") from None
    return tokenizer.encode(prompt, add_special_tokens=not use_template)


def _load(model: str, draft: Optional[str], quant: Optional[str], pipeline: bool, seed: Optional[int]):
    """api.load, or under `mlx.launch` the target split over the ranks (docs/distributed.md); rank 0 prints.

    Returns (target, tokenizer, drafter, seed): ranks get a seed drawn alike, so they draw and pace alike."""
    from . import console, distributed

    if distributed.launched():
        loaded = distributed.load(model, draft, quant=quant, pipeline=pipeline)
        return (*loaded, distributed.shared_seed() if seed is None else seed)
    if pipeline:
        raise DFlashError("--pipeline splits a model over several machines: start the command with mlx.launch")
    return (*console.load_checked(model, draft, quant), seed)


@app.command()
def generate(
    model: str = MODEL_OPTION,
    draft: Optional[str] = DRAFT_OPTION,
    quant: Optional[str] = QUANT_OPTION,
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text ('-' reads stdin)."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate (-1: until EOS)."),
    width: Optional[int] = typer.Option(None, "--width", min=1, help="Fix the tokens verified per pass (default: "
                                        "chosen every pass, up to the drafter's block size; 1 = plain decoding)."),
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", help="System message for the chat template."),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template", help="Feed the prompt as raw text."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print tok/s, acceptance length τ and its histogram."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0: greedy). Output stays exactly the "
                               "target's distribution."),
    top_p: float = TOP_P_OPTION,
    top_k: int = TOP_K_OPTION,
    min_p: float = MIN_P_OPTION,
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed: the same seed reproduces the output."),
    no_lookup: bool = NO_LOOKUP_OPTION,
    tree_budget: Optional[str] = TREE_BUDGET_OPTION,
    pipeline: bool = typer.Option(False, "--pipeline", help=PIPELINE_HELP),
):
    """Generate text from a prompt with DFlash speculative decoding."""
    from . import console
    from .decode.sampling import SamplingParams, check_seed
    from .validate import check_max_tokens

    check_max_tokens(max_tokens)
    sampling = dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    SamplingParams(**sampling)  # bad values fail here, before any model is loaded
    check_seed(seed)
    budget = tree_budget_value(tree_budget)
    if prompt != "-":
        _check_text(prompt, "--prompt")
    if system_prompt is not None:
        _check_text(system_prompt, "--system-prompt")
    target, tokenizer, drafter, seed = _load(model, draft, quant, pipeline, seed)
    ids = _chat_prompt(tokenizer, prompt, system_prompt, not ignore_chat_template)
    console.warn_before_run(target, drafter, len(ids), width)
    if verbose:
        from .drafters.families import describe

        what = "none: lookup drafting from the context alone" if drafter == "lookup" else describe(drafter)
        print(f"drafter: {what}", file=sys.stderr)
    try:
        console.stream_to_stdout(target, tokenizer, ids, drafter, verbose=verbose, max_tokens=max_tokens,
                                 width=width, lookup=False if no_lookup else None, tree_budget=budget, seed=seed,
                                 temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    except KeyboardInterrupt:  # the line is ended and the summary printed; main says "interrupted"
        raise typer.Exit(130) from None


@app.command()
def chat(
    model: str = MODEL_OPTION,
    draft: Optional[str] = DRAFT_OPTION,
    quant: Optional[str] = QUANT_OPTION,
    max_tokens: int = typer.Option(1024, "--max-tokens", help="Most tokens per reply (-1: until EOS)."),
    width: Optional[int] = typer.Option(None, "--width", min=1,
                                        help="Fix the tokens verified per pass (default: chosen every pass)."),
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", help="System message."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0: greedy); /temp changes it."),
    top_p: float = TOP_P_OPTION,
    top_k: int = TOP_K_OPTION,
    min_p: float = MIN_P_OPTION,
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampled replies."),
    thinking: Optional[bool] = typer.Option(None, "--thinking/--no-thinking",
                                            help="Thinking mode for models whose template has one; /think toggles."),
    history: Optional[Path] = typer.Option(None, "--history", help="Start from a conversation saved with /save."),
    no_lookup: bool = NO_LOOKUP_OPTION,
    tree_budget: Optional[str] = TREE_BUDGET_OPTION,
    pipeline: bool = typer.Option(False, "--pipeline", help=PIPELINE_HELP),
    web: bool = typer.Option(False, "--web", help="Chat in the browser instead: serve the model on 127.0.0.1 "
                             "(--port) and open its chat page."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="With --web: the port to serve on."),
    no_open: bool = typer.Option(False, "--no-open", help="With --web: print the page's address, open no browser."),
):
    """Chat with a model; caches are reused across turns, Ctrl-C stops a reply and keeps the conversation.
    With --web, in the browser: the chat page of `dflash-mlx serve`, every token marked by where it came from."""
    from . import console
    from .chat import ChatSession, run_repl
    from .decode.sampling import SamplingParams, check_seed
    from .validate import check_max_tokens

    check_max_tokens(max_tokens)
    sampling = dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    SamplingParams(**sampling)
    check_seed(seed)
    budget = tree_budget_value(tree_budget)
    if system_prompt is not None:
        _check_text(system_prompt, "--system-prompt")
    if web:
        from .server import check_address

        if history is not None or pipeline:
            raise DFlashError("--history and --pipeline are for the terminal chat; drop them with --web "
                              "(the page keeps its conversations in the browser)")
        check_address("127.0.0.1", port)  # a port in use is one line now, not after the model has loaded
    if history is not None and history.expanduser().is_dir():
        raise DFlashError(f"--history {history} is a folder; give a file saved with /save")
    if history is not None and not history.expanduser().is_file():
        raise DFlashError(f"--history {history} does not exist; give a file saved with /save")
    target, tokenizer, drafter, seed = _load(model, draft, quant, pipeline, seed)
    if web:
        from .server.web import chat_in_browser

        return chat_in_browser((target, tokenizer, drafter), model=model, draft=draft, port=port,
                               open_browser=not no_open, max_tokens=max_tokens, width=width, temp=temp,
                               tree_budget=budget, lookup=False if no_lookup else None)
    console.warn_before_run(target, drafter, 0, width)
    if seed is not None:
        sampling["seed"] = seed
    session = ChatSession(target, tokenizer, drafter, system=system_prompt, max_tokens=max_tokens,
                          width=width, sampling=sampling, thinking=thinking,
                          lookup=False if no_lookup else None, tree_budget=budget)
    if history is not None:
        session.load(str(history))
    run_repl(session)


@app.command()
def serve(
    model: str = MODEL_OPTION,
    draft: Optional[str] = DRAFT_OPTION,
    quant: Optional[str] = QUANT_OPTION,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' (or x-api-key)."),
    max_queue: int = typer.Option(64, "--max-queue", min=0, help="Waiting requests beyond this get a 503."),
    max_batch: int = typer.Option(8, "--max-batch", min=1, help="Requests decoded together, sharing each verify "
                                  "pass (1: one at a time)."),
    prompt_cache_bytes: str = typer.Option("2GiB", "--prompt-cache-bytes", help="Prefix cache budget: bytes, or "
                                           "with a K/M/G/KiB/MiB/GiB suffix; 0 turns the cache off."),
    prompt_cache_dir: Optional[str] = typer.Option(None, "--prompt-cache-dir", help="Keep prefix-cache entries "
                                                   "on disk here (those evicted, and all at shutdown), so a restart "
                                                   "keeps long system prompts warm; created if missing."),
    prompt_cache_dir_bytes: str = typer.Option("16GiB", "--prompt-cache-dir-bytes", help="Disk budget of "
                                               "--prompt-cache-dir: its least recently used entries go beyond it."),
    width: Optional[int] = typer.Option(None, "--width", min=1, help="Fix the tokens verified per pass (default: "
                                        "chosen every pass; 1 = plain decoding)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1, help="Most tokens for a request that "
                                             "sets no limit (default: what the context leaves, as OpenAI does)."),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Temperature of requests that set none."),
    chat_template_args: Optional[str] = typer.Option(None, "--chat-template-args", help="JSON passed to the chat "
                                                     "template, e.g. '{\"enable_thinking\": false}'."),
    served_model_name: Optional[List[str]] = typer.Option(None, "--served-model-name", help="Model id clients "
                                                          "use (default: --model); repeat it to answer to several "
                                                          "names, the first is the one reported. Requests "
                                                          "naming any other model (coding agents send their own "
                                                          "ids, e.g. claude-opus-4-8) are served by this one."),
    strict_model_names: bool = typer.Option(False, "--strict-model-names", help="Answer requests naming a model "
                                            "other than the served names with a 404 instead."),
    prefill_step_size: Optional[int] = typer.Option(None, "--prefill-step-size", min=1, help="Prompt tokens per "
                                                    "prefill chunk (default 2048). A request whose client left, or "
                                                    "a server told to stop, stops between two chunks: smaller "
                                                    "chunks stop sooner and let other requests' tokens through "
                                                    "sooner; larger ones prefill a little faster."),
    pipeline: bool = typer.Option(False, "--pipeline", help=PIPELINE_HELP),
    tree_budget: Optional[str] = TREE_BUDGET_OPTION,
    no_lookup: bool = NO_LOOKUP_OPTION,
):
    """Serve the model over HTTP: OpenAI /v1 (chat, completions, models), Anthropic /v1/messages, /health, /metrics."""
    budget = tree_budget_value(tree_budget)
    from . import distributed
    from .server import settings_from_cli

    ranks = pipeline or distributed.launched()  # under mlx.launch: rank 0 serves, every rank generates
    if ranks:
        from .distributed.serving import check_rank_options

        if prefill_step_size is not None:
            raise DFlashError("--prefill-step-size is not supported when the target is split over ranks; serve "
                              "without it")
        check_rank_options(draft=draft, prompt_cache_dir=prompt_cache_dir)
    # Every option is checked before any model is loaded.
    settings = settings_from_cli(model=model, draft=draft, api_key=api_key, max_queue=max_queue, max_batch=max_batch,
                                 prompt_cache_bytes=prompt_cache_bytes, prompt_cache_dir=prompt_cache_dir,
                                 prompt_cache_dir_bytes=prompt_cache_dir_bytes, width=width, max_tokens=max_tokens,
                                 temp=temp, chat_template_args=chat_template_args,
                                 served_model_name=served_model_name, strict_model_names=strict_model_names,
                                 tree_budget=budget, lookup=False if no_lookup else None)
    if ranks:
        from .distributed.serving import serve_ranks

        serve_ranks(model, draft, host=host, port=port, quant=quant, settings=settings, pipeline=pipeline)
    else:
        from .server import serve_from_cli

        serve_from_cli(model=model, draft=draft, quant=quant, host=host, port=port, settings=settings,
                       prefill_step_size=prefill_step_size)


AGENT_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}
URL_HELP = "Use the dflash-mlx server at this URL instead of starting one (e.g. http://127.0.0.1:8080)."
AGENT_HELP = {
    "claude": "Run Claude Code against a local server for the pair: 'dflash-mlx claude -p \"fix the tests\"'. "
              "Arguments after the options go to claude unchanged; its settings are set for this run only.",
    "codex": "Run Codex against a local server for the pair: 'dflash-mlx codex exec \"add a test\"'. Arguments "
             "after the options go to codex unchanged; its settings are passed as -c overrides for this run only.",
}


def _agent_command(name: str):
    """The `dflash-mlx claude` / `dflash-mlx codex` command (agents.py does the work)."""

    def command(
        ctx: typer.Context,
        model: str = MODEL_OPTION,
        draft: Optional[str] = DRAFT_OPTION,
        quant: Optional[str] = QUANT_OPTION,
        url: Optional[str] = typer.Option(None, "--url", help=URL_HELP),
        api_key: Optional[str] = typer.Option(None, "--api-key", help="The server's --api-key, if it has one."),
        prompt_cache_dir: Optional[str] = typer.Option(None, "--prompt-cache-dir", help="Where the started "
                                                       "server keeps its prefix cache between sessions (default: "
                                                       "prompt-cache/<model> in dflash-mlx's cache folder; 'off': "
                                                       "nowhere)."),
        prompt_cache_dir_bytes: str = typer.Option("8GiB", "--prompt-cache-dir-bytes", help="Disk budget of "
                                                   "--prompt-cache-dir: its least recently used entries go beyond "
                                                   "it."),
    ):
        from . import agents

        client = {"claude": agents.CLAUDE, "codex": agents.CODEX}[name]
        raise typer.Exit(agents.launch(client, list(ctx.args), model=model, draft=draft, quant=quant, url=url,
                                       api_key=api_key, prompt_cache_dir=prompt_cache_dir,
                                       prompt_cache_dir_bytes=prompt_cache_dir_bytes))

    return app.command(name, context_settings=AGENT_CONTEXT, help=AGENT_HELP[name])(command)


_agent_command("claude")
_agent_command("codex")


@app.command()
def convert(
    source: Optional[str] = typer.Argument(None, help="z-lab DFlash drafter: local dir or hub repo id "
                                           "(omit with --gguf / --target)."),
    out: Optional[Path] = typer.Argument(None, help="Output directory."),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="Instead: convert this GGUF file into an mlx-lm "
                                        "target model directory (llama, qwen2, qwen3, gemma3)."),
    target: Optional[str] = typer.Option(None, "--target", help="Instead: quantize (or cast) this safetensors "
                                         "target, a local dir or hub repo, with mlx-lm's converter."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16, fp16 or fp32 (default: bf16 for drafters, "
                                        "fp32 for --gguf, the source's own for --target)."),
    quantize: bool = typer.Option(False, "--quantize", "-q", help="Quantize the drafter's linear layers."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="Bits per weight: 4 or 8 (default 4 with "
                                         "--quantize; with --gguf / --target it alone turns quantization on)."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Quantization group size."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision of the source."),
    force: bool = typer.Option(False, "--force", help="Replace the contents of a non-empty output folder (only "
                               "once the conversion has succeeded)."),
):
    """Convert a DFlash drafter (z-lab format), a GGUF model (--gguf) or a safetensors target (--target)."""
    if gguf is not None or target is not None:
        from .convert.target import convert_model_command

        path = convert_model_command(source, out, gguf=gguf, target=target, dtype=dtype, quantize=quantize,
                                     q_bits=q_bits, q_group_size=q_group_size, revision=revision, force=force)
        typer.echo(f"wrote {path}")
        return
    from .convert.drafter import convert_drafter

    if source is None or out is None:
        raise DFlashError("convert needs SOURCE and OUT (or --gguf FILE OUT, or --target DIR_OR_REPO OUT)")
    from .dtypes import dtype_name

    dtype = dtype_name(dtype or "bf16")
    q_bits = 4 if q_bits is None else q_bits
    if quantize and q_bits not in (4, 8):
        raise DFlashError(f"--q-bits must be 4 or 8, got {q_bits}")
    path = convert_drafter(source, out, dtype=dtype, q_bits=q_bits if quantize else None,
                           q_group_size=q_group_size, revision=revision, force=force)
    typer.echo(f"wrote {path}")


from .cli_bench import bench  # noqa: E402

app.command()(bench)

from .models.offline import models_app  # noqa: E402  (light: mlx loads only when a model is converted)

app.add_typer(models_app, name="models")

from .train.command import train_command  # noqa: E402

app.command("train")(train_command)


def _show_warnings() -> None:
    """Library warnings (e.g. acceptance collapse) on stderr, on a line of their own even mid-stream."""
    logger = logging.getLogger("dflash_mlx")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("\nwarning: %(message)s"))
        logger.addHandler(handler)


def main(argv: Optional[list] = None) -> int:
    """Entry point: run the app, turning every expected failure into one line and exit code 2 (130 for Ctrl-C)."""
    # Ctrl-C raises KeyboardInterrupt from here on (commands clean up, then exit 130); whatever handler was
    # there before comes back when main returns, so in-process callers (tests) keep theirs.
    previous = _swap_sigint(signal.default_int_handler)
    try:
        code = _run(argv)
    except KeyboardInterrupt:  # landed outside typer's own handling
        code = 130
    finally:
        if previous is not None:
            _swap_sigint(previous)
    if code == 130:
        typer.echo("interrupted", err=True)
    return code


def _run(argv: Optional[list]) -> int:
    _show_warnings()
    try:
        # Without standalone mode, click returns the code a command exits with instead of raising; typer turns
        # Ctrl-C into code 130.
        code = app(args=argv, standalone_mode=False)
        if isinstance(code, int):
            return code
    except DFlashError as e:
        # One line, even when a library's message spans many.
        message = " ".join(str(e).split())
        typer.echo(f"error: {message if len(message) <= 400 else message[:397] + '...'}", err=True)
        return 2
    except typer.TyperException as e:  # usage errors: unknown flag, bad value, missing option
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
            typer.echo(ctx.get_help())
            return 0
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        typer.echo(f"error: {e.format_message()}{hint}", err=True)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        return 1
    return 0


_swap_sigint(_SIGINT_AT_IMPORT if _SIGINT_AT_IMPORT is not None else signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
