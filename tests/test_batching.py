"""Continuous batching (dflash_mlx.decode.batching, targets/walk.py): generations that share verify passes, joining and
leaving between passes, each produce exactly what they produce alone (greedy, and seeded sampling)."""

from typing import Dict, List

import mlx.core as mx
import pytest
from mlx_lm.utils import _get_classes

from mlx.utils import tree_flatten

from cache_compare import CONFIGS
from dflash_mlx.decode.batching import Batch, BatchedGeneration
from dflash_mlx.decode.generation import Generation
from dflash_mlx.drafters.oracle import OracleDrafter
from dflash_mlx.targets import TargetModel
from dflash_mlx.targets.walk import Chain, plain_attention, splittable
from tiny import VOCAB, make_drafter, prompt_ids, randomize, reference, target


class KeyedOracle(OracleDrafter):
    """An oracle for several requests at once: the sequence whose token at the block's start is the block's first
    token proposes; every `spoil`-th position is proposed wrong, so acceptance lengths vary."""

    def __init__(self, sequences, block_size=4, spoil=3):
        super().__init__([], VOCAB, block_size, mask_token_id=VOCAB - 1)
        self.sequences, self.spoil = [list(s) for s in sequences], spoil

    def __call__(self, block_ids, cache):
        start, block, last = cache[0].offset, block_ids.shape[1], int(block_ids[0, 0].item())
        seq = next((s for s in self.sequences if len(s) > start and s[start] == last), [])
        props = [(seq[p] + (p % self.spoil == 0)) % VOCAB if p < len(seq) else 0 for p in range(start + 1, start + block)]
        hot = mx.array(props, dtype=mx.int32)[:, None] == mx.arange(VOCAB)[None]
        return mx.where(hot, 30.0, -30.0)[None]


def drive(gens: Dict[str, Generation], join_after: Dict[str, int] = None, close_after: Dict[str, int] = None):
    """Advance every generation one pass per round, as the server's worker does; some join late (after that many
    rounds), some are closed early (after that many passes). Returns each one's tokens and the rounds run."""
    join_after, close_after = join_after or {}, close_after or {}
    out: Dict[str, List[int]] = {k: [] for k in gens}
    running, passes, rounds = {}, {k: 0 for k in gens}, 0
    while len(out) > sum(1 for k in gens if k in running or passes[k] < 0) or running:
        for k in gens:
            if k not in running and passes[k] == 0 and join_after.get(k, 0) <= rounds:
                running[k] = iter(gens[k])
        for k, it in list(running.items()):
            p = next(it, None)
            if p is not None:
                out[k].extend(p.tokens)
                passes[k] += 1
            if p is None or p.finish_reason or passes[k] == close_after.get(k):
                gens[k].close()
                del running[k]
                passes[k] = -1
        rounds += 1
        if all(passes[k] < 0 for k in gens):
            break
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "llama_swa", "qwen3_5"])
def test_ragged_forward_equals_each_pass_alone(kind):
    """Logits, taps and the caches left behind equal each block's own pass (dense targets, whose plain attention
    projects the whole stream at once, a sliding-window one, and a hybrid)."""
    for model in (_hybrid() if kind == "qwen3_5" else target(kind),):
        t = TargetModel(model, [0, 2])
        assert all(splittable(layer) for layer in t.layers)
        shared = [plain_attention(layer.self_attn) for layer in t.layers if not getattr(layer, "is_linear", False)]
        assert all(shared) if kind in ("llama", "qwen2", "qwen3") else True
        prompts = [prompt_ids(n, seed=n) for n in (5, 9, 7)]
        alone, batched = [t.make_cache() for _ in prompts], [t.make_cache() for _ in prompts]
        for p, a, b in zip(prompts, alone, batched):
            t(mx.array([p]), a)
            t(mx.array([p]), b)
        blocks = [mx.array([prompt_ids(w, seed=10 + w)]) for w in (4, 1, 3)]
        logits, hidden = t.forward_segments([Chain(b, c) for b, c in zip(blocks, batched)])
        for block, cache, lg, hd in zip(blocks, alone, logits, hidden):
            ref_logits, ref_hidden = t(block, cache)
            assert lg.shape == ref_logits.shape and hd.shape == ref_hidden.shape
            assert mx.allclose(lg, ref_logits, atol=1e-4).item() and mx.allclose(hd, ref_hidden, atol=1e-4).item()
        for a, b in zip(alone, batched):
            _close_caches(a, b)
        # Rolled back per request, each continues as its own (GatedDeltaNet write records are per cache).
        t.rollback(alone[0], 2)
        t.rollback(batched[0], 2)
        step = mx.array([[5]])
        assert mx.allclose(t(step, alone[0])[0], t(step, batched[0])[0], atol=1e-4).item()


