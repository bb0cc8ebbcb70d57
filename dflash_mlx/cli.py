"""The `dflash-mlx` command line: generate and convert (more subcommands join as they land).

Every user mistake ends in one line on stderr that says what is wrong and what to do, and a non-zero exit.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import DFlashError

app = typer.Typer(
    name="dflash-mlx",
    help="DFlash speculative decoding for mlx-lm models: a block-diffusion drafter proposes a block of tokens, "
    "the target verifies it in one pass. Output is exactly the target's own.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _chat_prompt(tokenizer, prompt: str, system: Optional[str], use_template: bool) -> list:
    """Apply the chat template the way `mlx_lm.generate` does, then encode."""
    prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        prompt = sys.stdin.read()
    use_template = use_template and tokenizer.has_chat_template
    if use_template:
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(prompt, add_special_tokens=not use_template)


@app.command()
def generate(
    model: str = typer.Option(..., "--model", "-m", help="Target: a local mlx-lm model dir or a hub repo id."),
    draft: str = typer.Option(..., "--draft", "-d", help="DFlash drafter: converted dir, z-lab checkpoint dir or repo id."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text ('-' reads stdin)."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate (-1: until EOS)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", min=1,
                                             help="Tokens verified per pass (default: the drafter's; 1 = plain decoding)."),
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", help="System message for the chat template."),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template", help="Feed the prompt as raw text."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print tok/s, acceptance length τ and its histogram."),
):
    """Generate text from a prompt with DFlash speculative decoding."""
    from . import api

    if max_tokens == 0:
        raise DFlashError("--max-tokens must be positive (or -1 for no limit)")
    target, tokenizer, drafter = api.load(model, draft)
    ids = _chat_prompt(tokenizer, prompt, system_prompt, not ignore_chat_template)
    if verbose:
        api.generate(target, tokenizer, ids, drafter, verbose=True, max_tokens=max_tokens, block_size=block_size)
        return
    for r in api.stream_generate(target, tokenizer, ids, drafter, max_tokens=max_tokens, block_size=block_size):
        print(r.text, end="", flush=True)
    print()


@app.command()
def convert(
    source: str = typer.Argument(..., help="z-lab DFlash drafter: local dir or hub repo id."),
    out: Path = typer.Argument(..., help="Output directory for the MLX drafter."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32."),
    quantize: bool = typer.Option(False, "--quantize", "-q", help="Quantize the drafter's linear layers."),
    q_bits: int = typer.Option(4, "--q-bits", help="Bits per weight when quantizing: 4 or 8."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Quantization group size."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision of the source."),
):
    """Convert a PyTorch DFlash drafter (z-lab format) into an MLX drafter directory."""
    from .convert.drafter import convert_drafter

    dtypes = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
              "fp32": "float32", "float32": "float32"}
    if dtype not in dtypes:
        raise DFlashError(f"--dtype {dtype!r} is not one of bf16, fp16, fp32")
    if quantize and q_bits not in (4, 8):
        raise DFlashError(f"--q-bits must be 4 or 8, got {q_bits}")
    path = convert_drafter(source, out, dtype=dtypes[dtype], q_bits=q_bits if quantize else None,
                           q_group_size=q_group_size, revision=revision)
    typer.echo(f"wrote {path}")


def main(argv: Optional[list] = None) -> int:
    """Entry point: run the app, turning every expected failure into one line and exit code 2 (1 for Ctrl-C)."""
    try:
        app(args=argv, standalone_mode=False)
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
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
