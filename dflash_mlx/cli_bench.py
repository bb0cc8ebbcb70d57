"""`dflash-mlx bench`: DFlash against mlx-lm decoding on one target, weights and prompt set, methods alternated
(registered on the app by `cli`; the work is `bench.run_bench`'s).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .cli_options import PIPELINE_HELP, tree_budget_value
from .errors import DFlashError
from .models.offline import DEFAULT_MODEL


def _int_list(values: Optional[List[str]], flag: str) -> List[int]:
    """Repeated and/or comma-separated integers: --widths 4 --widths 8,16."""
    try:
        return [int(v) for value in values or [] for v in value.split(",") if v.strip()]
    except ValueError:
        raise DFlashError(f"{flag} takes integers (repeat the flag or separate with commas), got {values}") from None


def bench(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Target: a local mlx-lm model dir, hub repo id or "
                              f"offline model name (default {DEFAULT_MODEL}).", show_default=False),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="DFlash drafter for method (c) (default: the "
                                        "one shipped for an offline model, if any); 'mtp': the target's own MTP "
                                        "layers; 'lookup': drafts copied from the context alone."),
    ar_draft: Optional[str] = typer.Option(None, "--ar-draft", help="Autoregressive draft model for mlx-lm's "
                                           "speculative decoding, method (b)."),
    oracle: bool = typer.Option(False, "--oracle", help="Method (d): DFlash with the target's own greedy "
                                "continuation as draft (the ceiling of the machinery)."),
    random_draft: bool = typer.Option(False, "--random-draft", help="Also run a random-weight drafter of the "
                                      "--draft's shape, width chosen every pass (the floor)."),
    prompts: str = typer.Option("humaneval", "--prompts", help="humaneval, mtbench, editing (answers that rewrite "
                                "given code), or a .jsonl file with a 'prompt', 'text' or 'turns' field."),
    num_prompts: int = typer.Option(10, "--num-prompts", help="Prompts to run (the first N)."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="New tokens per prompt (fewer at EOS)."),
    widths: Optional[List[str]] = typer.Option(None, "--widths", help="Fixed verify widths to run the drafter (and "
                                               "the oracle) at, repeated or comma-separated (default: the "
                                               "drafter's block, else 16)."),
    num_draft: Optional[List[str]] = typer.Option(None, "--num-draft", help="Draft tokens per pass for (b), "
                                                  "repeated or comma-separated (default 3)."),
    tree_budget: Optional[List[str]] = typer.Option(None, "--tree-budget", help="Also run the drafter with each "
                                                    "drafted block verified as a tree of up to B tokens (repeated "
                                                    "or comma-separated; 'auto': chain or tree by measured speed, "
                                                    "what generate and chat do by default)."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature for every method (0: greedy)."),
    seed: int = typer.Option(0, "--seed", help="Seed of prompt i is seed + i, the same for every method."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write bench.json and bench.png here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write PNG plots here: speed per prompt against "
                                        "plain decoding, τ distribution, acceptance by draft position, verify "
                                        "widths (needs matplotlib: pip install 'dflash-mlx[bench]')."),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template", help="Feed prompts as raw text."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Always generate --max-tokens tokens."),
    no_profile: bool = typer.Option(False, "--no-profile", help="Skip the extra synced run that splits DFlash time "
                                    "into draft / verify / rollback / host."),
    verify_prompts: int = typer.Option(3, "--verify-prompts", help="Prompts on which to measure the k-token verify "
                                       "cost and the drafting cost per block size (0: skip)."),
    profile_prompts: Optional[int] = typer.Option(None, "--profile-prompts", help="Profile only the first N "
                                                  "prompts (default: all)."),
    fixed_draft: bool = typer.Option(True, "--fixed-draft/--no-fixed-draft", help="Also run the drafter at each "
                                     "fixed width of --widths (the oracle always is)."),
    no_lookup: bool = typer.Option(False, "--no-lookup", help="Skip the lookup methods (DFlash with drafts copied "
                                   "from the context, and lookup alone)."),
    drafter_alone: bool = typer.Option(True, "--drafter-alone/--no-drafter-alone", help="Also run the drafter "
                                       "without lookup drafts (--no-drafter-alone: only with them, a shorter run)."),
    distributed: bool = typer.Option(False, "--distributed", help="Under mlx.launch: split the target over the "
                                     "ranks and add per-pass communication bytes and time to the report."),
    pipeline: bool = typer.Option(False, "--pipeline", help=PIPELINE_HELP),
):
    """Benchmark DFlash against mlx-lm decoding: same target, weights and prompts, methods alternated."""
    from . import distributed as ranks
    from .bench import BenchConfig, format_table, run_bench

    distributed = distributed or pipeline or ranks.launched()
    if distributed and not ranks.launched():
        raise DFlashError("--distributed and --pipeline split the target over several ranks: start the command with "
                          "mlx.launch (see docs/distributed.md)")
    budgets = [tree_budget_value(v.strip()) for value in tree_budget or [] for v in value.split(",") if v.strip()]
    config = BenchConfig(
        model=model, draft=draft, ar_draft=ar_draft, oracle=oracle, prompts=prompts, num_prompts=num_prompts,
        max_tokens=max_tokens, block_sizes=_int_list(widths, "--widths"),
        num_draft_tokens=_int_list(num_draft, "--num-draft") or [3], temp=temp, seed=seed,
        out=str(out) if out else None, plot=str(plot) if plot else None, chat_template=not ignore_chat_template, ignore_eos=ignore_eos,
        profile=not no_profile, verify_prompts=verify_prompts, random_draft=random_draft,
        profile_prompts=profile_prompts, fixed_draft=fixed_draft, distributed=distributed, pipeline=pipeline,
        lookup=not no_lookup, drafter_alone=drafter_alone,
        tree_budgets=[b for b in budgets if b is not None])  # 'off': the chains, which run anyway
    report = run_bench(config)
    typer.echo(format_table(report))
    for kind, path in report.get("files", {}).items():
        typer.echo(f"wrote {path}")