def _close_caches(a, b):
    for x, y in zip(a, b):
        assert type(x) is type(y) and getattr(x, "offset", 0) == getattr(y, "offset", 0)
        arrays = [[v for _, v in tree_flatten(c.state) if isinstance(v, mx.array)] for c in (x, y)]
        assert len(arrays[0]) == len(arrays[1]) > 0
        for u, v in zip(*arrays):
            assert u.shape == v.shape and mx.allclose(u, v, atol=1e-4).item()


def _hybrid():
    model_class, args_class = _get_classes(CONFIGS["qwen3_5"])
    return randomize(model_class(args_class.from_dict(CONFIGS["qwen3_5"])), 3)


def _greedy_case(model, kind):
    lengths, limits = (6, 11, 8, 14), (20, 9, 24, 16)
    prompts = [prompt_ids(n, seed=n) for n in lengths]
    refs = [reference(kind, p, m) for p, m in zip(prompts, limits)]
    return prompts, limits, refs


@pytest.mark.parametrize("kind", ["qwen3", "llama_swa"])
def test_greedy_batch_equals_alone(kind):
    """Four greedy requests with fixed, adaptive and plain widths, joining late and finishing at different
    times, through a keyed oracle (partial acceptances) and a real DFlash drafter: each equals mlx-lm's greedy."""
    prompts, limits, refs = _greedy_case(target(kind), kind)
    drafter, t = make_drafter(target(kind), block_size=4)
    oracle = KeyedOracle([p + r for p, r in zip(prompts, refs)])
    for d in (oracle, drafter):
        batch = Batch(t, d)
        widths = (None, 4, 1, 3)
        gens = {i: BatchedGeneration(batch, p, max_tokens=m, width=w)
                for i, (p, m, w) in enumerate(zip(prompts, limits, widths))}
        out = drive(gens, join_after={2: 1, 3: 2})
        assert [out[i] for i in range(4)] == refs
        assert max(batch.sizes) >= 3  # passes were really shared
        assert not batch.members


def test_a_closed_request_leaves_the_others_exact():
    kind = "qwen3"
    prompts, limits, refs = _greedy_case(target(kind), kind)
    _, t = make_drafter(target(kind), block_size=4)
    batch = Batch(t, KeyedOracle([p + r for p, r in zip(prompts, refs)]))
    gens = {i: BatchedGeneration(batch, p, max_tokens=m) for i, (p, m) in enumerate(zip(prompts, limits))}
    out = drive(gens, close_after={1: 2})
    assert out[0] == refs[0] and out[2] == refs[2] and out[3] == refs[3]
    assert out[1] == refs[1][: len(out[1])] and len(out[1]) < len(refs[1])
    assert not batch.members


