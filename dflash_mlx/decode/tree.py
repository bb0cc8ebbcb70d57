"""Draft trees: DDTree construction from a block drafter's per-depth distributions and prompt lookup with
branches, each a `proposal.TreeProposal` that one target pass verifies.

A block drafter gives, in one forward pass, a distribution q_d over the token at every depth d. A chain bets on
one token per depth; DDTree spends a node budget on the prefixes most likely under the factorized q = prod q_d
(best first over rank tuples, which maximizes the drafter's own expected acceptance length), so where the top
guess at some depth is wrong a sibling may still be right. Prompt lookup gains branches the same way: the tokens
that followed several earlier occurrences of the newest suffix, merged into a trie.

A tree is verified as a chain is, by the acceptor's one `verify` (`verify_tree` is that call, named for the tree);
the steps it takes at the nodes live here. From the target's logits at every node (row i predicts the token after
block slot i) a rule decides, at every node at once, which child (if any) is kept and the target's token there:
- greedy: follow the child equal to the row's argmax;
- rejection sampling (multi-draft, as in SpecInfer): at a node with target distribution p, children are tried in
  slot order, child j kept with probability min(1, r(x_j)/q_j(x_j)) where r starts at p and becomes
  normalize(max(r - q_j, 0)) after each rejection; when all are rejected the token is drawn from r. Every
  committed token is then distributed exactly as plain sampling from the target, provided each child was drawn
  from its row q_j independently of its siblings given its path, or fixed in advance (a point mass);
- an opaque sampler (`MatchAcceptor`): sample every row, follow the child equal to the sample.
A node's outcome depends only on its own row, its children and fresh randomness, never on how the walk reached it,
so every node is decided at once (vectorized over nodes) and a short loop over depth follows the kept children:
everything stays lazy on the device, for one host sync by the caller.
"""

from __future__ import annotations

import heapq
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .lookup import LookupIndex
from .proposal import DFLASH, LOOKUP, TreeProposal


# -- building trees --------------------------------------------------------------------------------------------------
def _top_k(logq: np.ndarray, k: int, columns: Optional[np.ndarray] = None
           ) -> Tuple[List[List[int]], List[List[float]]]:
    """Each row's k most likely token ids and their log-probabilities, most likely first, ties by lower id (the
    order of a stable sort of -logq, as the reference implementation gets from MLX's argsort). `columns`: the
    token id of each column, when the rows cover a drafter's own vocabulary rather than the target's."""
    ids, lps = [], []
    for row in logq:
        if k >= row.shape[0]:
            top = (np.argsort(-row, kind="stable") if columns is None
                   else np.lexsort((columns, -row)))
        else:  # O(V): everything above the k-th largest value, then the lowest ids among those tied with it
            kth = -np.partition(-row, k - 1)[k - 1]
            above = np.flatnonzero(row > kth)
            tied = np.flatnonzero(row == kth)
            if columns is not None:
                tied = tied[np.argsort(columns[tied], kind="stable")]
            cand = np.concatenate([above, tied[: k - above.size]])
            top = cand[np.lexsort((cand if columns is None else columns[cand], -row[cand]))]
        top = top[:k]
        ids.append((top if columns is None else columns[top]).tolist())
        lps.append(row[top].tolist())  # float32 values as Python floats, summed in float64 like the reference
    return ids, lps


def _ddtree(logq, budget: int, columns: Optional[np.ndarray] = None) -> Tuple[List[int], List[int], List[float]]:
    """`build_ddtree` plus each node's prefix log-probability."""
    logq = np.array(logq.astype(mx.float32)) if isinstance(logq, mx.array) else np.asarray(logq, dtype=np.float32)
    depth_max, vocab = logq.shape
    if depth_max == 0 or budget <= 0:
        return [], [], []
    k = min(budget, vocab)  # a node's i-th child ranks below its first i-1, so deeper ranks can never fit
    ids, lps = _top_k(logq, k, columns)
    # Heap entries (-log q(prefix), push counter, depth, rank, parent slot, parent's log q): the counter breaks
    # ties in push order, as the reference does. Prefix sums are left folds from 0.0, bit for bit the same.
    heap = [(-(0.0 + lps[0][0]), 0, 1, 0, 0, 0.0)]
    counter = 1
    tokens, parents, logprobs = [], [], []
    while heap and len(tokens) < budget:
        neg, _, depth, rank, parent, parent_lp = heapq.heappop(heap)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        logprobs.append(-neg)
        slot = len(tokens)
        if rank + 1 < k:  # next sibling
            heapq.heappush(heap, (-(parent_lp + lps[depth - 1][rank + 1]), counter, depth, rank + 1, parent,
                                  parent_lp))
            counter += 1
        if depth < depth_max:  # first child
            heapq.heappush(heap, (-(-neg + lps[depth][0]), counter, depth + 1, 0, slot, -neg))
            counter += 1
    return tokens, parents, logprobs


