"""Acceptance rules: how draft tokens are proposed from the drafter's logits and which of them the target keeps.

An acceptor draws a pass's drafts into a `Proposal` (the tokens and, for rejection sampling, the rows they were
drawn from) and turns the verify of that proposal into `(acc, fix)`: `acc` draft tokens are accepted and
`fix[acc]` is the target's own token after them (the bonus, or the correction at the first rejection); only
`fix[acc]` is read, and the sampling acceptor draws just that one token (it fills every slot of `fix` with it).
Everything stays on the device so a pass needs a single host sync. Greedy is the fast special case; `SamplingAcceptor` is lossless
rejection sampling (docs/acceptance.md); `MatchAcceptor` runs an opaque mlx-lm sampler. `make_acceptor` picks
the rule for mlx-lm's sampling options, and `reproducible` says, for every part of the engine that asks, whether
a run must follow from its seed alone.

Protocol (all arrays lazy):
    observe(tokens)                      tokens the target has now seen: the prompt, then each cycle's commits
    first(logits [V]) -> token           the token after the prompt
    propose(draft_logits [B-1, V]) -> Proposal
    propose_walk(walk, anchor) -> Proposal      drafts whose row i depends on draft i-1 (see `DraftWalk`)
    propose_tokens(draft [B-1]) -> Proposal     drafts fixed in advance (copied from the context): a point-mass
                                         proposal q = one-hot(draft[i]), accepted with probability p(draft[i])
    draft_distribution(draft_logits) -> log q   what drafts are ranked by when a tree picks its nodes
    verify(proposal, target_logits [B, V]) -> (acc, fix [B])            a chain
    verify(tree, target_logits [n+1, V]) -> (acc, path [Dmax], fix)      a `proposal.TreeProposal`: the path of
                                         accepted block slots (0 past acc) and the token after it
Row i of the target's logits predicts the token after block[i], so draft[i] (block slot i+1) is judged by row i.
A tree is judged by the same rule node by node (`tree`: a node's children stand where a chain's next draft
stands); each acceptor takes both shapes through its one `verify`.
The proposal is a value (`proposal.Proposal`): cutting it (`Proposal.cut`) cuts its rows with it, and `verify`
divides by the rows it carries, never by state kept from an earlier call.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Protocol, Sequence, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors

from ..errors import DFlashError
from . import tree as trees
from .proposal import Proposal, TreeProposal
from .sampling import LogitsProcessor, SamplingParams, check_seed, log_distribution, process_rows


class DraftWalk(Protocol):
    """A draft proposed one slot after another: row i's logits depend on the token chosen for slot i-1 (DSpark's
    Markov head, DFlash 2's candidate selector). `row(i, prev)` gives logits [V] over the target vocabulary for
    draft slot i given `prev` (the anchor for i = 0, else draft i-1), as a scalar int32 array; the acceptor draws
    each draft from its row, so the proposal distribution is exactly what rejection sampling divides by."""

    length: int

    def row(self, i: int, prev: mx.array) -> mx.array: ...


def _walk(walk: DraftWalk, anchor, choose: Callable[[int, mx.array, mx.array], mx.array]) -> mx.array:
    """Draft [n] from a walk, `choose(i, row [1, V], drafts so far)` picking each slot's token [1]."""
    draft = mx.zeros((0,), dtype=mx.int32)
    prev = mx.array(anchor, dtype=mx.int32).reshape(())
    for i in range(walk.length):
        token = choose(i, walk.row(i, prev).reshape(1, -1), draft).astype(mx.int32).reshape(1)
        draft = mx.concatenate([draft, token])
        prev = token[0]
    return draft


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class Acceptor(Protocol):
    """The acceptance rule the pass step runs; see the protocol in the module docstring."""

    def observe(self, tokens) -> None: ...

    def first(self, logits: mx.array) -> mx.array: ...

    def propose(self, draft_logits: mx.array) -> Proposal: ...

    def propose_walk(self, walk: DraftWalk, anchor) -> Proposal: ...

    def propose_tokens(self, draft: mx.array) -> Proposal: ...

    def draft_distribution(self, draft_logits: mx.array) -> mx.array: ...

    def verify(self, proposal: Proposal, target_logits: mx.array) -> Tuple[mx.array, ...]: ...