def test_hybrid_batch_equals_alone():
    """qwen3_5 (GatedDeltaNet state per request): batched greedy output equals each request's generation alone."""
    model = _hybrid()
    drafter, t = make_drafter(model, block_size=4)
    prompts = [prompt_ids(n, seed=n) for n in (7, 12, 5)]
    alone = [[tok for p_ in Generation(t, drafter, p, max_tokens=14, width=4) for tok in p_.tokens] for p in prompts]
    from tiny import greedy

    assert alone[0] == greedy(model, prompts[0], 14)  # alone is mlx-lm's greedy
    oracle = KeyedOracle([p + a for p, a in zip(prompts, alone)])
    # Lookup drafts on (the default), off (the batch's shared width policy), fixed widths, a real drafter.
    for d, width, lookup in ((oracle, None, None), (oracle, None, False), (oracle, 4, None), (drafter, 3, None)):
        batch = Batch(t, d)
        gens = {i: BatchedGeneration(batch, p, max_tokens=14, width=width, lookup=lookup)
                for i, p in enumerate(prompts)}
        out = drive(gens, join_after={1: 2})
        assert [out[i] for i in range(3)] == alone
        assert max(batch.sizes) >= 2


def test_seeded_sampling_batch_equals_alone():
    """Seeded sampling: each request's tokens equal its own run alone (widths follow its own acceptance)."""
    kind = "qwen3"
    drafter, t = make_drafter(target(kind), block_size=4)
    prompts = [prompt_ids(n, seed=n) for n in (6, 10, 8)]
    greedy_refs = [reference(kind, p, 16) for p in prompts]
    oracle = KeyedOracle([p + r for p, r in zip(prompts, greedy_refs)])
    opts = [dict(temp=0.8, seed=11), dict(temp=1.0, top_k=20, seed=5), dict(temp=0.7, top_p=0.9, seed=3)]
    for d in (oracle, drafter):
        alone = [[tok for p_ in Generation(t, d, p, max_tokens=16, **o) for tok in p_.tokens]
                 for p, o in zip(prompts, opts)]
        batch = Batch(t, d)
        gens = {i: BatchedGeneration(batch, p, max_tokens=16, **o) for i, (p, o) in enumerate(zip(prompts, opts))}
        out = drive(gens, join_after={2: 1})
        assert [out[i] for i in range(3)] == alone
        assert alone != greedy_refs  # really sampled


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_a_request_closed_with_an_unyielded_pass_keeps_exact_caches(kind):
    """A member whose next pass was run by a neighbour but never yielded (the server's hang-up between two rounds)
    is closed: its caches hold exactly the tokens it yielded, so a later turn on them (the prefix cache) is exact."""
    from dflash_mlx.decode.state import DecodeState
    from tiny import greedy

    model = _hybrid() if kind == "qwen3_5" else target(kind)
    drafter, t = make_drafter(model, block_size=4)
    prompts = [prompt_ids(n, seed=n) for n in (9, 6)]
    refs = [greedy(model, p, 24) for p in prompts]
    for d in (KeyedOracle([p + r for p, r in zip(prompts, refs)]), drafter):
        for lookup in (None, False):
            batch = Batch(t, d)
            state = DecodeState.fresh(t, d)
            leaver = BatchedGeneration(batch, prompts[0], max_tokens=24, state=state, lookup=lookup)
            other = BatchedGeneration(batch, prompts[1], max_tokens=24, lookup=lookup)
            a, b = iter(leaver), iter(other)
            seen = list(next(a).tokens)  # prefills
            next(b)
            seen += next(a).tokens  # pass 1, run for both
            next(b)
            next(b)  # pass 2, run for both: the leaver's is computed, not yielded
            assert batch.members[0].ready is not None
            leaver.close()
            assert seen == refs[0][: len(seen)]
            assert state.last_token == seen[-1]
            assert all(c.offset == len(prompts[0]) + len(seen) - 1 for c in state.target_cache if hasattr(c, "offset"))
            # The next turn continues exactly the tokens seen.
            more = prompt_ids(3, seed=99)
            after = [tok for p in Generation(t, d, more, max_tokens=6, state=state) for tok in p.tokens]
            assert after == greedy(model, prompts[0] + seen + more, 6)
            other.close()
            assert not batch.members