def build_ddtree(logq, budget: int) -> Tuple[List[int], List[int]]:
    """DDTree: the `budget` most likely prefixes under the factorized drafter distribution.

    Args:
        logq: [D, V] log-probabilities (numpy or MLX) of the token at depths 1..D.
        budget: nodes in the tree, the root (the last committed token) not counted.
    Returns:
        (tokens, parents): tokens[i] is block slot i+1, parents[i] its parent slot (0: the root). Nodes come in
        descending prefix probability (the order they are popped), so parents precede their children and siblings
        are in rank order.
    """
    tokens, parents, _ = _ddtree(logq, budget)
    return tokens, parents


def propose_tree(draft_logits: mx.array, acceptor, budget: int,
                 columns: Optional[mx.array] = None) -> Optional[TreeProposal]:
    """A DFlash block's drafts as a DDTree of `budget` nodes, from the drafter's logits [D, V].

    `columns` (greedy acceptor only): the logits cover a drafter's reduced vocabulary [D, N] and column j is token
    `columns[j]`. The tree is the one the full-vocabulary logits give (the other ids have probability 0 there),
    without building them: on the CPU the log-softmax over 152k ids cost more than the drafter's forward pass.

    The tree's nodes are fixed top-K choices, so the proposal is a point mass on each: exact under rejection
    sampling, whatever distribution chose them. Nodes are ranked by the distribution the acceptor draws drafts
    from (`draft_distribution`: a sampling acceptor's filters and temperature, else the log-softmax).
    Returns None with logits processors (each node's row would depend on its own path): draft a chain instead.
    """
    if getattr(acceptor, "processors", None):
        return None
    if columns is not None:
        columns = np.array(columns, dtype=np.int64)
    tokens, parents, logprobs = _ddtree(acceptor.draft_distribution(draft_logits), budget, columns)
    # Prefixes the drafter gives probability 0 (filtered out) come last; they add nothing the drafter expects.
    keep = max(1, sum(lp > -np.inf for lp in logprobs)) if tokens else 0
    return TreeProposal(mx.array(tokens[:keep], dtype=mx.int32), point_mass=True, source=DFLASH,
                        parents=tuple(parents[:keep]))


