"""One rank of the distributed tests (started by tests/test_distributed.py through `dflash_mlx.distributed.local`).

For each job, each rank loads a saved tiny target split over the group (tensor or pipeline parallel), runs the
decoding scenarios of `run_scenarios` and prints one JSON line: its token streams and whether its caches were exact
after an early stop. One launch runs every job (starting processes is the slow part). The test runs the same
`run_scenarios` on the unsplit target in its own process and compares.

    python tests/distributed_worker.py JOBS_JSON
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
from mlx_lm.generate import generation_stream
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cache_compare import assert_caches_equal  # noqa: E402
from tiny import SteeredDFlashDrafter, corrupt_every  # noqa: E402

from dflash_mlx.decode.acceptance import make_acceptor  # noqa: E402
from dflash_mlx.drafters.io import read_config, read_weights  # noqa: E402
from dflash_mlx.decode.state import DecodeState
from dflash_mlx.decode.loop import dflash_generate_step  # noqa: E402
from dflash_mlx.distributed import agree_on_width  # noqa: E402
from dflash_mlx.models.loading import prepare  # noqa: E402
from dflash_mlx.decode.width import WidthPolicy  # noqa: E402


def _run(target, drafter, prompt: List[int], spec: Dict[str, Any], sampling: Dict[str, Any],
         stop_after: int = 0, adaptive: bool = False):
    state = DecodeState(target.make_cache(), drafter.make_cache())
    # Adaptive: widths from measured cycle times, which every rank must take from the same clock.
    width = agree_on_width(WidthPolicy(spec["block_size"])) if adaptive else None
    gen = dflash_generate_step(mx.array(prompt, dtype=mx.int32), target, drafter, max_tokens=spec["max_tokens"],
                               width=None if adaptive else spec["block_size"], state=state,
                               acceptor=make_acceptor(**sampling), planner=width)
    cycles: List[List[int]] = []
    for cycle in gen:
        cycles.append(cycle.tokens)
        if stop_after and len(cycles) >= stop_after:
            gen.close()  # the queued verify pass is rolled out of the caches here
            break
    return cycles, state


def _digest(cache) -> str:
    return hashlib.sha1(b"".join(np.array(c.keys[..., : c.offset, :]).tobytes() for c in cache)).hexdigest()[:16]


def early_stop_exact(target, drafter, prompt: List[int], spec: Dict[str, Any]) -> Dict[str, str]:
    """Stop mid-generation, then compare the caches with ones fed only the committed tokens.

    Target caches are compared bit for bit; so is the drafter's context cache (fed the committed positions'
    tapped features, with those still pending appended first). Returns both verdicts and a digest of the
    drafter's context keys, which must agree across ranks (every rank drafts from whole features).
    """
    cycles, state = _run(target, drafter, prompt, spec, {}, stop_after=spec["stop_after"])
    # The abandoned cycle may still be running on the engine's stream: collectives issued on another stream now
    # could interleave with its own and pair up differently on the two ranks.
    mx.synchronize(generation_stream)
    committed = [t for c in cycles for t in c][:-1]  # the newest token is the next block's slot 0: not cached
    if state.pending_context is not None:
        drafter.append_context(state.pending_context, state.draft_cache)
    ref, ref_draft = target.make_cache(), drafter.make_cache()
    # The run's writes minus the rejected drafts: the prompt, then verify pass k cached the token before it and
    # its accepted drafts, as many tokens as it committed.
    chunks, start = [prompt], 0
    for c in cycles[1:]:
        chunks.append(committed[start : start + len(c)])
        start += len(c)
    for chunk in chunks:
        logits, hidden = target(mx.array([chunk], dtype=mx.int32), ref)
        mx.eval(logits, hidden)
        drafter.append_context(hidden, ref_draft)
    mx.eval([c.state for c in state.target_cache + ref + state.draft_cache + ref_draft])
    verdicts = {}
    for name, ours, theirs in (("target", state.target_cache, ref), ("drafter", state.draft_cache, ref_draft)):
        try:
            assert_caches_equal(ours, theirs)
            verdicts[name] = "exact"
        except AssertionError as e:
            verdicts[name] = f"differs: {e}"
    verdicts["drafter_digest"] = _digest(state.draft_cache)
    return verdicts


def steered_drafter(drafter_dir: str, spec: Dict[str, Any]) -> SteeredDFlashDrafter:
    """The saved drafter, run for real (its context cache grows as in production), proposing the target's greedy
    continuation `spec["sequence"]` spoiled at every third position: acceptance lengths vary from 0 to the block."""
    path = Path(drafter_dir)
    drafter = SteeredDFlashDrafter(read_config(path))
    drafter.load_weights(list(read_weights(path).items()), strict=True)
    mx.eval(drafter.parameters())
    return drafter.steer(spec["sequence"], corrupt_every(3))


def job_drafter(drafter_dir: str, spec: Dict[str, Any]):
    """The job's drafter: a saved DSpark drafter as it is (spec family "dspark"), else the steered DFlash one."""
    if spec.get("family") == "dspark":
        from dflash_mlx.drafters.io import load_drafter

        return load_drafter(drafter_dir)
    return steered_drafter(drafter_dir, spec)


