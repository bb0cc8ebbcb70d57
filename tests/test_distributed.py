"""DFlash with the target split over 2 ranks (ring backend, two processes on 127.0.0.1) equals the single process.

A tiny dense target (llama) and a tiny hybrid one (qwen3_5: GatedDeltaNet + attention) are saved to disk; each rank
loads and splits them itself (tensor parallel; the hybrid also pipeline parallel), runs greedy and seeded-sampling
DFlash and an early stop, and prints its token streams. Both ranks must produce the single-process tokens exactly
(a rank that decided differently would hang at the next collective, so every launch has a hard time limit), and
each rank's caches after the early stop must equal caches fed only the committed tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model, save_config, save_model

from cache_compare import CONFIGS as FAMILY_CONFIGS
from cache_compare import randomize
from dflash_mlx.models.loading import prepare
from dflash_mlx.distributed.local import run_local
from dflash_mlx.drafters.io import save_drafter
from tiny import TARGET_CONFIGS, greedy, make_drafter

WORKER = str(Path(__file__).with_name("distributed_worker.py"))
LIMIT = 180  # seconds for the 2-rank launch: a rank that diverged would wait forever at its next collective

# qwen3_5 shards its untied LM head by vocabulary rows: the vocabulary must split evenly over 2 ranks.
HYBRID_VOCAB = 98
SPEC = dict(prompt=[5, 17, 3, 42, 8, 8, 61, 2, 33, 9, 70, 14], max_tokens=24, block_size=4, temp=0.9, seed=7,
            stop_after=3)


def _config(kind: str) -> dict:
    if kind == "llama":
        return dict(TARGET_CONFIGS["llama"])
    config = json.loads(json.dumps(FAMILY_CONFIGS["qwen3_5"]))
    config["text_config"]["vocab_size"] = HYBRID_VOCAB
    return config


def _save_pair(root: Path, kind: str):
    from mlx_lm.utils import _get_classes

    config = _config(kind)
    model_class, args_class = _get_classes(config)
    model = randomize(model_class(args_class.from_dict(config)), seed=3)
    target_dir, drafter_dir = root / kind / "target", root / kind / "drafter"
    target_dir.mkdir(parents=True)
    save_model(target_dir, model)
    save_config(config, target_dir / "config.json")
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    drafter, _ = make_drafter(model, block_size=SPEC["block_size"], mask_token_id=vocab - 1, vocab_size=vocab)
    save_drafter(drafter, drafter_dir)
    # The drafter is steered towards the target's own greedy continuation (see distributed_worker.py).
    spec = dict(SPEC, sequence=SPEC["prompt"] + greedy(model, SPEC["prompt"], SPEC["max_tokens"] + 8))
    return target_dir, drafter_dir, spec


def _save_dspark(root: Path, target_dir: Path, spec: dict):
    """A DSpark drafter (Markov walk, confidence head) for the llama target, its Markov head following the target's
    greedy bigrams so drafts are accepted."""
    import numpy as np
    from dflash_mlx.drafters.dspark import DSparkDrafter
    from dflash_mlx.drafters.dspark_config import DSparkConfig
    from tiny import num_layers, randomize as randomize_module

    model, _ = load_model(target_dir)
    V, n = model.args.vocab_size, num_layers(model)
    cfg = DSparkConfig(hidden_size=model.args.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=V, rope_theta=10000.0,
                       target_layer_ids=sorted({min(1, n - 1), n - 1}), mask_token_id=V - 1,
                       dspark_block=SPEC["block_size"] - 1, logits_start=0, block_size=SPEC["block_size"],
                       markov_rank=V, enable_confidence_head=True)
    drafter = randomize_module(DSparkDrafter(cfg), 4)
    w2 = np.zeros((V, V), dtype=np.float32)
    seq = spec["sequence"]
    for a, b in zip(seq, seq[1:]):
        if not w2[:, a].any():  # the first successor seen wins
            w2[b, a] = 12.0
    drafter.markov_head.markov_w1.weight = mx.eye(V)
    drafter.markov_head.markov_w2.weight = mx.array(w2)
    return target_dir, save_drafter(drafter, root / "llama-dspark" / "drafter"), dict(spec, family="dspark")


JOBS = [("llama", "tensor"), ("qwen3_5", "tensor"), ("qwen3_5", "pipeline"), ("llama-dspark", "tensor")]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    pairs = {kind: _save_pair(root, kind) for kind in ("llama", "qwen3_5")}
    pairs["llama-dspark"] = _save_dspark(root, pairs["llama"][0], pairs["llama"][2])
    return pairs


@pytest.fixture(scope="module")
def ranks(pairs):
    """Every job's results on both ranks, from one 2-rank launch: {(kind, mode): [rank 0, rank 1]}."""
    jobs = [dict(name=f"{kind}-{mode}", target=str(pairs[kind][0]), drafter=str(pairs[kind][1]), mode=mode,
                 spec=pairs[kind][2]) for kind, mode in JOBS]
    results = run_local([sys.executable, WORKER, json.dumps(jobs)], ranks=2, timeout=LIMIT)
    for r in results:
        assert not r.timed_out, f"rank {r.rank} hung (killed after {LIMIT} s): {r.stderr[-2000:]}"
        assert r.returncode == 0, f"rank {r.rank} failed: {r.stderr[-2000:]}"
    lines = [[json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")] for r in results]
    out = {(kind, mode): [by_rank[i + 1] for by_rank in lines] for i, (kind, mode) in enumerate(JOBS)}
    out["traffic"] = [by_rank[0]["traffic"] for by_rank in lines]
    return out


def _single_process(target_dir: Path, drafter_dir: Path, spec: dict) -> dict:
    from distributed_worker import job_drafter, run_scenarios

    model, _ = load_model(target_dir)
    drafter = job_drafter(str(drafter_dir), spec)
    prepare(model, drafter)
    return run_scenarios(model, drafter, spec)


@pytest.mark.parametrize("kind,mode", JOBS)
def test_two_ranks_equal_single_process(pairs, ranks, kind, mode):
    target_dir, drafter_dir, spec = pairs[kind]
    single = _single_process(target_dir, drafter_dir, spec)
    assert single["early_stop"]["target"] == single["early_stop"]["drafter"] == "exact"
    assert single["greedy"] == spec["sequence"][len(spec["prompt"]):][: spec["max_tokens"]]  # lossless alone
    assert single["greedy_cycles"] < spec["max_tokens"] - 4  # drafts were accepted: multi-token cycles ran
    both = ranks[(kind, mode)]
    assert [r["rank"] for r in both] == [0, 1] and {r["job"] for r in both} == {f"{kind}-{mode}"}
    for r in both:
        assert r["parameters"] < single["parameters"], f"rank {r['rank']} holds the whole target"
        assert r["greedy"] == single["greedy"], f"rank {r['rank']} greedy"
        assert r["sampled"] == single["sampled"], f"rank {r['rank']} sampled"
        assert r["early_stop"]["target"] == "exact", f"rank {r['rank']}: {r['early_stop']['target']}"
        assert r["early_stop"]["drafter"] == "exact", f"rank {r['rank']}: {r['early_stop']['drafter']}"
    assert both[0]["greedy_cycles"] == both[1]["greedy_cycles"] == single["greedy_cycles"]
    assert both[0]["unseeded"] == both[1]["unseeded"]  # the ranks agree on a seed nobody gave
    # Adaptive widths from rank 0's clock on every rank: same widths, and greedy output stays the target's own.
    assert both[0]["adaptive"] == both[1]["adaptive"] == single["greedy"]
    # Every rank drafts from the same whole features (tensor parallel: summed; pipeline: exchanged).
    assert both[0]["early_stop"]["drafter_digest"] == both[1]["early_stop"]["drafter_digest"]
    if mode == "pipeline":  # stages split no matmul, so the features are the single process's, bit for bit
        assert both[0]["early_stop"]["drafter_digest"] == single["early_stop"]["drafter_digest"]


def test_ring_traffic_counts_the_bytes_of_an_all_sum(ranks):
    # A 64 KB all-sum over 2 ranks: each rank sends its half to reduce and its reduced half back (64 KB), and
    # receives as much; the few bytes of a barrier (and of the peer's last one) ride along.
    for t in ranks["traffic"]:
        assert t["sockets"] >= 1
        assert 65536 <= t["sent"] <= 65536 + 64 and 65536 <= t["received"] <= 65536 + 64, t