class GreedyAcceptor:
    """Temperature 0: propose the drafter's argmax, keep drafts while they equal the target's argmax."""

    def observe(self, tokens) -> None:
        pass

    def first(self, logits: mx.array) -> mx.array:
        """The token after the prompt, from the prefill's last logits [V]."""
        return mx.argmax(logits, axis=-1)

    def propose(self, draft_logits: mx.array) -> Proposal:
        """Draft tokens [B-1] from draft logits [B-1, V]."""
        return Proposal(mx.argmax(draft_logits, axis=-1).astype(mx.int32))

    def propose_walk(self, walk: DraftWalk, anchor) -> Proposal:
        """Draft tokens [n]: each slot's argmax given the previous slot's."""
        return Proposal(_walk(walk, anchor, lambda i, row, draft: mx.argmax(row, axis=-1)))

    def propose_tokens(self, draft: mx.array) -> Proposal:
        """Fixed drafts [n] (copied from the context): kept while they equal the target's argmax."""
        return Proposal(draft, point_mass=True)

    def draft_distribution(self, draft_logits: mx.array) -> mx.array:
        """The log-distribution over [..., V] drafts are ranked by (a tree's nodes): the log-softmax."""
        return _log_softmax(draft_logits)

    def verify(self, proposal: Proposal, target_logits: mx.array) -> Tuple[mx.array, ...]:
        """A proposal of B-1 drafts, target_logits [B, V] -> (acc scalar, fix [B]); a tree -> (acc, path, fix)."""
        draft = proposal.tokens
        choice = mx.argmax(target_logits, axis=-1).astype(mx.int32)
        if isinstance(proposal, TreeProposal):
            return trees.matched(proposal, trees.children(proposal, target_logits), choice)
        if draft.size == 0:
            return mx.array(0, dtype=mx.int32), choice
        # acc = length of the longest prefix of drafts equal to the target's own choices.
        acc = mx.cumprod((draft == choice[:-1]).astype(mx.int32)).sum()
        return acc.astype(mx.int32), choice


class _History:
    """The token history logits processors see (mlx-lm passes the prompt plus every generated token)."""

    def __init__(self, processors: Sequence[LogitsProcessor]):
        self.processors = list(processors)
        self.history = mx.zeros((0,), dtype=mx.int32)

    def observe(self, tokens) -> None:
        if self.processors:
            new = tokens.astype(mx.int32) if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.int32)
            self.history = mx.concatenate([self.history, new.reshape(-1)])

    def _process(self, logits: mx.array, block: Optional[mx.array] = None) -> mx.array:
        """Row i of logits [R, V] processed after history + block[:i]."""
        empty = mx.zeros((0,), dtype=mx.int32)
        return process_rows(self.processors, self.history, logits, empty if block is None else block)

    def _process_after(self, row: mx.array, prefix: mx.array) -> mx.array:
        """One row [1, V] processed after history + prefix."""
        history = mx.concatenate([self.history, prefix.astype(mx.int32)])
        return process_rows(self.processors, history, row, mx.zeros((0,), dtype=mx.int32))

    def _tree_rows(self, tree: TreeProposal, target_logits: mx.array) -> mx.array:
        """The target's logits at every node of a tree, each through the processors after the node's own path."""
        if not self.processors:
            return target_logits
        if target_logits.ndim != 2:
            raise ValueError("logits processors take one tree at a time (no batch dimensions)")
        rows = []
        for slot, path in enumerate(trees.paths(tree)):
            prefix = mx.take(tree.tokens, mx.array([s - 1 for s in path], dtype=mx.int32)) if path else \
                mx.zeros((0,), dtype=mx.int32)
            rows.append(self._process_after(target_logits[slot : slot + 1], prefix))
        return mx.concatenate(rows, axis=0)


