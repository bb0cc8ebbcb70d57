"""`dflash-mlx train`: make a DFlash drafter for an mlx-lm target, from data to a loadable drafter directory.

    dflash-mlx train --target smollm2-135m --data ~/code/ --out my-drafter --steps 2000

Defaults follow the public DFlash recipe (see `recipe_rows` in card.py): 5 draft layers tapping target layers spread
from 1 to L-3 ([1, 6, 11, 16, 21] on a 24-layer target), block 16 with γ 7, 128 anchors per 512-token row,
gradient accumulation to 512 blocks per optimizer step, AdamW lr 6e-4 with 4% warmup and cosine decay, clip 1.0;
the target's embedding and head are borrowed, never trained. Training runs on MLX's default device (an Apple or
NVIDIA GPU when the installed MLX has one, see device.py).

Stages, each resumable: (1) read and pack the data (optionally the target answers every prompt); (2) run the
frozen target once over it and cache the tapped features on disk; (3) train (checkpoints, `--resume`); (4) write
the drafter (`config.json` + `model.safetensors`, as `convert` writes) and a model card README.md into --out.

Safety: every option is checked before the target loads (`check_options`; the tapped layers right after it loads).
--out must be new, empty, or a run of ours (`check_out`): a run marks its --out (`RUN_MARKER`) before its first
write there, and never writes into a folder holding a model or files it did not make. `--resume` continues in the
--out given, with the --target given, after checking that it is the model the run was trained on (`target_identity`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import typer

from ..errors import DFlashError
from ..dtypes import dtype_name
from .recipe import choose_mask_token, default_taps  # noqa: F401 (default_taps re-exported)
from .recipe import drafter_config as recipe_drafter_config
from .trainer import LABELS, STATE_DIR, TrainConfig


@dataclass
class TrainArgs:
    """Everything `dflash-mlx train` was asked for; stored with each checkpoint so `--resume` needs no other flags
    than --target and --out (which win over the saved ones)."""

    target: str
    out: str
    data: List[str] = field(default_factory=list)
    cache: Optional[str] = None  # default: OUT/features
    steps: int = TrainConfig.steps
    lr: float = TrainConfig.lr
    warmup: Optional[int] = None  # default: 4% of the steps
    weight_decay: float = TrainConfig.weight_decay
    grad_clip: float = TrainConfig.grad_clip
    block_size: int = 16
    num_layers: int = 5
    target_layers: Optional[List[int]] = None
    intermediate_size: Optional[int] = None
    anchors: int = 128
    rows: int = 1
    batch_blocks: int = 512
    labels: str = "data"
    seq_len: int = 512
    gamma: Optional[float] = None
    kl: float = 0.0
    kl_topk: Optional[int] = None  # default: 8 with --kl, else 0 (the target's logits are then never computed)
    draft_vocab: Optional[int] = None
    mask_token_id: Optional[int] = None
    max_data_tokens: Optional[int] = None
    regenerate: int = 0
    gen_batch: int = 16
    eval_prompts: int = 4
    eval_every: int = 200
    eval_tokens: int = 64
    checkpoint_every: int = 200
    seed: int = 0
    dtype: str = "fp32"
    compile: bool = True
    max_minutes: Optional[float] = None  # stop (checkpointed, resumable) after this much training time
    progress: bool = True

    def train_config(self):
        return TrainConfig(steps=self.steps, lr=self.lr, warmup=self.warmup, weight_decay=self.weight_decay,
                           grad_clip=self.grad_clip, rows_per_step=self.rows, anchors=self.anchors,
                           batch_blocks=self.batch_blocks, gamma=self.gamma, kl=self.kl, labels=self.labels,
                           compile=self.compile, seed=self.seed, checkpoint_every=self.checkpoint_every,
                           eval_every=self.eval_every, eval_tokens=self.eval_tokens)

    def command_line(self) -> str:
        """The `dflash-mlx train` invocation of these options (defaults left out)."""
        parts = ["dflash-mlx", "train"]
        defaults = TrainArgs(target="", out="")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("progress", "max_minutes") or (f.name not in ("target", "out") and value == getattr(defaults, f.name)):
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.name == "data":
                parts += [x for v in value for x in ("--data", shlex.quote(v))]
            elif isinstance(value, list):
                parts += [flag, ",".join(map(str, value))]
            elif isinstance(value, bool):
                parts += [flag if value else "--no-" + flag[2:]]
            else:
                parts += [flag, shlex.quote(str(value))]
        return " ".join(parts)

    def __post_init__(self):
        if self.kl_topk is None:
            self.kl_topk = 8 if self.kl > 0 else 0
        if self.kl > 0 and self.kl_topk <= 0:
            raise DFlashError("--kl needs --kl-topk > 0")

    @property
    def cache_dir(self) -> Path:
        return Path(self.cache) if self.cache else Path(self.out) / "features"


# -- checks before any work ----------------------------------------------------------------------------------------
def _positive(value) -> bool:
    """A finite number above 0 (nan and inf fail)."""
    return value is not None and math.isfinite(value) and value > 0


def check_options(args: TrainArgs) -> None:
    """Refuse options that cannot train, in one line each, before anything loads or is written.

    (The tapped layers need the target's depth: `check_target_options` checks them once it is loaded.)
    """
    def bad(flag: str, want: str, value) -> DFlashError:
        return DFlashError(f"{flag} must be {want}, got {value}")

    counts = dict(steps=args.steps, num_layers=args.num_layers, anchors=args.anchors, rows=args.rows,
                  batch_blocks=args.batch_blocks, gen_batch=args.gen_batch, eval_tokens=args.eval_tokens)
    for name, value in counts.items():
        if value < 1:
            raise bad("--" + name.replace("_", "-"), "at least 1", value)
    if args.block_size < 2:
        raise bad("--block-size", "at least 2 for training (a given token and at least one drafted)",
                  args.block_size)
    if args.seq_len < args.block_size + 2:  # a row holds at least one context token, a block and its label
        raise bad("--seq-len", f"at least --block-size + 2 = {args.block_size + 2} tokens", args.seq_len)
    if not _positive(args.lr):
        raise bad("--lr", "a positive finite number", args.lr)
    if args.gamma is not None and not _positive(args.gamma):
        raise bad("--gamma", "a positive finite number", args.gamma)
    if not 0 <= args.kl <= 1:  # nan fails too
        raise bad("--kl", "a mixing weight between 0 and 1", args.kl)
    if args.labels not in LABELS:
        raise DFlashError(f"--labels {args.labels!r} is not one of {', '.join(LABELS)}")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise bad("--max-minutes", "a positive number of minutes", args.max_minutes)
    # 0 means "off" for these (the loop tests them for truth): only negatives are mistakes.
    for flag, value, zero in (("--checkpoint-every", args.checkpoint_every, "only at the end"),
                              ("--eval-every", args.eval_every, "only at the end"),
                              ("--regenerate", args.regenerate, "train on the data as is"),
                              ("--eval-prompts", args.eval_prompts, "no held-out τ"),
                              ("--kl-topk", args.kl_topk, "none cached"),
                              ("--warmup", args.warmup, "no warmup")):
        if value is not None and value < 0:
            raise bad(flag, f"0 ({zero}) or more", value)
    for flag, value in (("--weight-decay", args.weight_decay), ("--grad-clip", args.grad_clip)):
        if not (math.isfinite(value) and value >= 0):
            raise bad(flag, "a finite number, 0 or more", value)
    for flag, value in (("--draft-vocab", args.draft_vocab), ("--intermediate-size", args.intermediate_size),
                        ("--max-data-tokens", args.max_data_tokens)):
        if value is not None and value < 1:
            raise bad(flag, "a positive number", value)
    if args.mask_token_id is not None and args.mask_token_id < 0:
        raise bad("--mask-token-id", "a token id (0 or more)", args.mask_token_id)


def check_target_options(args: TrainArgs, target) -> None:
    """The options that need the loaded target: tapped layers, mask token and draft vocabulary within its range."""
    n, V = target.num_layers, target.vocab_size
    if args.target_layers:
        wrong = [t for t in args.target_layers if not 0 <= t < n]
        if wrong:
            raise DFlashError(f"--target-layers {','.join(map(str, args.target_layers))}: the target has {n} "
                              f"layers (0..{n - 1}), so {','.join(map(str, wrong))} is out of range")
    if args.mask_token_id is not None and args.mask_token_id >= V:
        raise DFlashError(f"--mask-token-id {args.mask_token_id} is outside the target's vocabulary of {V} tokens")
    if args.draft_vocab is not None and args.draft_vocab > V:
        raise DFlashError(f"--draft-vocab {args.draft_vocab} is larger than the target's vocabulary of {V} tokens")


# What a training run of ours writes into --out. A folder holding anything else is not ours to write into.
RUN_MARKER = ".dflash-train-run.json"  # written before a run's first write into --out
RUN_FILES = ("config.json", "model.safetensors", "README.md", "tau_curve.png", "bench_figures.json")
MODEL_FILES = ("config.json", "model.safetensors")
CACHE_FILES = ("meta.json", "tokens.npy", "trainable.npy", "eval.json", "features.f16", "argmax.i32",
               "topk_ids.i32", "topk_logp.f16", "progress.json")  # features.py's layout
HARMLESS = (".DS_Store",)  # Finder's folder settings: not the user's data


def _is_state_dir(path: Path) -> bool:
    """A train_state/ as trainer.save writes it: latest.json and step-N folders (plus their temporaries)."""
    if not path.is_dir() or path.is_symlink():
        return False
    for p in path.iterdir():
        name = p.name.removesuffix(".tmp")
        if not (name == "latest.json" or name.lstrip(".").startswith("step-")):
            return False
    return True


def _is_cache_dir(path: Path) -> bool:
    """A folder holding only a feature cache's files (or nothing)."""
    return path.is_dir() and not path.is_symlink() and all(
        p.name.removesuffix(".tmp") in CACHE_FILES and p.is_file() for p in path.iterdir())


def check_out(out: Path) -> None:
    """--out must be new, empty, or a training run of ours: marked by RUN_MARKER, or (runs from before the marker)
    holding a train_state/. A run's folder may hold only what runs write (RUN_FILES, train_state/, features/);
    anything else, or a model no run of ours wrote (a target, a converted drafter), is refused untouched."""
    out = Path(out).expanduser()
    if not out.exists():
        return
    if not out.is_dir():
        raise DFlashError(f"--out '{out}' is a file; give a new or empty folder")
    names = sorted(p.name for p in out.iterdir() if p.name not in HARMLESS)
    ours = RUN_MARKER in names or (_is_state_dir(out / STATE_DIR) and (out / STATE_DIR / "latest.json").is_file())
    model = [n for n in names if n in MODEL_FILES or n.endswith(".safetensors")]
    if model and not ours:
        raise DFlashError(f"--out '{out}' holds a model ({', '.join(model)}) that no dflash-mlx train run wrote; "
                          "training would overwrite it: give a new or empty folder")

    def belongs(name: str) -> bool:
        path = out / name
        if name in (RUN_MARKER, RUN_MARKER + ".tmp") or name.removesuffix(".tmp") in RUN_FILES:
            return path.is_file()
        if name == STATE_DIR:
            return _is_state_dir(path)
        if _is_cache_dir(path):  # the default cache, or a --cache the user put inside a run of ours
            return ours or name == "features"
        return False

    foreign = [n for n in names if not belongs(n)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DFlashError(f"--out '{out}' holds files that are not part of a dflash-mlx train run ({shown}); "
                          "give a new or empty folder, or one a previous training run wrote")


def check_cache_dir(path: Path) -> None:
    """An explicit --cache must be new, empty, or a feature cache (features.py writes into it freely)."""
    path = Path(path).expanduser()
    if path.exists() and not _is_cache_dir(path):
        raise DFlashError(f"--cache '{path}' holds files that are not a feature cache; give a new or empty folder "
                          "or one a previous run built")


def claim_out(out: Path) -> None:
    """Mark --out as a run of ours before the first write into it, so later runs can tell it from a user's folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / RUN_MARKER
    if not marker.is_file():
        tmp = out / (RUN_MARKER + ".tmp")
        tmp.write_text(json.dumps({"written_by": "dflash-mlx train", "format": 1}) + "\n")
        os.replace(tmp, marker)


def _inside(path: Path, root: Path) -> bool:
    return Path(path).expanduser().resolve().is_relative_to(Path(root).expanduser().resolve())


# -- the target ----------------------------------------------------------------------------------------------------
def load_target(ref: str):
    """(model, tokenizer, path) for a local mlx-lm dir, an offline or registry name, or a hub repo id."""
    from ..models.loading import load_target as load, resolve_target

    ref = resolve_target(ref)
    model, tokenizer = load(ref)
    return model, tokenizer, ref


def target_identity(model) -> str:
    """A fingerprint of what the target computes, wherever it is stored: its configuration and, for every weight,
    name, shape, dtype and a strided sample of its values. A copy matches; a fine-tune, another quantization or
    another size does not. Cheap: a few thousand values per tensor, never the whole weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    a = getattr(model, "args", None)
    config = dataclasses.asdict(a) if dataclasses.is_dataclass(a) else dict(vars(a)) if a is not None else {}
    # Values JSON cannot hold count by their type only: their repr may hold a memory address, unstable across runs.
    h.update(json.dumps(config, sort_keys=True, default=lambda o: type(o).__name__).encode())
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        flat = p.reshape(-1)
        sample = flat[:: max(1, flat.size // 4096)][:4096]
        if sample.dtype == mx.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
            sample = sample.astype(mx.float32)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(np.asarray(sample).tobytes())
    return h.hexdigest()


def _cache_target(cache_dir: Path) -> Optional[str]:
    """The target reference a feature cache's fingerprint names, if there is a cache."""
    file = Path(cache_dir) / "meta.json"
    try:
        return json.loads(file.read_text()).get("fingerprint", {}).get("target") if file.is_file() else None
    except (OSError, ValueError):
        return None


def _check_resumed_target(saved: Dict, given: str, target, identity: str, args: "TrainArgs", target_ref: str):
    """Refuse a --target that is not the model the checkpoint was trained on; returns the target reference to
    expect in the feature cache's fingerprint (the cache came from the same model, maybe at another path)."""
    saved_ref = saved["args"]["target"]
    stored = _cache_target(args.cache_dir)

    def other(why: str) -> DFlashError:
        return DFlashError(f"--target '{given}' is not the model this run was trained on ('{saved_ref}'): {why}; "
                           f"resume with --target {saved_ref} (or a copy of it), or start a new run in another --out")

    if saved.get("target_identity"):
        if saved["target_identity"] != identity:
            raise other("its configuration or weights differ")
    elif given != saved_ref and stored != target_ref:
        # A checkpoint from before target fingerprints: compare the target's features with the cached ones.
        from .features import FeatureCache
        import mlx.core as mx

        cache = FeatureCache.open(args.cache_dir)  # no fingerprint: the target's path is what differs
        if cache is None or cache.rows_done < 1:
            raise other("the run predates target fingerprints and has no feature cache to compare with")
        target.set_taps(list(args.target_layers))
        _, hidden = target(mx.array(np.asarray(cache.tokens[:1])))
        ours = np.asarray(hidden.astype(mx.float32))[0]
        theirs = np.asarray(cache.features()[0], dtype=np.float32)
        scale = max(1.0, float(np.abs(theirs).max()))
        if ours.shape != theirs.shape or not np.allclose(ours, theirs, rtol=2e-2, atol=2e-2 * scale):
            raise other("its features on the cached data differ")
    return stored or target_ref


def drafter_config(target, model, args: TrainArgs, mask_token_id: int):
    """`recipe.drafter_config` for an mlx-lm target (its `model.args`)."""
    return recipe_drafter_config(getattr(model, "args", None), hidden_size=target.hidden_size,
                                 num_target_layers=target.num_layers, vocab_size=target.vocab_size,
                                 num_layers=args.num_layers, block_size=args.block_size, mask_token_id=mask_token_id,
                                 taps=args.target_layers, intermediate_size=args.intermediate_size,
                                 draft_vocab=args.draft_vocab)


def output_scale(target, default):
    """The drafter's final-norm weight to start from: the target's own final-norm gain.

    The drafter's output goes through the target's head, whose logits are calibrated for the target's normed
    residual stream. RMSNorm removes magnitude, so this gain alone sets the logit scale, and AdamW moves it only
    about `lr` per step: starting far off (Qwen2.5's gain averages ~7) leaves the loss near log V for thousands of
    steps. norm(ones) reads the gain whatever the norm's parametrization (Gemma's 1 + w included).
    """
    import mlx.core as mx

    norm = getattr(target.inner, "norm", None)
    if norm is None:
        return default * 0.1  # unknown layout: start near a uniform guess rather than with huge logits
    gain = norm(mx.ones((1, target.hidden_size), dtype=mx.float32))[0]
    return gain.astype(default.dtype) if gain.shape == default.shape else default * 0.1


def pick_mask_token(tokenizer, target, tokens: np.ndarray) -> int:
    """`recipe.choose_mask_token` with the MLX target's embedding."""
    import mlx.core as mx

    return choose_mask_token(tokenizer, target.vocab_size, tokens,
                             lambda i: mx.abs(target.embed(mx.array([[i]]))).sum().item() > 0)


# -- the run -------------------------------------------------------------------------------------------------------
def _fingerprint(args: TrainArgs, target_ref: str, taps: List[int], feature_dim: int) -> Dict:
    return dict(format=2, target=target_ref, taps=list(taps), feature_dim=feature_dim, seq_len=args.seq_len,
                topk=args.kl_topk, data=list(args.data), max_data_tokens=args.max_data_tokens,
                regenerate=args.regenerate, eval_prompts=args.eval_prompts, seed=args.seed)


def prepare_cache(args: TrainArgs, model, tokenizer, target, target_ref: str, taps: List[int], log,
                  writable: bool = True):
    """Open or build the feature cache and finish its extraction. Returns (cache, extraction stats or None).

    `writable=False` (a resume whose cache lies outside its --out, not given this time) refuses to build or extend
    it: a resume writes nowhere but its --out.
    """
    from .data import prepare_data
    from .features import FeatureCache

    feature_dim = len(taps) * target.hidden_size
    fingerprint = _fingerprint(args, target_ref, taps, feature_dim)
    cache = FeatureCache.open(args.cache_dir, fingerprint)
    if (cache is None or not cache.complete) and not writable:
        state = "missing" if cache is None else "incomplete"
        raise DFlashError(f"the run's feature cache '{args.cache_dir}' is {state} and lies outside --out, where a "
                          "resume does not write; pass --cache DIR to rebuild it")
    if cache is None:
        if not args.data:
            raise DFlashError(f"--data is required (no feature cache yet at {args.cache_dir})")
        data = prepare_data(tokenizer, args.data, seq_len=args.seq_len, max_tokens=args.max_data_tokens,
                            num_eval=args.eval_prompts, seed=args.seed, model=model, regenerate_tokens=args.regenerate,
                            batch_size=args.gen_batch, progress=args.progress)
        log(f"data: {data.summary['documents']} documents, {data.tokens.size} tokens in {data.tokens.shape[0]} rows "
            f"of {args.seq_len}, {data.summary['trainable_tokens']} trainable; {len(data.eval_prompts)} held out")
        if data.summary.get("generation"):
            g = data.summary["generation"]
            log(f"target answers: {g['tokens']} tokens in {g['seconds']:.0f} s ({g['tok_s']:.1f} tok/s, batches of "
                f"{args.gen_batch})")
        if _inside(args.cache_dir, args.out):
            claim_out(Path(args.out))
        cache = FeatureCache.create(args.cache_dir, data, feature_dim=feature_dim, topk=args.kl_topk,
                                    fingerprint=fingerprint)
    stats = None
    if not cache.complete:
        target.set_taps(taps)
        stats = cache.extract(target, progress=args.progress)
        log(f"features: {stats['tokens']} tokens in {stats['seconds']:.1f} s "
            f"({stats['tokens'] / max(stats['seconds'], 1e-9):.0f} tok/s)")
        meta = dict(cache.meta, extraction=stats)
        (cache.path / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        cache.meta = meta
    return cache, stats


def _saved_args(raw: Dict, overrides: Dict) -> TrainArgs:
    """The options a checkpoint was trained with (older runs: their implicit defaults), with `overrides`."""
    raw = dict(raw)
    if "batch_blocks" not in raw:  # a run from before gradient accumulation: one micro-batch per step
        raw["batch_blocks"] = raw.get("rows", 1) * raw.get("anchors", 32)
        if raw.get("warmup") is None:
            raw["warmup"] = max(1, raw.get("steps", 2000) // 20)
    return TrainArgs(**dict(raw, **{k: v for k, v in overrides.items() if v is not None}))


def _setup(args: TrainArgs, resume: bool, log, overrides: Optional[Dict] = None):
    """Target, feature cache, bound drafter and trainer (restored from the latest checkpoint with `resume`)."""
    import mlx.core as mx

    from ..api import prepare
    from ..drafters.config import DFlashConfig
    from ..drafters.io import build_drafter
    from ..targets import build_target
    from .device import features_on_device, pick_device
    from .trainer import Trainer, latest_checkpoint
    from .vocab import head_rows, maps, select_vocab

    out = Path(args.out)
    check_out(out)
    checkpoint = latest_checkpoint(out)
    saved, given = None, args
    if checkpoint is not None and not resume:
        raise DFlashError(f"'{out}' holds a training run (step {checkpoint.name[5:]}); pass --resume to continue "
                          "it or choose another --out")
    if resume:
        if checkpoint is None:
            raise DFlashError(f"nothing to resume in '{out}' (no checkpoint yet); run the same command without "
                              "--resume: an interrupted feature extraction continues by itself")
        saved = json.loads((checkpoint / "trainer.json").read_text())
        # The saved options apply, but the paths given win: the run continues in the --out given (a copy of a run
        # must never write into the original), with the --target given (checked below to be the trained model).
        args = _saved_args(saved["args"], dict(overrides or {}, progress=args.progress, target=given.target,
                                               out=given.out, cache=given.cache))
        check_options(args)
        log(f"resuming {checkpoint} (step {saved['step']} of {args.steps}) with its saved options")
    if args.cache:
        check_cache_dir(args.cache_dir)

    model, tokenizer, target_ref = load_target(args.target)
    target = build_target(model)
    identity = target_identity(model)
    check_target_options(args, target)
    args.target_layers = list(args.target_layers or default_taps(target.num_layers, args.num_layers))
    cache_ref, writable = target_ref, True
    if saved is not None:
        cache_ref = _check_resumed_target(saved, given.target, target, identity, args, target_ref)
        # A cache outside --out that this command did not name is only read: a resume writes only into --out.
        writable = given.cache is not None or _inside(args.cache_dir, out)
    cache, extraction = prepare_cache(args, model, tokenizer, target, cache_ref, args.target_layers, log,
                                      writable=writable)

    if saved is not None:
        config = DFlashConfig.from_dict(saved["drafter_config"])
    else:
        if args.mask_token_id is None:
            args.mask_token_id = pick_mask_token(tokenizer, target, cache.tokens)
        config = drafter_config(target, model, args, args.mask_token_id)
    mx.random.seed(args.seed)
    drafter = build_drafter(config)
    if saved is None:
        drafter.norm.weight = output_scale(target, drafter.norm.weight)
    if config.draft_vocab_size and saved is None:  # on resume the head and d2t come with the checkpoint
        labels, mask = np.asarray(cache.tokens), np.asarray(cache.trainable)
        if args.labels == "target" and cache.argmax() is not None:
            # The tokens trained on are the target's choices: argmax[p] labels position p + 1.
            labels, mask = np.asarray(cache.argmax())[:, :-1], mask[:, 1:]
        ids = select_vocab(labels, mask, config.draft_vocab_size, config.vocab_size,
                           always=getattr(tokenizer, "eos_token_ids", None) or [])
        drafter.d2t = mx.array(maps(ids, config.vocab_size)[0])
        drafter.lm_head.weight = head_rows(target, ids)
    mx.eval(drafter.parameters())
    target = prepare(model, drafter)  # checks the pair, taps the drafter's layers, binds embedding and head
    choice = pick_device()
    nbytes = cache.rows * cache.seq_len * cache.feature_dim * 2
    resident = features_on_device(nbytes, choice)
    log(f"device: {choice.describe()}; feature cache {nbytes / 2 ** 30:.2f} GiB "
        f"{'kept on the device' if resident else 'memory-mapped on the host'}")
    trainer = Trainer(drafter, cache, args.train_config(), device_features=resident)
    trainer.device = choice.describe()
    trainer.target_identity = identity  # saved with each checkpoint: a resume checks its --target against it
    if checkpoint is not None:
        trainer.load(checkpoint)
    return args, tokenizer, target, drafter, trainer, cache, extraction


def run(args: TrainArgs, *, resume: bool = False, log=print, steps: Optional[int] = None,
        max_minutes: Optional[float] = None, workers: Optional[int] = None, announce: bool = True) -> Path:
    """Train a drafter as `args` says; returns the output directory (a loadable drafter).

    With `resume`, the run's saved options apply; `steps` and `max_minutes` (if given) replace the saved ones, so a
    bounded run can be continued and extended session after session. The paths given win: the run continues in
    `args.out` (a copy of a run never touches the original) with `args.target`, which must be the trained model.
    With `workers` > 1 (None: one per CPU core when training on the CPU, see `parallel.default_workers`) this
    process prepares the data and the feature cache, then starts that many ranks on this machine to train data-parallel and waits for them. Under `mlx.launch` every
    rank runs this; rank 0 prepares first, evaluates and writes. `announce=False` keeps the setup lines quiet.
    """
    from mlx.utils import tree_flatten

    from ..distributed.group import launched, rank0_first, setup
    from .parallel import LocalWorkers, default_workers

    overrides = dict(steps=steps, max_minutes=max_minutes)
    # Every option is checked before anything loads (with --resume: the given ones, and the saved ones later).
    check_options(dataclasses.replace(args, **{k: v for k, v in overrides.items() if v is not None}))
    if not resume:
        args = dataclasses.replace(args, **{k: v for k, v in overrides.items() if v is not None})
    quiet = log if announce else (lambda *a: None)
    if launched():
        if workers is not None and workers > 1:
            raise DFlashError("--workers starts ranks on this machine; under mlx.launch leave it out (every "
                              "launched rank trains)")
        group = setup()
        with rank0_first(group):  # rank 0 reads the data and builds the feature cache before the others open it
            state = _setup(args, resume, quiet, overrides)
        return _train(state, log, group)
    state = _setup(args, resume, quiet, overrides)
    trainer = state[4]
    if workers is None:
        model_bytes = sum(v.nbytes for _, v in tree_flatten(state[2].model.parameters()))
        workers = min(default_workers(trainer.backend, model_bytes), trainer.config.accum)
    if workers <= 1:
        return _train(state, log, None)
    if workers > trainer.config.accum:
        raise DFlashError(f"--workers {workers} but only {trainer.config.accum} micro-batch(es) per step: raise "
                          f"--batch-blocks to at least {workers * trainer.config.micro_blocks} or use fewer workers")
    out = Path(state[0].out)
    del state, trainer  # the ranks load their own copies
    LocalWorkers(workers, dict(args=dataclasses.asdict(args), resume=resume, steps=steps,
                               max_minutes=max_minutes)).run()
    return out


def _train(state, log, group) -> Path:
    """The training loop, evaluations, checkpoints and the written drafter (rank 0 of a group writes)."""
    import time

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tqdm import tqdm

    from ..drafters.io import build_drafter, save_drafter
    from .card import projection_text, write_card
    from .parallel import DataParallel
    from .trainer import held_out_tau

    args, tokenizer, target, drafter, trainer, cache, extraction = state
    out = Path(args.out)
    if group is not None and group.size() > 1:
        trainer.join(DataParallel(group))
        trainer.device += f" x {group.size()} data-parallel ranks"
    leader = group is None or group.rank() == 0
    ranks = 1 if group is None else group.size()
    stops = list(getattr(tokenizer, "eos_token_ids", None) or [])

    def evaluate():
        if not cache.eval_prompts:
            return None
        r = held_out_tau(target, drafter, cache.eval_prompts, max_tokens=args.eval_tokens, stop_tokens=stops)
        trainer.history.append({"step": trainer.step, "slots": trainer.predicted, "flops": trainer.flops,
                                "tau": round(r["tau"], 4), "passes": r["passes"]})
        return r["tau"]

    def checkpoint():
        claim_out(out)
        trainer.save(out, {"args": dataclasses.asdict(args), "command": args.command_line(),
                           "target_identity": getattr(trainer, "target_identity", None)})

    tau = trainer.history[-1]["tau"] if trainer.history else None
    if trainer.step == 0 and not trainer.history and leader:
        tau = evaluate()
        log(f"held-out τ before training: {tau}")
    cfg = trainer.config
    shared = f", shared by {ranks} data-parallel ranks" if ranks > 1 else ""
    log(f"training: {cfg.accum} micro-batch(es) of {cfg.rows_per_step} row(s) x {cfg.anchors} anchors = "
        f"{cfg.accum * cfg.micro_blocks} blocks per step{shared}, {trainer.flops_per_micro * cfg.accum / 1e12:.2f} "
        f"TFLOP per step, labels from the {cfg.labels}")
    bar = tqdm(total=args.steps, initial=trainer.step, desc="training", unit="step",
               disable=not (args.progress and leader))
    loss_ema = None
    started, slots0, elapsed0 = time.perf_counter(), trainer.predicted, trainer.elapsed
    step0, after_first = trainer.step, None  # the step time without the first step's compilation
    while trainer.step < args.steps:
        if args.max_minutes is not None:
            stop = time.perf_counter() - started > 60 * args.max_minutes
            if trainer.parallel is not None:
                stop = trainer.parallel.agree(stop)  # rank 0's clock decides for every rank
            if stop:
                log(f"--max-minutes {args.max_minutes} reached at step {trainer.step}; continue with --resume")
                break
        m = trainer.train_step()
        if after_first is None:
            after_first = trainer.elapsed
        loss_ema = m["loss"] if loss_ema is None else 0.95 * loss_ema + 0.05 * m["loss"]
        if not leader:
            continue
        if args.eval_every and trainer.step % args.eval_every == 0:
            tau = evaluate()
        if args.checkpoint_every and trainer.step % args.checkpoint_every == 0:
            checkpoint()
        held = "-" if tau is None else f"{tau:.2f}"
        rate = (trainer.predicted - slots0) / max(trainer.elapsed - elapsed0, 1e-9)
        bar.set_postfix_str(f"loss {loss_ema:.3f} acc1 {m['acc1']:.2f} train-τ {m['tau']:.2f} held-out τ {held} "
                            f"{rate:.0f} slots/s", refresh=False)
        bar.update(1)
    bar.close()
    if not leader:
        return out
    if trainer.history and trainer.history[-1]["step"] == trainer.step:
        tau = trainer.history[-1]["tau"]
    else:
        tau = evaluate()
    checkpoint()
    export = build_drafter(drafter.config)  # a copy to cast: the checkpoint keeps float32
    export.load_weights(list(tree_flatten(drafter.parameters())))
    export.set_dtype(getattr(mx, dtype_name(args.dtype)))
    save_drafter(export, out)
    write_card(out, args, drafter.config, trainer, cache, extraction)
    rate = (trainer.predicted - slots0) / max(trainer.elapsed - elapsed0, 1e-9)
    steady = ""
    if after_first is not None and trainer.step - step0 > 1:
        steady = f", {(trainer.elapsed - after_first) / (trainer.step - step0 - 1):.4f} s/step after the first"
    log(f"{trainer.step} steps, {trainer.predicted} slots in {trainer.elapsed:.0f} s ({rate:.0f} slots/s this "
        f"session{f' on {ranks} ranks' if ranks > 1 else ''}{steady}); held-out τ {tau}; wrote {out}")
    log(projection_text(trainer.history))
    return out


# -- CLI -------------------------------------------------------------------------------------------------------------
def _ints(text: Optional[str]) -> Optional[List[int]]:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DFlashError(f"--target-layers takes comma-separated integers, got {text!r}") from None


def train_command(
    target: str = typer.Option(..., "--target", "-t", help="Target: local mlx-lm dir, offline "
                                             "model name (see 'dflash-mlx models') or hub repo id."),
    data: Optional[List[str]] = typer.Option(None, "--data", help="Training data: files, directories "
                                                           "or globs (text/code, or .jsonl chats); repeatable."),
    out: Path = typer.Option(..., "--out", "-o", help="Output drafter directory."),
    cache: Optional[Path] = typer.Option(None, "--cache", help="Feature cache dir (default OUT/features)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (default 2000; with "
                                                    "--resume: extend or shorten the saved run)."),
    lr: float = typer.Option(6e-4, "--lr", help="Peak learning rate (AdamW, warmup + cosine)."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Warmup steps (default 4% of --steps)."),
    grad_clip: float = typer.Option(1.0, "--grad-clip", help="Clip the gradient norm (0: off)."),
    block_size: int = typer.Option(16, "--block-size", help="Block size B."),
    num_layers: int = typer.Option(5, "--num-layers", help="Draft layers (also the number of taps)."),
    target_layers: Optional[str] = typer.Option(None, "--target-layers", help="Tapped target layers, "
                                                              "e.g. 1,9,17 (default: spread evenly)."),
    intermediate_size: Optional[int] = typer.Option(None, "--intermediate-size", help="Draft MLP "
                                                                  "width (default: the target's)."),
    anchors: int = typer.Option(128, "--anchors", help="Blocks (random anchors) per row."),
    rows: int = typer.Option(1, "--rows", help="Rows (packed sequences) per micro-batch."),
    batch_blocks: int = typer.Option(512, "--batch-blocks", help="Blocks per optimizer step "
                                                 "(gradient accumulation over micro-batches)."),
    labels: str = typer.Option("data", "--labels", help="Slot labels: 'data' (the text's next tokens) "
                                           "or 'target' (the target's own argmax there: no --regenerate needed)."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per row (context length trained on)."),
    gamma: Optional[float] = typer.Option(None, "--gamma", help="Slot weight decay γ (default 7 for "
                                                        "B=16, 5 for 10, 4 for 8)."),
    kl: float = typer.Option(0.0, "--kl", help="Weight of the target's top-k distribution in the "
                                           "loss (0..1; rest: cross-entropy on the data)."),
    kl_topk: Optional[int] = typer.Option(None, "--kl-topk", help="Target top-k cached per token (default 8 with "
                                          "--kl, else 0)."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", help="Reduced draft "
                                                            "vocabulary: the N most frequent tokens of the data."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="Mask token (default: "
                                                              "an unused special token)."),
    max_data_tokens: Optional[int] = typer.Option(None, "--max-data-tokens", help="Read at most "
                                                                "this many tokens of data."),
    regenerate: int = typer.Option(0, "--regenerate", help="Let the target answer every prompt "
                                                 "itself, up to N tokens (0: train on the data as is)."),
    gen_batch: int = typer.Option(16, "--gen-batch", help="Prompts per batch for --regenerate."),
    eval_prompts: int = typer.Option(4, "--eval-prompts", help="Held-out documents for τ."),
    eval_every: int = typer.Option(200, "--eval-every", help="Measure held-out τ every N steps."),
    eval_tokens: int = typer.Option(64, "--eval-tokens", help="New tokens per held-out prompt."),
    checkpoint_every: int = typer.Option(200, "--checkpoint-every", help="Checkpoint every N steps."),
    seed: int = typer.Option(0, "--seed", help="Seed for data order, anchors and initialization."),
    dtype: str = typer.Option("fp32", "--dtype", help="Saved drafter dtype: fp32, bf16, fp16."),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="Compile the training step."),
    max_minutes: Optional[float] = typer.Option(None, "--max-minutes", help="Stop after this much "
                                                              "training (checkpointed; continue with --resume)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out (its saved "
                                              "options apply; --target must be the model it was trained on)."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Training processes on this machine, "
                                          "each computing a share of every step (data parallel). Default: one per "
                                          "CPU core when training on the CPU (as memory allows), 1 on a GPU."),
):
    """Train a DFlash drafter for a target: cache its features once, then train (resumable)."""
    dtype_name(dtype)  # a bad --dtype fails before anything loads
    args = TrainArgs(target=target, out=str(out), data=list(data or []), cache=str(cache) if cache else None,
                     steps=TrainArgs.steps if steps is None else steps, lr=lr, warmup=warmup, grad_clip=grad_clip, block_size=block_size, num_layers=num_layers,
                     target_layers=_ints(target_layers), intermediate_size=intermediate_size, anchors=anchors,
                     rows=rows, batch_blocks=batch_blocks, labels=labels, seq_len=seq_len, gamma=gamma, kl=kl, kl_topk=kl_topk, draft_vocab=draft_vocab,
                     mask_token_id=mask_token_id, max_data_tokens=max_data_tokens, regenerate=regenerate,
                     gen_batch=gen_batch, eval_prompts=eval_prompts, eval_every=eval_every, eval_tokens=eval_tokens,
                     checkpoint_every=checkpoint_every, seed=seed, dtype=dtype, compile=compile)
    run(args, resume=resume, steps=steps, max_minutes=max_minutes, workers=workers)