def lookup_tree(index: LookupIndex, widest: int, branches: int,
                deepest: Optional[int] = None) -> Optional[TreeProposal]:
    """Prompt lookup with branches: what followed up to `branches` earlier occurrences of the newest suffix (most
    recent first), merged into a trie of at most `widest - 1` nodes and `deepest` levels (default: as many). The longest suffix (from `index.max_n` down to
    `index.min_n`) with an earlier occurrence decides the match; its occurrences are found by a scan of the
    context (O(context) per call, only when the index has a match). The trie grows a depth at a time, the most
    recent continuation first among siblings (a single occurrence gives the chain `index.propose` gives).
    None without a match."""
    seq, end = index.tokens, len(index.tokens)
    budget = widest - 1
    if budget < 1 or branches < 1:
        return None
    context = None
    for n in range(min(index.max_n, end - 1), index.min_n - 1, -1):
        if not index.occurred(seq[end - n :]):  # the index knows in O(1) whether any occurred
            continue
        # Earlier occurrences, most recent first: the n-grams of seq[:-1] equal to the suffix, by the index of the
        # token that followed each (what it proposes: `LookupIndex.continuation`, on through a repeating run).
        if context is None:
            context = np.asarray(seq, dtype=np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
        starts = (np.flatnonzero((windows == context[end - n :]).all(axis=1))[::-1][:branches] + n).tolist()
        # Grow the trie a depth at a time over all continuations, so that one long copy cannot take the whole
        # budget from the branches; shared prefixes cost nothing.
        tokens: List[int] = []
        parents: List[int] = []
        child = {}  # (parent slot, token) -> slot
        at = [0] * len(starts)  # every continuation's node so far
        depth_limit = budget if deepest is None else min(budget, deepest)
        copies = [index.continuation(start, depth_limit) for start in starts]
        for depth in range(depth_limit):
            for b, copy in enumerate(copies):
                key = (at[b], copy[depth]) if at[b] >= 0 and depth < len(copy) else None
                if key is None or key not in child and len(tokens) == budget:
                    at[b] = -1  # this continuation ends here
                    continue
                if key not in child:
                    tokens.append(key[1])
                    parents.append(key[0])
                    child[key] = len(tokens)
                at[b] = child[key]
        return TreeProposal(mx.array(tokens, dtype=mx.int32), point_mass=True, source=LOOKUP, parents=tuple(parents))
    return None


# -- verifying trees -------------------------------------------------------------------------------------------------
# The node-level steps every acceptor's `verify` takes on a tree (`acceptance.py`); see the module docstring.
def children(proposal: TreeProposal, target_logits: mx.array) -> np.ndarray:
    """[n+1, Kmax] the child slots of every slot in slot order, padded with -1; a tree whose tokens, rows or
    parents do not fit together is refused (ValueError)."""
    parents = tuple(proposal.parents)
    if proposal.tokens.shape[-1] != len(parents) or target_logits.shape[-2] != len(parents) + 1:
        raise ValueError(f"a tree of {len(parents)} nodes needs {len(parents)} tokens and {len(parents) + 1} "
                         f"target rows, got {proposal.tokens.shape[-1]} and {target_logits.shape[-2]}")
    kids: List[List[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        if not 0 <= p <= i:
            raise ValueError(f"parent of slot {i + 1} must be an earlier slot, got {p}")
        kids[p].append(i + 1)
    width = max(1, max(len(k) for k in kids))
    return np.array([k + [-1] * (width - len(k)) for k in kids], dtype=np.int32)


def paths(proposal: TreeProposal) -> List[List[int]]:
    """Every slot's path from the root: the block slots before it (the root's is empty)."""
    out: List[List[int]] = [[]]
    for p in proposal.parents:
        out.append(out[p] + [len(out)])  # the slot being added
    return out


def _node_tokens(tokens: mx.array) -> mx.array:
    """[..., n+1] every slot's token, the root's -1 (it is nobody's child; padded children point at it)."""
    root = mx.full(tokens.shape[:-1] + (1,), -1, dtype=mx.int32)
    return mx.concatenate([root, tokens.astype(mx.int32)], axis=-1)


def follow(choice: mx.array, tokens: mx.array, kids: np.ndarray) -> mx.array:
    """[..., n+1] at every node, the first child whose token is the node's choice, or -1."""
    slots = mx.array(np.maximum(kids, 0))
    kid_tokens = mx.take(_node_tokens(tokens), slots.reshape(-1), axis=-1).reshape(tokens.shape[:-1] + kids.shape)
    match = kid_tokens == choice[..., None]
    first = mx.argmax(match, axis=-1)
    return mx.where(match.any(axis=-1), mx.take(slots.reshape(-1), mx.arange(kids.shape[0]) * kids.shape[1] + first),
                    -1).astype(mx.int32)


def _residual(r: mx.array, mass: mx.array, q: mx.array) -> mx.array:
    """Unnormalized residual after rejecting a child drawn from q: max(r/mass - q, 0), times mass."""
    return mx.maximum(r - mass[..., None] * q, 0.0)


def sampled(logp: mx.array, proposal: TreeProposal, kids: np.ndarray, key_accept, key_fix):
    """(kept child or -1, token drawn after the node) for every node under multi-draft rejection sampling."""
    tokens = proposal.tokens
    if proposal.logq is None:
        # Point masses: trying children in order (accept x_j with prob r(x_j), else drop x_j from r) has the law
        # of one draw y ~ p: keep the child whose token is y, else y is the target's token. One draw per row.
        choice = mx.random.categorical(logp, axis=-1, key=key_fix).astype(mx.int32)
        return follow(choice, tokens, kids), choice
    q = mx.exp(proposal.logq.astype(mx.float32))
    q = mx.concatenate([mx.zeros(q.shape[:-2] + (1, q.shape[-1]), dtype=q.dtype), q], axis=-2)  # [..., n+1, V]
    node_tokens = mx.maximum(_node_tokens(tokens), 0)[..., None]
    r = mx.exp(logp)
    mass = r.sum(axis=-1)
    width = kids.shape[1]
    u = mx.random.uniform(shape=logp.shape[:-2] + (width, kids.shape[0]), key=key_accept)
    kept = mx.full(logp.shape[:-1], -1, dtype=mx.int32)
    for j in range(width):
        valid = kids[:, j] >= 0
        slots = mx.array(np.maximum(kids[:, j], 0))
        x = mx.take(node_tokens, slots, axis=-2)  # [..., n+1, 1]: child j's token at every node
        qj = mx.take(q, slots, axis=-2)
        q_x = mx.take_along_axis(qj, x, axis=-1)[..., 0]
        r_x = mx.take_along_axis(r, x, axis=-1)[..., 0]
        live = mx.array(valid) & (kept < 0)
        # min(1, (r/mass)(x) / q(x)) with u in [0, 1): r(x) == 0 never accepts.
        ok = live & (u[..., j, :] * q_x * mass < r_x)
        kept = mx.where(ok, slots, kept)
        rest = _residual(r, mass, qj)
        rest_mass = rest.sum(axis=-1)
        # An empty residual means r == q_j, where rejection has probability 0: keep r to stay finite.
        moved = live & ~ok & (rest_mass > 0)
        r = mx.where(moved[..., None], rest, r)
        mass = mx.where(moved, rest_mass, mass)
    fix = mx.random.categorical(mx.log(r), axis=-1, key=key_fix).astype(mx.int32)
    return kept, fix


def walk(kept: mx.array, choice: mx.array, depths: Sequence[int]) -> Tuple[mx.array, mx.array, mx.array]:
    """From the root along the kept children: (acc nodes accepted, path [..., Dmax] their slots root to leaf, 0
    past acc, the token chosen at the last node: the bonus or the correction). A node without a kept child keeps
    the walk there (its `kept` is -1 every step after)."""
    cur = mx.zeros(kept.shape[:-1], dtype=mx.int32)
    acc = mx.zeros(kept.shape[:-1], dtype=mx.int32)
    path = []
    for _ in range(max(depths)):
        nxt = mx.take_along_axis(kept, cur[..., None], axis=-1)[..., 0]
        ok = nxt >= 0
        path.append(mx.where(ok, nxt, 0))
        cur = mx.where(ok, nxt, cur)
        acc = acc + ok.astype(mx.int32)
    fix = mx.take_along_axis(choice, cur[..., None], axis=-1)[..., 0]
    path = mx.stack(path, axis=-1).astype(mx.int32) if path else mx.zeros(kept.shape[:-1] + (0,), dtype=mx.int32)
    return acc, path, fix.astype(mx.int32)


def matched(proposal: TreeProposal, kids: np.ndarray, choice: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
    """The verdict of a rule that chose one token per node (greedy, an opaque sampler): follow the children that
    equal it."""
    return walk(follow(choice, proposal.tokens, kids), choice, proposal.depths)


def verify_tree(acceptor, proposal: TreeProposal, target_logits: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
    """Which path of a tree the target keeps, and its token after it (lazy): `acceptor.verify` on a tree.

    Args:
        acceptor: any acceptance rule (`acceptance.GreedyAcceptor`, `SamplingAcceptor`, `MatchAcceptor`).
        proposal: the tree (`tokens` [..., n], `parents`, and for sampled nodes `logq` [..., n, V]).
        target_logits: [..., n+1, V], row i the target's logits after block slot i (tree attention).
    Returns:
        (acc, path, fix): acc int32 [...] nodes accepted; path int32 [..., Dmax] their block slots in order (root
        to leaf), 0 past acc; fix int32 [...] the target's token after the accepted path (bonus or correction).
    Leading batch dimensions (trees of one shape with their own tokens) work without logits processors.
    """
    return acceptor.verify(proposal, target_logits)