class SamplingAcceptor(_History):
    """Lossless speculative sampling (Leviathan et al.) with mlx-lm's sampling options.

    Draft token i is drawn from q_i (the drafter's row i through the same processors, filters and temperature as
    the target) and kept with probability min(1, p_i/q_i); at the first rejection the target's token is drawn from
    normalize(max(p_i - q_i, 0)); after a full accept the bonus is drawn from p_{B-1}. Every committed token is
    then distributed exactly as plain sampling from the target. At temperature 0 (with processors) it is greedy on
    the processed logits.

    Randomness comes from explicit keys split off `seed`, so a seed reproduces a run regardless of other users of
    MLX's global generator. Without logits processors every method also accepts leading batch dimensions.
    """

    def __init__(self, params: SamplingParams, logits_processors: Sequence[LogitsProcessor] = (),
                 seed: Optional[int] = None):
        super().__init__(logits_processors)
        self.params = params
        self.seeded = seed is not None  # the caller's seed: the output must follow from it alone (`reproducible`)
        if seed is None:
            seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
        self._key = mx.random.key(int(seed))

    def _keys(self, n: int) -> mx.array:
        keys = mx.random.split(self._key, n + 1)
        self._key = keys[0]
        return keys[1:]

    def _draw(self, logdist: mx.array, key: mx.array) -> mx.array:
        if self.params.greedy:
            return mx.argmax(logdist, axis=-1).astype(mx.int32)
        return mx.random.categorical(logdist, axis=-1, key=key).astype(mx.int32)

    def first(self, logits: mx.array) -> mx.array:
        logdist = log_distribution(self._process(logits.reshape(1, -1)), self.params)[0]
        return self._draw(logdist, self._keys(1)[0])

    def propose(self, draft_logits: mx.array) -> Proposal:
        keys = self._keys(max(draft_logits.shape[-2], 1))
        if not self.processors:
            logq = log_distribution(draft_logits, self.params)
            draft = self._draw(logq, keys[0])
        else:
            # Row i's processors see the drafts before it, so the rows are drawn one after another.
            draft = mx.zeros((0,), dtype=mx.int32)
            rows = []
            for i in range(draft_logits.shape[0]):
                row = log_distribution(self._process_after(draft_logits[i : i + 1], draft), self.params)
                rows.append(row)
                draft = mx.concatenate([draft, self._draw(row, keys[i])])
            logq = mx.concatenate(rows, axis=0) if rows else draft_logits.astype(mx.float32)
        return Proposal(draft, logq)

    def propose_walk(self, walk: DraftWalk, anchor) -> Proposal:
        """Draft tokens [n], each drawn from its row given the drafts before it; verify divides by those rows."""
        keys = self._keys(max(walk.length, 1))
        rows = []

        def choose(i, row, draft):
            logq = log_distribution(self._process_after(row, draft) if self.processors else row, self.params)
            rows.append(logq)
            return self._draw(logq, keys[i])

        draft = _walk(walk, anchor, choose)
        return Proposal(draft, mx.concatenate(rows, axis=0) if rows else mx.zeros((0, 0)))

    def propose_tokens(self, draft: mx.array) -> Proposal:
        """Fixed drafts [n]: q is a point mass on each, so verify accepts draft i with probability p(draft i) and
        at a rejection draws from p with draft i removed (normalize(max(p - one-hot, 0))): exact sampling."""
        return Proposal(draft, point_mass=True)  # verify builds the one-hot log q once it knows the vocabulary

    def draft_distribution(self, draft_logits: mx.array) -> mx.array:
        """The distribution drafts are drawn from: the drafter's logits through the target's filters and temperature."""
        return log_distribution(draft_logits, self.params)

    @staticmethod
    def _logq(proposal: Proposal, vocab_size: int) -> mx.array:
        if proposal.point_mass and proposal.logq is None:
            vocab = mx.arange(vocab_size, dtype=mx.int32)
            return mx.where(vocab == proposal.tokens[..., None], 0.0, -mx.inf).astype(mx.float32)
        return proposal.logq

    def verify(self, proposal: Proposal, target_logits: mx.array) -> Tuple[mx.array, ...]:
        if isinstance(proposal, TreeProposal):
            return self._verify_tree(proposal, target_logits)
        draft = proposal.tokens
        logp = log_distribution(self._process(target_logits, draft) if self.processors else target_logits,
                                self.params)  # [..., B, V]
        key_accept, key_fix = self._keys(2)
        if draft.shape[-1] == 0:
            return mx.zeros(draft.shape[:-1], dtype=mx.int32), self._draw(logp, key_fix)
        logq = self._logq(proposal, logp.shape[-1])  # [..., B-1, V]
        if self.params.greedy:
            choice = self._draw(logp, key_fix)
            acc = mx.cumprod((draft == choice[..., :-1]).astype(mx.int32), axis=-1).sum(axis=-1)
            return acc.astype(mx.int32), choice
        idx = draft[..., None].astype(mx.int32)
        p_d = mx.exp(mx.take_along_axis(logp[..., :-1, :], idx, axis=-1)[..., 0])
        q_d = mx.exp(mx.take_along_axis(logq, idx, axis=-1)[..., 0])
        # Accept with probability min(1, p/q): u in [0, 1), so p >= q always accepts and p == 0 never does.
        u = mx.random.uniform(shape=p_d.shape, key=key_accept)
        acc = mx.cumprod((u * q_d < p_d).astype(mx.int32), axis=-1).sum(axis=-1).astype(mx.int32)
        # Only row `acc` is ever committed, so only it is sampled: the residual at the first rejection, or the bonus
        # after a full accept (q is 0 past the last draft, which makes the residual p itself).
        row = acc[..., None, None]
        logp_row = mx.take_along_axis(logp, row, axis=-2)[..., 0, :]
        no_draft = mx.full(logq.shape[:-2] + (1, logq.shape[-1]), -mx.inf, dtype=logq.dtype)
        logq_row = mx.take_along_axis(mx.concatenate([logq, no_draft], axis=-2), row, axis=-2)[..., 0, :]
        token = self._draw(self._fix_distribution(logp_row, logq_row), key_fix)
        return acc, mx.broadcast_to(token[..., None], token.shape + (logp.shape[-2],))

    def _verify_tree(self, tree: TreeProposal, target_logits: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
        """Multi-draft rejection sampling at every node (`tree.sampled`); greedy on the processed logits
        at temperature 0."""
        kids = trees.children(tree, target_logits)
        rows = self._tree_rows(tree, target_logits)
        key_accept, key_fix = self._keys(2)
        logp = log_distribution(rows, self.params)
        if self.params.greedy:
            return trees.matched(tree, kids, mx.argmax(logp, axis=-1).astype(mx.int32))
        kept, choice = trees.sampled(logp, tree, kids, key_accept, key_fix)
        return trees.walk(kept, choice, tree.depths)

    @staticmethod
    def _fix_distribution(logp_row: mx.array, logq_row: mx.array) -> mx.array:
        """log normalize(max(p - q, 0)) (unnormalized: categorical normalizes). It is empty only when p == q,
        where rejection has probability 0; then fall back to p to stay finite."""
        residual = mx.maximum(mx.exp(logp_row) - mx.exp(logq_row), 0.0)
        return mx.where(residual.sum(axis=-1, keepdims=True) > 0, mx.log(residual), logp_row)


class MatchAcceptor(_History):
    """An opaque mlx-lm sampler: the target samples every position and drafts are kept while they match.

    Lossless for any sampler that treats the rows of a [R, V] batch independently (mlx-lm's do, as its own
    speculative decoding relies on; XTC shares one coin flip across rows); acceptance is lower than rejection
    sampling's. Drafts are the drafter's argmax (it maximises the chance of a match). The sampler draws from MLX's
    global generator (`mx.random.seed`). Without logits processors, leading batch dimensions are accepted.
    """

    def __init__(self, sampler: Callable[[mx.array], mx.array], logits_processors: Sequence[LogitsProcessor] = (),
                 seeded: bool = False):
        super().__init__(logits_processors)
        self.sampler = sampler
        self.seeded = seeded  # MLX's global generator was seeded for this run (`make_acceptor(seed=)`)

    def _sample(self, logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return self.sampler(logprobs).astype(mx.int32)

    def first(self, logits: mx.array) -> mx.array:
        return self._sample(self._process(logits.reshape(1, -1)))[0]

    def propose(self, draft_logits: mx.array) -> Proposal:
        if not self.processors:
            return Proposal(mx.argmax(draft_logits, axis=-1).astype(mx.int32))
        draft = mx.zeros((0,), dtype=mx.int32)
        for i in range(draft_logits.shape[0]):
            row = self._process_after(draft_logits[i : i + 1], draft)
            draft = mx.concatenate([draft, mx.argmax(row, axis=-1).astype(mx.int32)])
        return Proposal(draft)

    def propose_walk(self, walk: DraftWalk, anchor) -> Proposal:
        """Draft tokens [n]: each slot's (processed) argmax given the drafts before it."""
        return Proposal(_walk(walk, anchor, lambda i, row, draft: mx.argmax(
            self._process_after(row, draft) if self.processors else row, axis=-1)))

    def propose_tokens(self, draft: mx.array) -> Proposal:
        """Fixed drafts [n]: kept while the target's own samples equal them."""
        return Proposal(draft, point_mass=True)

    def draft_distribution(self, draft_logits: mx.array) -> mx.array:
        """The log-softmax: an opaque sampler has no distribution to rank by."""
        return _log_softmax(draft_logits)

    def verify(self, proposal: Proposal, target_logits: mx.array) -> Tuple[mx.array, ...]:
        if isinstance(proposal, TreeProposal):  # sample every node, follow the child equal to its sample
            kids = trees.children(proposal, target_logits)
            return trees.matched(proposal, kids, self._sample(self._tree_rows(proposal, target_logits)))
        draft = proposal.tokens
        choice = self._sample(self._process(target_logits, draft) if self.processors else target_logits)
        if draft.shape[-1] == 0:
            return mx.zeros(draft.shape[:-1], dtype=mx.int32), choice
        acc = mx.cumprod((draft == choice[..., :-1]).astype(mx.int32), axis=-1).sum(axis=-1)
        return acc.astype(mx.int32), choice


def reproducible(acceptor) -> bool:
    """Whether a run with this acceptor must give the same output for the same seed: a sampling rule given a seed.
    Then nothing it draws may depend on the clock: verify widths and tree budgets are chosen from acceptance and a
    fixed cost model, not from measured seconds. (Greedy output is the target's own whatever the widths.)"""
    return bool(getattr(acceptor, "seeded", False))


def make_acceptor(
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    seed: Optional[int] = None,
    *,
    repetition_penalty: Optional[float] = None,
    repetition_context_size: int = 20,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
) -> Acceptor:
    """The acceptance rule for these options (the sampling keywords of `stream_generate`).

    Greedy (temp 0, no processors) -> `GreedyAcceptor`; otherwise `SamplingAcceptor` (rejection sampling on the
    exact distributions). An opaque mlx-lm `sampler` object cannot be turned into a distribution, so it runs
    through `MatchAcceptor` (the target samples every position, drafts are kept while they match: lossless for
    any sampler that treats rows independently, with lower acceptance).

    Args:
        temp, top_p, top_k, min_p, min_tokens_to_keep: as in `mlx_lm.sample_utils.make_sampler`.
        seed: seeds the sampling (same seed, same output); `None` draws one from MLX's global generator.
        repetition_penalty, repetition_context_size: as in `make_logits_processors`.
        logits_processors: extra mlx-lm logits processors `(tokens, logits) -> logits`, applied after those.
        sampler: an mlx-lm sampler object, instead of temp/top_p/top_k/min_p.
    """
    if repetition_penalty is not None and not repetition_penalty > 0:
        raise DFlashError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    check_seed(seed, "seed")
    processors = list(make_logits_processors(repetition_penalty=repetition_penalty,
                                             repetition_context_size=repetition_context_size))
    processors += list(logits_processors or [])
    params = SamplingParams(temp, top_p, top_k, min_p, min_tokens_to_keep)
    if sampler is not None and sampler is not greedy_sampler:
        if params != SamplingParams():
            raise DFlashError("give either sampler= or temp/top_p/top_k/min_p, not both")
        if seed is not None:
            mx.random.seed(seed)  # an opaque sampler draws from MLX's global generator
        return MatchAcceptor(sampler, processors, seeded=seed is not None)
    if params.greedy and not processors:
        return GreedyAcceptor()
    return SamplingAcceptor(params, processors, seed=seed)