def run_scenarios(model, drafter, spec: Dict[str, Any]) -> Dict[str, Any]:
    """Greedy and seeded-sampling token streams, and the early-stop cache check, on this process's target."""
    target = prepare(model, drafter)
    prompt = spec["prompt"]
    greedy, _ = _run(target, drafter, prompt, spec, {})
    sampled, _ = _run(target, drafter, prompt, spec, dict(temp=spec["temp"], top_p=0.95, seed=spec["seed"]))
    # No seed: drawn from MLX's global generator, which `setup` seeded alike on every rank.
    unseeded, _ = _run(target, drafter, prompt, spec, dict(temp=spec["temp"]))
    adaptive, _ = _run(target, drafter, prompt, spec, {}, adaptive=True)
    return {
        "greedy": [t for c in greedy for t in c],
        "greedy_cycles": len(greedy),
        "sampled": [t for c in sampled for t in c],
        "unseeded": [t for c in unseeded for t in c],
        "adaptive": [t for c in adaptive for t in c],
        "early_stop": early_stop_exact(target, drafter, prompt, spec),
        "parameters": sum(p.size for _, p in tree_flatten(model.parameters())),
    }


def _measured_traffic(group) -> Dict[str, int]:
    """Bytes the ring sockets counted around one all-sum of 64 KB (and a 4-byte barrier)."""
    from dflash_mlx.distributed.comm import RingTraffic
    from dflash_mlx.distributed.group import barrier

    traffic = RingTraffic()
    before = traffic.settled()
    barrier(group)  # no rank sends before every rank has read its counters
    mx.eval(mx.distributed.all_sum(mx.ones((16, 1024)), group=group))
    moved = traffic.settled() - before
    return dict(sockets=len(traffic.sockets), sent=moved.sent, received=moved.received)


def main(argv: List[str]) -> int:
    """argv: one JSON list of jobs {"target", "drafter", "mode", "spec"}; prints one JSON line per job."""
    from dflash_mlx.distributed import FeatureExchange, load_sharded_model
    from dflash_mlx.distributed.group import setup

    group = setup(quiet=False)
    print(json.dumps(dict(rank=group.rank(), traffic=_measured_traffic(group))), flush=True)
    for job in json.loads(argv[0]):
        pipeline = job["mode"] == "pipeline"
        model = load_sharded_model(job["target"], group, pipeline=pipeline)
        drafter = job_drafter(job["drafter"], job["spec"])
        if pipeline:
            prepare(model, drafter)  # binds the drafter to this rank's embedding and head
            drafter = FeatureExchange(drafter)
        result = run_scenarios(model, drafter, job["spec"])
        print(json.dumps(dict(result, rank=group.rank(), job=job["name"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
