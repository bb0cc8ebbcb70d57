"""One benchmark run: load the models once, then decode every prompt with every method, in rotating order.

Rotation: on prompt i the methods start at the i-th one (the oracle always runs right after plain decoding, whose
output it proposes), so slow drift of the machine (thermals, a neighbour's load) hits every method alike.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from ..decode.sampling import check_seed
from ..distributed import bench as ranks
from ..errors import DFlashError
from ..decode.lookup import MTP_HEADS
from ..models.loading import MTP_BLOCK, load_target, prepare, resolve_target, shipped_drafter_for
from .methods import DFlashMethod, Method, PlainMethod, SpeculativeMethod, draft_costs, verify_costs
from .prompts import encode_prompt, load_prompts
from .report import summarize, write_chart, write_json

VERIFY_KS = (1, 2, 4, 8, 16)


@dataclass
class BenchConfig:
    """What `dflash-mlx bench` runs; see `dflash-mlx bench --help` for each field."""

    model: str
    draft: Optional[str] = None
    ar_draft: Optional[str] = None
    oracle: bool = False
    prompts: str = "humaneval"
    num_prompts: Optional[int] = 10
    max_tokens: int = 128
    block_sizes: List[int] = field(default_factory=list)  # empty: the drafter's (16 for the oracle alone)
    adaptive: bool = True  # also run DFlash (and the oracle) with the width chosen every cycle, up to the widest
    lookup: bool = True  # also run DFlash with lookup drafting (adaptive) and lookup drafting alone
    drafter_alone: bool = True  # run the drafter without lookup drafts too (adaptive)
    fixed_draft: bool = True  # run the drafter at each fixed block size too (the oracle always is)
    random_draft: bool = False  # also run a drafter of the same shape with random weights (adaptive only)
    num_draft_tokens: List[int] = field(default_factory=lambda: [3])
    tree_budgets: List = field(default_factory=list)  # also run the drafter with draft trees of these budgets
    temp: float = 0.0
    seed: int = 0
    out: Optional[str] = None
    plot: Optional[str] = None  # a folder for the report's PNGs (bench/plots.py)
    chat_template: bool = True
    ignore_eos: bool = False
    profile: bool = True  # an extra, synced run of each DFlash method for the per-phase times
    profile_prompts: Optional[int] = None  # profile only the first N prompts (None: all)
    verify_prompts: int = 3  # prompts on which the k-token verify cost and the drafting cost are measured
    warmup: bool = True
    progress: bool = True
    distributed: bool = False  # under mlx.launch: the target split over the ranks (docs/distributed.md)
    pipeline: bool = False  # distributed: pipeline stages instead of tensor parallelism

    def __post_init__(self):
        if self.max_tokens < 1:
            raise DFlashError(f"--max-tokens must be positive, got {self.max_tokens}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise DFlashError(f"--num-prompts must be positive, got {self.num_prompts}")
        if any(b < 1 for b in self.block_sizes) or any(k < 1 for k in self.num_draft_tokens):
            raise DFlashError("--widths and --num-draft values must be positive")
        if not self.temp >= 0:
            raise DFlashError(f"--temp must be >= 0, got {self.temp}")
        # Prompt i runs with seed + i: the last one must still be a seed MLX takes.
        check_seed(self.seed)
        check_seed(self.seed + (self.num_prompts or 1) - 1, f"--seed {self.seed} + the prompt index")
        if self.out:
            check_out_dir(Path(self.out).expanduser())
        if self.plot:
            from .plots import require_matplotlib

            require_matplotlib()  # missing: one line now, not after a run of many minutes
            check_out_dir(Path(self.plot).expanduser(), "--plot")
        if self.draft is None:
            self.draft = shipped_drafter_for(self.model)
        if self.draft is None and self.ar_draft is None and not self.oracle:
            raise DFlashError("nothing to compare with plain decoding: give --draft, --ar-draft or --oracle")
        if self.random_draft and self.draft in (None, "lookup", "mtp"):
            raise DFlashError("--random-draft copies the shape of a DFlash drafter: give --draft DIR too")


def check_out_dir(out: Path, flag: str = "--out") -> None:
    """--out (--plot) must be a folder the report can be written into: found out before a run of many minutes, not
    after."""
    if out.exists() and not out.is_dir():
        raise DFlashError(f"{flag} {out} is a file; give a folder for the report's files")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise DFlashError(f"{flag} {out} cannot be written ({e.strerror or e}); choose another folder") from None


def _load_ar_draft(name: str):
    from mlx_lm.utils import load

    try:
        return load(resolve_target(name))
    except Exception as e:  # mlx-lm and the hub raise many types
        raise DFlashError(f"could not load AR draft '{name}': {type(e).__name__}: {e}") from e


def _environment() -> Dict[str, str]:
    import mlx_lm

    try:
        maps = Path("/proc/self/maps").read_text()
        blas = "openblas" if "openblas" in maps else "bundled"
    except OSError:
        blas = "unknown"
    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "device": str(mx.default_device()),
            "cpu_blas": blas, "python": sys.version.split()[0], "cpu_count": str(os.cpu_count())}


def _build_methods(cfg: BenchConfig, model):
    from ..drafters.io import build_drafter, load_drafter
    from ..targets import build_target

    plain = PlainMethod(model, cfg.temp)
    if cfg.draft == MTP_HEADS:  # the target's own MTP layers, from the target's checkpoint
        from ..drafters.mtp import load_mtp_drafter

        drafter = load_mtp_drafter(resolve_target(cfg.model), model, block_size=max(cfg.block_sizes or [MTP_BLOCK]))
    else:
        drafter = load_drafter(cfg.draft, fastest=True) if cfg.draft and cfg.draft != "lookup" else None
    blocks = cfg.block_sizes or [drafter.block_size if drafter is not None else 16]
    others: List[Method] = []
    if cfg.ar_draft:
        ar_model, _ = _load_ar_draft(cfg.ar_draft)
        others += [SpeculativeMethod(model, ar_model, k, cfg.temp) for k in cfg.num_draft_tokens]
    widest = max(blocks)
    if drafter is not None:
        target = prepare(model, drafter, probe=True)
        drafter = ranks.drafter_for(model, drafter)  # a pipeline's stages share their taps with it
        if cfg.adaptive:
            if cfg.drafter_alone or not cfg.lookup:
                others.append(DFlashMethod(target, drafter, widest, cfg.temp, adaptive=True))
            if cfg.lookup:
                others.append(DFlashMethod(target, drafter, widest, cfg.temp, adaptive=True, lookup=True))
        for budget in cfg.tree_budgets:  # the same methods, each drafted block verified as a tree
            if cfg.drafter_alone or not cfg.lookup:
                others.append(DFlashMethod(target, drafter, widest, cfg.temp, adaptive=True, tree_budget=budget))
            if cfg.lookup:
                others.append(DFlashMethod(target, drafter, widest, cfg.temp, adaptive=True, lookup=True,
                                           tree_budget=budget))
        if cfg.fixed_draft:
            others += [DFlashMethod(target, drafter, b, cfg.temp) for b in blocks]
        if cfg.random_draft:
            noise = build_drafter(drafter.config)  # same shape, random weights: acceptance collapses
            mx.eval(noise.parameters())
            others.append(DFlashMethod(prepare(model, noise), ranks.drafter_for(model, noise), widest, cfg.temp,
                                       adaptive=True, label="random"))
    if cfg.lookup:  # lookup drafting alone: what any mlx-lm target gets without a drafter
        others.append(DFlashMethod(build_target(model), None, widest, cfg.temp, adaptive=True, lookup=True))
    oracles: List[Method] = []
    if cfg.oracle:
        bare = build_target(model)  # no taps: the oracle reads no features
        mask = drafter.config.mask_token_id if drafter is not None else None
        if cfg.adaptive:
            oracles.append(DFlashMethod(bare, None, widest, cfg.temp, mask_token_id=mask, adaptive=True))
        oracles += [DFlashMethod(bare, None, b, cfg.temp, mask_token_id=mask) for b in blocks]
    return plain, oracles, others, blocks


def run_bench(cfg: BenchConfig) -> dict:
    """Run the benchmark; return the report (also written under `cfg.out` when given)."""
    prompts = load_prompts(cfg.prompts, cfg.num_prompts)
    model, tokenizer = ranks.load_rank_target(cfg) if cfg.distributed else load_target(resolve_target(cfg.model))
    plain, oracles, others, blocks = _build_methods(cfg, model)
    units: List[List[Method]] = [[plain] + oracles] + [[m] for m in others]
    methods = [m for unit in units for m in unit]
    meter = ranks.Meter(methods, model) if cfg.distributed else None  # ring traffic per run
    stops = [] if cfg.ignore_eos else sorted(tokenizer.eos_token_ids)
    encoded = [encode_prompt(tokenizer, p.text, cfg.chat_template) for p in prompts]
    ks = sorted(set(VERIFY_KS) | set(blocks) | {m.block for m in others})
    # The drafter whose drafting cost is measured: the real one (not the random one), if any.
    drafted = next((m for m in others if m.kind == "dflash" and m.name.startswith("dflash")
                    and getattr(m.drafter, "drafts_with", None) is None), None)  # a DFlash block drafter

    if cfg.warmup:  # first calls pay for graph set-up and allocation; keep them out of the numbers
        warm = min(8, cfg.max_tokens)
        reference = plain.run(encoded[0], warm, stops, seed=cfg.seed).tokens
        for m in methods[1:]:
            m.run(encoded[0], warm, stops, reference, seed=cfg.seed)

    records = []
    bar = range(len(prompts))
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(bar, desc="bench", unit="prompt", file=sys.stderr)
    for i in bar:
        ids, seed = encoded[i], cfg.seed + i
        order = [m for unit in units[i % len(units):] + units[: i % len(units)] for m in unit]
        runs = {}
        for m in order:
            reference = runs[plain.name].tokens if m.kind == "oracle" else None
            runs[m.name] = m.run(ids, cfg.max_tokens, stops, reference, seed=seed)
        profiled = {}
        if cfg.profile and (cfg.profile_prompts is None or i < cfg.profile_prompts):
            for m in methods:
                if m.kind in ("dflash", "oracle"):
                    profiled[m.name] = m.run(ids, cfg.max_tokens, stops, runs[plain.name].tokens, seed=seed,
                                             profile=True)
        costs, drafting = None, None
        if i < cfg.verify_prompts:
            costs = verify_costs(model, ids, runs[plain.name].tokens, ks)
            if drafted is not None:
                drafting = draft_costs(drafted.target, drafted.drafter, ids, blocks)
        records.append(dict(prompt=prompts[i], ids=ids, runs=runs, profiled=profiled, verify=costs,
                            drafting=drafting))

    report = summarize(methods, plain.name, records, greedy=cfg.temp == 0)
    if meter is not None:
        report["communication"] = meter.report(methods, records)
    report["config"] = {**asdict(cfg), "block_sizes": blocks}
    report["environment"] = _environment()
    if cfg.plot:
        from .plots import write_plots

        report["files"] = {p.stem: str(p) for p in write_plots(report, cfg.plot)}
    if cfg.out:
        out = Path(cfg.out).expanduser()
        out.mkdir(parents=True, exist_ok=True)  # checked writable before the run (BenchConfig)
        report.setdefault("files", {})["json"] = str(out / "bench.json")
        chart = write_chart(report, out / "bench.png")
        if chart:
            report["files"]["png"] = str(chart)
        else:
            report["notes"].append("matplotlib is not installed (pip install 'dflash-mlx[bench]'): no PNG chart")
        write_json(report, out / "bench.json")
    return report
