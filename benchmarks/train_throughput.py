"""Trainer throughput, before and after, measured side by side: two worker processes (a baseline source tree and
this one) build the same run from the same feature cache and take turns training for a few seconds each, so both
see the same machine load. Prints predicted slots per second (wall clock) and per CPU-second for each, and ratios.

    python benchmarks/train_throughput.py --baseline-src /tmp/old-checkout --target PATH --data DIR \\
        --baseline-cache DIR --cache DIR -- --num-layers 3 --draft-vocab 8192 --seq-len 512

Options after `--` are `TrainArgs` fields (`--anchors 32`), given to both sides; `--new NAME=VALUE` adds options
for this tree only (e.g. `--new anchors=128`); `--env NAME=VALUE` sets an environment variable for both workers
(e.g. `--env DFLASH_MLX_BLAS=debian`: a multi-threaded OpenBLAS on both sides). `workers=N` (after `--`, or with `--new`)
trains data-parallel on N processes (as `dflash-mlx train --workers N`); CPU-seconds are summed over them. The cache
directories must already hold complete feature caches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r'''
import json, os, sys, time, tempfile
src, spec = sys.argv[1], json.loads(sys.argv[2])
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, src)
import dflash_mlx
dflash_mlx.__path__.append(src)  # the repo's top-level metal/ and convert/ are dflash_mlx subpackages
import mlx.core as mx
from dflash_mlx.train.args import TrainArgs
from dflash_mlx.train.session import setup_run
spec.pop("workers", None)
group = None
if "MLX_RANK" in os.environ:  # one rank of a data-parallel side (this tree only)
    from dflash_mlx.distributed.group import setup
    from dflash_mlx.train.parallel import DataParallel
    group = setup()
args = TrainArgs(out=tempfile.mkdtemp(), progress=False, **spec)
_, _, _, _, trainer, _, _ = setup_run(args, False, lambda *a: None)
if group is not None:
    trainer.join(DataParallel(group))
rank0 = group is None or group.rank() == 0
total = lambda x: x if group is None else mx.distributed.all_sum(mx.array(x, dtype=mx.float32), group=group, stream=mx.cpu).item()
print(json.dumps({"ready": dflash_mlx.__file__, "blas": getattr(sys.modules.get("dflash_mlx._blas"), "status", "n/a")}), flush=True)
while True:
    budget = float(sys.stdin.readline() or -1)  # every rank reads it: ranks waiting in a collective spin a core
    if budget < 0:
        break
    slots0, wall0, cpu0, t0 = trainer.predicted, time.perf_counter(), time.process_time(), time.perf_counter()
    steps = 0
    while steps == 0 or total(float(time.perf_counter() - t0 < budget) if rank0 else 0.0) > 0:
        trainer.train_step()
        steps += 1
    print(json.dumps({"slots": trainer.predicted - slots0, "wall": time.perf_counter() - wall0,
                      "cpu": total(time.process_time() - cpu0), "steps": steps}), flush=True)
'''


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _spec(pairs):
    spec = {}
    it = iter(pairs)
    for flag in it:
        spec[flag.lstrip("-").replace("-", "_")] = _value(next(it))
    return spec


def split_argv(argv):
    """(this script's arguments, the trainer flags after `--`)."""
    if "--" not in argv:
        return argv, []
    return argv[: argv.index("--")], argv[argv.index("--") + 1 :]


def main() -> None:
    argv, extra = split_argv(sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-src", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--baseline-cache", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--new", action="append", default=[], help="NAME=VALUE for this tree only")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE in both workers' environment")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=30.0, help="training time per turn")
    a = p.parse_args(argv)
    common = dict(_spec(extra), target=a.target, data=[a.data])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = {
        "before": (a.baseline_src, dict(common, cache=a.baseline_cache)),
        "after": (here, dict(common, cache=a.cache, **{k: _value(v) for k, v in (x.split("=", 1) for x in a.new)})),
    }
    env = dict(os.environ, **dict(x.split("=", 1) for x in a.env))
    procs, helpers = {}, {name: [] for name in sides}
    for name, (src, spec) in sides.items():
        argv = [sys.executable, "-c", WORKER, src, json.dumps(spec)]
        rank_env = env
        if int(spec.get("workers", 1)) > 1:  # ranks 1..N-1 in the background, rank 0 talks to this script
            from dflash_mlx.distributed.local import write_hostfile

            hostfile = write_hostfile(Path(tempfile.mkdtemp()) / "hosts.json", int(spec["workers"]))
            rank_env = dict(env, MLX_HOSTFILE=str(hostfile), OPENBLAS_NUM_THREADS="1")
            helpers[name] += [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                         env=dict(rank_env, MLX_RANK=str(r))) for r in range(1, int(spec["workers"]))]
            rank_env = dict(rank_env, MLX_RANK="0")
        procs[name] = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=rank_env)
        ready = json.loads(procs[name].stdout.readline())
        print(f"{name}: {ready['ready']} {spec}; BLAS {ready['blas']}", flush=True)
    totals = {name: {"slots": 0, "wall": 0.0, "cpu": 0.0} for name in sides}
    for r in range(a.rounds):
        for name in (sides if r % 2 == 0 else reversed(list(sides))):
            for proc in [procs[name]] + helpers[name]:
                proc.stdin.write(f"{a.seconds}\n")
                proc.stdin.flush()
            res = json.loads(procs[name].stdout.readline())
            for k in totals[name]:
                totals[name][k] += res[k]
            print(f"round {r + 1} {name:6s}: {res['slots']} slots in {res['wall']:.1f} s wall, {res['cpu']:.1f} "
                  f"CPU-s ({res['slots'] / res['wall']:.0f} slots/s; load {os.getloadavg()[0]:.1f})", flush=True)
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    for proc in (p for side in helpers.values() for p in side):
        proc.stdin.close()
        proc.wait()
    rate = {n: t["slots"] / t["wall"] for n, t in totals.items()}
    per_cpu = {n: t["slots"] / t["cpu"] for n, t in totals.items()}
    print(f"before: {rate['before']:.0f} slots/s, {per_cpu['before']:.0f} slots/CPU-s")
    print(f"after:  {rate['after']:.0f} slots/s, {per_cpu['after']:.0f} slots/CPU-s")
    print(f"ratio:  {rate['after'] / rate['before']:.2f}x slots/s, {per_cpu['after'] / per_cpu['before']:.2f}x "
          "slots/CPU-s")


if __name__ == "__main__":
    main()
