"""An EAGLE-3 drafter as a proposer: a chain of k drafts per pass, or a dynamic draft tree.

Draft 1 comes from the seed, the drafter's output for the newest committed (fused target state, next token) pair.
Drafts 2..k each run the drafter once more on its own previous output and the draft just chosen; those k-1 steps
are appended to its KV cache. The acceptor walks the drafts (`acceptance.DraftWalk`), so greedy acceptance and
exact rejection sampling against the drafter's own rows come for free.

After the verify the chain's cache entries are dropped and the committed positions are run again from the
target's own fused states (what the drafter was trained on), one call at the next proposal: the drafter's cache
follows exactly what the target accepted, whatever was drafted. `withdraw` restores the cache and the waiting
pairs as they were before `propose`, whether or not the pass was observed since.

**Trees** (`propose_tree`), as EAGLE-2/3 grow them: depth 1 holds the seed's top-k tokens; at every further depth
the k nodes of highest cumulative probability are expanded (one drafter call over k one-row sequences, each seeing
the cache and its own ancestors) into their top-k children; at the end the `budget` nodes of highest cumulative
probability over everything grown form the tree (prefix-closed: a child is never likelier than its parent). Its
nodes are fixed top-k choices, a point mass each, so rejection sampling stays exact. Growing a tree reads each
depth's candidates on the host (one sync per depth).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..acceptance import Acceptor, SamplingAcceptor
from ..proposal import Offer, Proposal, TreeProposal
from ..sampling import log_distribution
from ..state import DecodeState
# An EAGLE-3 head drafts as an MTP head does: each step reads its own previous output and the last draft.
from .mtp import MTPWalk as Eagle3Walk

EAGLE3 = "eagle3"
TREE_TOP_K = 4  # children per expanded node and nodes expanded per depth (at most the budget)


class _Undo:
    """What `withdraw` restores (the cache length and the waiting pairs before the proposal) and what `observe`
    drops after the verify (the chain's entries)."""

    def __init__(self, tokens: mx.array, offset: int, queue, chain: int):
        self.tokens, self.offset, self.queue, self.chain = tokens, offset, queue, chain
        self.observed = False


def _log_rows(logits: mx.array, acceptor) -> mx.array:
    """The distribution a tree ranks by: the sampling acceptor's (same filters and temperature as the target),
    else the log-softmax."""
    logits = logits.astype(mx.float32)  # read on the host (numpy has no bfloat16)
    if isinstance(acceptor, SamplingAcceptor):
        return log_distribution(logits, acceptor.params).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _top(logq: np.ndarray, k: int):
    """Each row's k most likely ids and log-probabilities, most likely first (ties by lower id)."""
    if k < logq.shape[-1]:  # O(V) per row: the k largest (ties at the k-th by lower id), then sorted
        kth = -np.partition(-logq, k - 1, axis=-1)[:, k - 1 : k]
        order = np.stack([np.concatenate([np.flatnonzero(r > t), np.flatnonzero(r == t)])[:k]
                          for r, t in zip(logq, kth[:, 0])])
    else:
        order = np.broadcast_to(np.arange(logq.shape[-1]), logq.shape)
    vals = np.take_along_axis(logq, order, axis=-1)
    rank = np.lexsort((order, -vals), axis=-1)
    order = np.take_along_axis(order, rank, axis=-1)
    return order, np.take_along_axis(logq, order, axis=-1)


class Eagle3Proposer:
    name = EAGLE3

    def __init__(self, drafter, top_k: int = TREE_TOP_K):
        self.drafter = drafter
        self.top_k = top_k
        self._undo: Optional[_Undo] = None  # the newest proposal of this generation

    @property
    def widest(self) -> int:
        return self.drafter.block_size

    def offer(self, state: DecodeState, widest: int) -> Optional[Offer]:
        return Offer(EAGLE3, min(widest, self.drafter.block_size))

    def _seed(self, state: DecodeState):
        """Run the waiting pairs; (the cache, its length before them, the waiting pairs before them, the seed)."""
        cache = state.draft_cache
        before = cache[-1].copy()
        offset = cache[0].offset
        self.drafter.run_ready(cache)
        seed = cache[-1].seed
        if seed is None:
            raise RuntimeError("the EAGLE-3 drafter has no seed: the prompt was not prefilled through it")
        return cache, offset, before, seed

    def propose(self, state: DecodeState, acceptor: Acceptor, width: int, offer: Optional[Offer]) -> Proposal:
        cache, offset, before, seed = self._seed(state)
        proposal = acceptor.propose_walk(Eagle3Walk(self.drafter, cache, seed, width - 1), state.last_token)
        self._undo = _Undo(proposal.tokens, offset, before, max(width - 2, 0))
        return proposal

    def grows_trees(self, acceptor: Optional[Acceptor]) -> bool:
        """Not with logits processors: they would make each node's row depend on its own path."""
        return not getattr(acceptor, "processors", None)

    def propose_tree(self, state: DecodeState, acceptor: Acceptor, width: int, budget: int,
                     offer: Optional[Offer]) -> Optional[TreeProposal]:
        """EAGLE's dynamic tree of up to `budget` nodes, at most `width - 1` deep (see the module docstring); None
        (nothing done) where it grows none (`grows_trees`)."""
        if not self.grows_trees(acceptor) or budget < 1:
            return None
        cache, offset, before, seed = self._seed(state)
        tokens, parents = self._grow(cache, seed, acceptor, max(1, width - 1), budget)
        proposal = TreeProposal(mx.array(tokens, dtype=mx.int32), point_mass=True, source=EAGLE3,
                                parents=tuple(parents))
        self._undo = _Undo(proposal.tokens, offset, before, 0)
        return proposal

    def _grow(self, cache, seed: mx.array, acceptor, depth_max: int, budget: int):
        """(tokens, parent slots) of the tree, slots in order of depth then likelihood."""
        drafter, k = self.drafter, max(1, min(self.top_k, budget))
        logq = np.array(_log_rows(drafter.logits(seed)[0], acceptor))  # [1, V]
        ids, lps = _top(logq, k)
        # Every node grown: (token, parent node or -1, cumulative log q, depth).
        nodes = [(int(t), -1, float(s), 1) for t, s in zip(ids[0], lps[0])]
        frontier = list(range(len(nodes)))
        parent_out = {-1: seed}  # node -> its drafter output [1, 1, H]
        kvs = drafter.tree_cache()  # the expanded nodes' keys and values, per layer
        expanded: List[int] = []  # nodes whose keys are in `kvs`, in order
        ancestors_of = {-1: set()}
        for depth in range(2, depth_max + 1):
            frontier = [i for i in frontier if np.isfinite(nodes[i][2])]
            if not frontier:
                break
            rows = []
            for i in frontier:
                chain = ancestors_of[nodes[i][1]] | ({nodes[i][1]} if nodes[i][1] >= 0 else set())
                ancestors_of[i] = chain
                rows.append([j in chain for j in expanded])
            mask = mx.array(np.array(rows, dtype=bool).reshape(len(frontier), len(expanded)))
            tokens = mx.array([nodes[i][0] for i in frontier], dtype=mx.int32)
            hidden = mx.concatenate([parent_out[nodes[i][1]] for i in frontier], axis=0)
            out = drafter.tree_step(tokens, hidden, cache, kvs, mask, depth - 2)  # [n, 1, H]
            expanded.extend(frontier)
            for row, i in enumerate(frontier):
                parent_out[i] = out[row : row + 1]
            logq = np.array(_log_rows(drafter.logits(out)[:, 0], acceptor))
            ids, lps = _top(logq, k)
            fresh = []
            for row, i in enumerate(frontier):
                for t, s in zip(ids[row], lps[row]):
                    fresh.append(len(nodes))
                    nodes.append((int(t), i, nodes[i][2] + float(s), depth))
            frontier = sorted(fresh, key=lambda n: (-nodes[n][2], n))[:k]
        # The `budget` likeliest nodes; a parent is likelier than (or tied with, and grown before) its children.
        keep = sorted((n for n in range(len(nodes)) if np.isfinite(nodes[n][2])), key=lambda n: (-nodes[n][2], n))
        keep = keep[:budget] or [0]
        keep.sort(key=lambda n: (nodes[n][3], -nodes[n][2], n))
        slot = {n: s for s, n in enumerate(keep, start=1)}
        return [nodes[n][0] for n in keep], [slot.get(nodes[n][1], 0) for n in keep]

    def observe(self, state: DecodeState, tokens: Sequence[int], features: Optional[mx.array]) -> None:
        cache = state.draft_cache
        if cache is None:
            return
        undo = self._undo
        if undo is not None and not undo.observed and features is not None:
            undo.observed = True  # our proposal was verified: its chain entries go, the target's states come
            self.drafter.rollback(cache, undo.chain)
        if features is not None:
            self.drafter.add_rows(cache, features)  # they run at the next proposal, in one call
        self.drafter.add_tokens(cache, tokens)

    def unobserve(self, state: DecodeState, tokens: int) -> None:
        """Forget the newest `tokens` observed (a pass of another proposer taken back after it was observed):
        their pairs still wait, unrun, until the next proposal."""
        self.drafter.drop_newest(state.draft_cache, tokens)

    def withdraw(self, state: DecodeState, proposal: Proposal) -> None:
        undo = self._undo
        if undo is None or undo.tokens is not proposal.tokens:
            return
        cache = state.draft_cache
        self.drafter.rollback(cache, cache[0].offset - undo.offset)
        cache[-1] = undo.queue
        self._undo = None
