"""Bring a drafter trained on the GPU machine back in the few small files that machine returns.

The machine hands back at most 8 files of 16 MiB (64 MiB together) per command. A drafter with a reduced draft
vocabulary carries its head rows, but those are the target's own output-embedding rows picked by `d2t`
(`lm_head.weight[i] = head[i + d2t[i]]`): they need not travel. `pack` writes the other tensors into
safetensors files of at most `--file-mib` each plus the small run files in `meta.tar.gz`; `restore`, here,
rebuilds the whole z-lab-layout checkpoint with the head rows taken from the local target and checks them
against the sha256 the machine recorded (same target, same bf16 rounding), so a mismatched target stops it.

    python benchmarks/gpu_drafter.py pack RUN_DIR OUT_DIR [--file-mib 15] [--extra FILE ...]
    python benchmarks/gpu_drafter.py restore BACK_DIR TARGET_HF_DIR OUT_DIR
    python benchmarks/gpu_drafter.py curve LOG_JSONL PNG [--title T]   # held-out block τ vs training FLOPs
    python benchmarks/gpu_drafter.py init DRAFTER_DIR TARGET_DIR OUT_DIR  # a shipped drafter, packed to start from

`init` (here, with MLX) turns a converted, possibly quantized drafter back into the trainer's bf16 layout — its
layers dequantized, its head rows the target's exact ones — and packs it like `pack`, so a GPU stay can continue
from it (`restore` there, then `python -m dflash_mlx.torch_train --init`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

HEAD = "lm_head.weight"
RUN_FILES = ("config.json", "log.jsonl", "train_args.json", "eval_prompts.json")


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def pack(run: Path, out: Path, file_mib: float, extra=()) -> None:
    weights = load_file(str(run / "model.safetensors"))
    head = weights.pop(HEAD, None)
    out.mkdir(parents=True, exist_ok=True)
    limit, groups, size = int(file_mib * 2 ** 20) - 65536, [{}], 0
    for name in sorted(weights):
        n = weights[name].numel() * weights[name].element_size()
        if groups[-1] and size + n > limit:
            groups.append({})
            size = 0
        groups[-1][name] = weights[name]
        size += n
    for k, group in enumerate(groups):
        save_file(group, str(out / f"layers-{k}.safetensors"), metadata={"format": "pt"})
    info = {"files": len(groups), "head": None if head is None else
            {"shape": list(head.shape), "dtype": str(head.dtype).replace("torch.", ""), "sha256": _digest(head)}}
    (run / "carry.json").write_text(json.dumps(info) + "\n")
    with tarfile.open(out / "meta.tar.gz", "w:gz") as tar:
        for name in RUN_FILES + ("carry.json",):
            if (run / name).is_file():
                tar.add(run / name, arcname=name)
        for path in map(Path, extra):
            if path.is_file():
                tar.add(path, arcname=path.name)
    print(f"packed {sum(len(g) for g in groups)} tensors in {len(groups)} files "
          f"({sum(p.stat().st_size for p in out.glob('layers-*')) / 2 ** 20:.1f} MiB), head left behind")


def restore(back: Path, target: Path, out: Path) -> None:
    if not (back / "meta.tar.gz").is_file():
        sys.exit(f"{back}: no meta.tar.gz; pass the folder the GPU machine's files were copied into")
    if out.exists() and any(out.iterdir()):
        sys.exit(f"{out} is not empty; pass a new folder")
    with tarfile.open(back / "meta.tar.gz") as tar:
        info = json.loads(tar.extractfile("carry.json").read())
    weights = {}
    for k in range(info["files"]):
        part = back / f"layers-{k}.safetensors"
        if not part.is_file():
            sys.exit(f"{part} is missing: {info['files']} layer files were packed")
        weights.update(load_file(str(part)))
    if info["head"] is not None:
        head = _head_rows(target, weights["d2t"]).to(getattr(torch, info["head"]["dtype"])).contiguous()
        if list(head.shape) != info["head"]["shape"] or _digest(head) != info["head"]["sha256"]:
            sys.exit(f"the head rows rebuilt from {target} differ from the trained drafter's: another target?")
        weights[HEAD] = head
    # Everything checked: only now is `out` written (a refused restore leaves nothing behind).
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(back / "meta.tar.gz") as tar:
        tar.extractall(out, members=[m for m in tar.getmembers() if m.name != "carry.json"], filter="data")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"restored {len(weights)} tensors into {out}")


def init(drafter_dir: Path, target: Path, out: Path, file_mib: float = 15) -> None:
    import tempfile

    import mlx.core as mx

    from dflash_mlx.drafters.io import dequantize_drafter, read_drafter, save_drafter

    drafter = read_drafter(drafter_dir)
    dequantize_drafter(drafter, mx.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        run = save_drafter(drafter, Path(tmp) / "run")
        weights = load_file(str(run / "model.safetensors"))
        if HEAD in weights:  # the exact rows, not their 8-bit rounding: what the trainer freezes
            weights[HEAD] = _head_rows(target, weights["d2t"]).to(weights[HEAD].dtype)
            save_file(weights, str(run / "model.safetensors"), metadata={"format": "pt"})
        pack(run, out, file_mib)


def _head_rows(target: Path, d2t: torch.Tensor) -> torch.Tensor:
    """The target's output-embedding rows (tied or untied) picked by `d2t`: row i is target id i + d2t[i]."""
    d2t = d2t.numpy().astype(np.int64)
    source = {}
    for f in sorted(target.glob("*.safetensors")):
        source.update({k: v for k, v in load_file(str(f)).items() if k in ("lm_head.weight",
                                                                           "model.embed_tokens.weight")})
    table = source.get("lm_head.weight", source.get("model.embed_tokens.weight"))
    if table is None:
        sys.exit(f"{target}: neither lm_head.weight nor model.embed_tokens.weight")
    return table[torch.as_tensor(np.arange(len(d2t)) + d2t)]


def curve(log: Path, png: Path, title: str) -> None:
    """The run's held-out block acceptance (teacher-forced blocks on held-out rows) against training FLOPs, drawn
    as the training card draws its curve, with the card's log-linear projection to τ 3.5."""
    from dflash_mlx.train.card import plot_curve, projection_text

    history = [{"step": r["step"], "flops": r["flops"], "slots": r["slots"], "tau": r["eval_tau"]}
               for r in map(json.loads, log.read_text().splitlines()) if "eval_tau" in r]
    note = plot_curve(history, png, title)
    for h in history:
        print(f"step {h['step']:5d}  {h['slots'] / 1e6:6.2f} M slots  {h['flops']:.3g} FLOPs  block tau {h['tau']:.3f}")
    print(note or f"wrote {png}")
    print(projection_text(history[len(history) // 2:]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("run", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--file-mib", type=float, default=15)
    a.add_argument("--extra", nargs="*", default=[])
    b = sub.add_parser("restore")
    b.add_argument("back", type=Path)
    b.add_argument("target", type=Path)
    b.add_argument("out", type=Path)
    c = sub.add_parser("curve")
    c.add_argument("log", type=Path)
    c.add_argument("png", type=Path)
    c.add_argument("--title", default="held-out block τ (B=16) vs training FLOPs")
    i = sub.add_parser("init")
    i.add_argument("drafter", type=Path)
    i.add_argument("target", type=Path)
    i.add_argument("out", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "init":
        init(args.drafter, args.target, args.out)
    elif args.cmd == "curve":
        curve(args.log, args.png, args.title)
    elif args.cmd == "pack":
        pack(args.run, args.out, args.file_mib, args.extra)
    else:
        restore(args.back, args.target, args.out)


if __name__ == "__main__":
    main()
