"""The pass step: one verify pass of one generation, in the phases the single-stream loop and the batch share.

    start(prompt)            prefill; the first token (a `Pass` with `is_prefill`)
    propose()                the planner picks a proposer and a width (or a tree budget) from the proposers'
                             offers; it drafts a chain or a tree (`proposal.TreeProposal`)
    block(proposal)          the ids the target verifies: [last committed token, drafts...]
    forward(proposal)        the single stream's target pass over the block (a tree: one pass with a tree mask)
    verify(proposal, ...)    the acceptor's verdict on the target's logits, packed for one host sync
    finish(launch, values)   roll the caches back to the kept prefix (a tree: keep the accepted path's rows), tell
                             every proposer what was committed
    withdraw(launch)         a launched pass the caller no longer wants, undone before `finish`
    take_back(launch)        a finished pass the caller never saw, undone after `finish`

The target forward between `block` and `verify` is the caller's: the loop runs one request's block
(`loop.dflash_generate_step`, which queues the next pass before yielding the current one), the batch runs every
member's blocks in one ragged pass (`batching.Batch`). Every committed token is the target's own choice given the
committed prefix, so the output is the target's alone whatever the proposer, width or batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..targets import TargetModel
from ..targets.tree import commit_path, tree_segment
from ..targets.walk import Chain, Segment
from .acceptance import Acceptor
from .lookup import LookupIndex
from .planner import Planner
from .proposal import LOOKUP, PLAIN, Proposal, TreeProposal
from .proposers import Proposer, as_proposer
from .proposers.dflash import DFlashProposer
from .proposers.eagle3 import EAGLE3, Eagle3Proposer
from .proposers.lookup import LookupProposer
from .proposers.mtp import MTP, MTPProposer
from .proposers.plain import PlainProposer
from .state import DecodeState, prefill

CLEAR_CACHE_EVERY = 256  # passes between releases of MLX's buffer cache, as mlx-lm's decode loop does


@dataclass
class Pass:
    """What one verify pass committed (the first pass of a generation is the prefill's token)."""

    tokens: List[int]  # committed tokens, a stop token included, cut at the token limit
    accepted: int  # draft tokens the pass accepted (0..width-1); the last token is always the target's own
    width: int  # tokens the pass verified (1: a plain decoding step; 1 for the prefill's token)
    logits: Optional[mx.array] = None  # [len(tokens), V] the target logits that chose each token (lazy)
    is_prefill: bool = False
    source: str = PLAIN  # its proposer's name: "dflash", "mtp", "lookup", a caller's own, or "plain" (no drafts)
    segments: List[str] = field(default_factory=list)  # text each token added (filled by `Generation`)
    finish_reason: Optional[str] = None  # why the generation ends after it: "stop", "length", or None: it goes on

    @property
    def text(self) -> str:
        return "".join(self.segments)


@dataclass
class Launch:
    """A pass whose verify is queued: the device computes it while the host does other work."""

    proposal: Proposal
    packed: mx.array  # [acc, choice_0..choice_{w-1}, draft_1..draft_{w-1}]
    logits: mx.array  # [w, V]
    hidden: mx.array  # [1, w, n*H]
    write: Any = None  # a tree pass's verify write (`targets.tree.TreeWrite`), kept out of the caches until finish
    budget: Optional[int] = None  # a tree pass's budget
    context: Optional[str] = None  # its plan's context (`planner.Plan.context`)
    chain_width: Optional[int] = None  # a tree pass: the width of the chain it stood in for
    kept: int = 0  # tokens `finish` committed
    previous_token: int = -1  # the last committed token before it

    @property
    def width(self) -> int:
        return self.proposal.width


def drafting_proposer(drafter, proposer: Optional[Proposer] = None,
                      mask_token_id: Optional[int] = None) -> Optional[Proposer]:
    """The proposer that fills passes wider than 1 when lookup does not: the one given, else the one the drafter
    names (`drafts_with`: "mtp" for a target's MTP layers, "eagle3" for an EAGLE-3 head), else the drafter's
    blocks (None: neither)."""
    if proposer is not None:
        return proposer
    if getattr(drafter, "drafts_with", None) == MTP:
        return MTPProposer(drafter)
    if getattr(drafter, "drafts_with", None) == EAGLE3:
        return Eagle3Proposer(drafter)
    return DFlashProposer(drafter, mask_token_id) if drafter is not None else None


def proposers_for(drafting: Optional[Proposer], lookup: Optional[LookupIndex]) -> Dict[str, Proposer]:
    """The proposers of a generation by name: plain decoding always, the drafting proposer when there is one,
    prompt lookup with an index."""
    proposers: Dict[str, Proposer] = {PLAIN: PlainProposer()}
    if drafting is not None:
        proposers[drafting.name] = drafting
    if lookup is not None:
        proposers[LOOKUP] = LookupProposer(lookup)
    return proposers


def check_ready(drafting: Optional[Proposer], planner: Planner) -> None:
    """Refuse, before anything runs, what would fail at the first drafted pass: a DFlash drafter without a mask
    id, where the planner may draft with it (a width held at 1 never does; lookup choices may never need it)."""
    if isinstance(drafting, DFlashProposer) and planner.drafting and planner.choice is None:
        drafting.check_mask()


def accepted_path(values: Sequence[int], proposal: TreeProposal, stops: set):
    """(tokens to commit, drafts accepted, block slots whose rows chose them: the root, then the accepted nodes)
    from a tree pass's packed result; a stop token ends the commit."""
    acc, fix = values[0], values[1]
    n = len(proposal.parents)
    path_len = len(values) - 2 - n
    path = values[2 : 2 + path_len][:acc]
    drafts = values[2 + path_len :]
    return cut_at_stop([drafts[s - 1] for s in path] + [fix], stops), acc, [0] + list(path)


def first_choices(proposal: TreeProposal, path: Sequence[int], chain_width: Optional[int]):
    """(width, accepted) of the chain of a tree's first children (what a chain would have drafted) as this pass
    judged it: its drafts accepted are the path's leading first children. None without a chain width."""
    if not chain_width:
        return None
    first = {}
    for slot, parent in enumerate(proposal.parents, start=1):
        first.setdefault(parent, slot)
    depth, slot = 0, 0
    while slot in first:
        slot, depth = first[slot], depth + 1
    accepted, slot = 0, 0
    for node in path:
        if first.get(slot) != node:
            break
        accepted, slot = accepted + 1, node
    width = max(1, min(chain_width, depth + 1))
    return width, min(accepted, width - 1)


def accepted_tokens(values: Sequence[int], width: int, stops: set):
    """(tokens to commit, drafts accepted) from a pass's packed result; a stop token ends the commit."""
    acc, choice = values[0], values[1 : 1 + width]
    return cut_at_stop(list(values[1 + width : 1 + width + acc]) + [choice[acc]], stops), acc


def cut_at_stop(tokens: List[int], stops: set) -> List[int]:
    """`tokens` up to and including the first stop token."""
    stop_at = next((i for i, t in enumerate(tokens) if t in stops), None)
    return tokens if stop_at is None else tokens[: stop_at + 1]


class Decoder:
    """One generation's passes; see the module docstring.

    Args:
        target: the wrapped target; drafter: its drafter or None (the prefill feeds its cache).
        proposers: by name (`proposers_for`); planner: chooses each pass's proposer and width.
        acceptor: the acceptance rule; state: the caches.
        max_tokens: tokens to commit at most (None or < 0: no limit); stops: stop token ids.
        mark: for benchmarks, `mark(phase, *arrays)` at the end of each phase (see `loop.dflash_generate_step`).
        clears_cache: release MLX's buffer cache every `CLEAR_CACHE_EVERY` passes (a batch does it per shared
            pass instead).
    """

    def __init__(self, target: TargetModel, drafter, proposers: Dict[str, Proposer], planner: Planner,
                 acceptor: Acceptor, state: DecodeState, *, max_tokens: Optional[int], stops: Sequence[int] = (),
                 mark: Optional[Callable] = None, clears_cache: bool = True):
        self.target, self.drafter, self.planner = target, drafter, planner
        self.proposers = {name: as_proposer(p) for name, p in proposers.items()}
        self.acceptor, self.state = acceptor, state
        self.limit = float("inf") if max_tokens is None or max_tokens < 0 else max_tokens
        self.stops = set(int(t) for t in stops)
        self.mark = mark or (lambda phase, *arrays: None)
        self.clears_cache = clears_cache
        self.emitted = self.passes = 0
        self.wants = True  # wants another pass
        target.check_rollback_supported(state.target_cache)
        self.budget: Optional[int] = None  # the tree budget of the pass being proposed
        self.context: Optional[str] = None  # and its plan's context
        self.chain_width: Optional[int] = None  # and, for a tree, the chain it stands in for

    def _observe(self, tokens: List[int], features: Optional[mx.array]) -> None:
        self.acceptor.observe(tokens)
        for proposer in self.proposers.values():
            proposer.observe(self.state, tokens, features)

    def start(self, prompt: mx.array, step_size: int = 2048,
              progress: Optional[Callable[[int, int], None]] = None) -> Pass:
        """Prefill `prompt` (its features go to the draft cache) and choose the token after it."""
        # History-dependent logits processors and the lookup index see every token the target has seen.
        self.acceptor.observe(prompt)
        tokens = prompt.tolist()
        for proposer in self.proposers.values():
            proposer.observe(self.state, tokens, None)
        last_logits = prefill(self.target, self.drafter, prompt, self.state, step_size, progress)
        first = int(self.acceptor.first(last_logits).item())
        self.state.last_token = first
        self._observe([first], None)
        self.mark("prefill")
        self.emitted = 1
        ended = self._ended([first])
        self.wants = ended is None
        return Pass([first], 0, 1, logits=last_logits[None], is_prefill=True, finish_reason=ended)

    def _ended(self, tokens: List[int]) -> Optional[str]:
        """Why the generation ends after committing `tokens`: "stop" (its last is a stop token), "length"
        (`max_tokens` reached); None: it goes on. The one place that decides it."""
        if tokens[-1] in self.stops:
            return "stop"
        return "length" if self.emitted >= self.limit else None

    def propose(self) -> Proposal:
        """Plan the next pass and draft it (queued on the device; a lookup runs on the host now)."""
        self.mark("host")
        room = self.limit - self.emitted
        offers = {name: p.offer(self.state, int(min(self.planner.widest(name), room)))
                  for name, p in self.proposers.items() if name != PLAIN}
        plan = self.planner.plan(offers, room)
        self.budget, self.context, self.chain_width = None, plan.context, plan.chain_width
        if plan.width <= 1:
            return Proposal.empty()
        proposer = self.proposers[plan.source]
        with mx.stream(generation_stream):
            proposal = None
            if plan.budget is not None:  # a tree as deep as the proposer drafts
                proposal = proposer.propose_tree(self.state, self.acceptor, min(plan.width, proposer.widest),
                                                 plan.budget, plan.offer)
                # None: no tree this time (whether trees can run at all was decided with the planner); its chain.
                self.budget = plan.budget if isinstance(proposal, TreeProposal) else None
            if proposal is None:
                width = plan.width if plan.budget is None else plan.chain_width
                if width <= 1:  # the width policy had chosen plain decoding
                    self.mark("draft", mx.zeros((0,), dtype=mx.int32))
                    return Proposal.empty()
                proposal = proposer.propose(self.state, self.acceptor, width, plan.offer)
            proposal = replace(proposal, source=plan.source)  # labelled by the proposer the planner chose
            if proposal.confidence is not None and self.planner.cuts:
                # One extra host sync, for drafters that estimate their own acceptance (a DSpark confidence head).
                width = self.planner.cut(proposal.confidence.tolist(), proposal.width)
                proposal = proposal.cut(width - 1)
        self.mark("draft", proposal.tokens)
        return proposal

    def block(self, proposal: Proposal) -> mx.array:
        """Ids [1, w] the target verifies: the last committed token (slot 0), then the drafts."""
        head = mx.array([[self.state.last_token]], dtype=mx.int32)
        return mx.concatenate([head, proposal.tokens[None]], axis=1)

    def segment(self, proposal: Proposal) -> Segment:
        """The proposal as a segment of a target pass (`targets.walk`): a chain's block, written to the caches
        (rolled back in `finish`), or a tree's nodes, which are not (its accepted path is kept in `finish`)."""
        if isinstance(proposal, TreeProposal):
            return tree_segment(self.target, self.block(proposal), (-1,) + tuple(proposal.parents),
                                self.state.target_cache)
        return Chain(self.block(proposal), self.state.target_cache)

    def forward(self, proposal: Proposal):
        """The single stream's target pass over the proposal: (logits [1, w, V], hidden [1, w, n*H], a tree's
        write or None)."""
        segment = self.segment(proposal)
        with mx.stream(generation_stream):
            (logits,), (hidden,) = self.target.forward_segments([segment])
        return logits, hidden, getattr(segment, "write", None)

    def verify(self, proposal: Proposal, logits: mx.array, hidden: mx.array, write: Any = None) -> Launch:
        """The acceptor's verdict on the target's logits [w, V] for the block, packed for one host read: a chain's
        [acc, choice..., drafts...]; a tree's [acc, token after the path, path slots..., drafts...]."""
        with mx.stream(generation_stream):
            if isinstance(proposal, TreeProposal):
                acc, path, fix = self.acceptor.verify(proposal, logits)
                packed = mx.concatenate([acc.reshape(1).astype(mx.int32), fix.reshape(1).astype(mx.int32),
                                         path.astype(mx.int32), proposal.tokens.astype(mx.int32)])
            else:
                acc, choice = self.acceptor.verify(proposal, logits)
                packed = mx.concatenate([acc.reshape(1).astype(mx.int32), choice, proposal.tokens])
        self.mark("verify", packed, hidden)
        return Launch(proposal, packed, logits, hidden, write, self.budget if write is not None else None,
                      self.context, self.chain_width)

    def finish(self, launch: Launch, values: Sequence[int], seconds: float) -> Pass:
        """Commit the pass whose packed result was read as `values`; `seconds` is its cost."""
        width, recorded, chain, path = launch.width, launch.width, None, None
        if launch.write is not None:  # (a tree is never deeper than the room left: the planner's width)
            tokens, acc, slots = accepted_path(values, launch.proposal, self.stops)
            path = slots[1 : acc + 1]
            # The policy learns from the tree's first choices, as deep as its chain would have been; a tree that
            # stood in for plain decoding (chain width 1) shows them as deep as it grew.
            observed = launch.chain_width if (launch.chain_width or 0) > 1 else launch.width
            chain = first_choices(launch.proposal, path, observed)
            if launch.proposal.source == LOOKUP:  # lookup's pass as deep as the tree, for the source choice
                recorded = max(launch.proposal.depths) + 1
        else:
            tokens, acc = accepted_tokens(values, width, self.stops)
        self.planner.record(recorded, acc, seconds, launch.proposal.source, launch.budget, launch.context, chain,
                            path)
        self.mark("host")
        keep = len(tokens)
        if launch.write is not None:
            # The caches hold none of the tree: the rows of the root and the accepted nodes go in now.
            kept = slots[:keep]
            commit_path(self.target, self.state.target_cache, launch.write, kept)
            index = mx.array(kept, dtype=mx.int32)
            features, logits = launch.hidden[:, index], launch.logits[index]
        else:
            # The target cache holds the whole block; keep the committed prefix (the newest token is the next
            # block's slot 0, so it is not in the cache yet).
            self.target.rollback(self.state.target_cache, width - keep)
            features, logits = launch.hidden[:, :keep], launch.logits[:keep]
        self.mark("rollback", [c.state for c in self.state.target_cache])
        launch.kept, launch.previous_token = keep, self.state.last_token
        self._observe(tokens, features)  # lazy: computed only for a proposer that keeps it
        self.state.last_token = tokens[-1]
        self.emitted += keep
        self.passes += 1
        if self.clears_cache and self.passes % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        ended = self._ended(tokens)
        self.wants = ended is None
        return Pass(tokens, acc, width, logits=logits, source=launch.proposal.source, finish_reason=ended)

    def withdraw(self, launch: Launch) -> None:
        """Undo a launched pass before `finish`: the caches hold exactly the committed tokens again."""
        if launch.write is None:  # a tree pass wrote nothing to the caches
            self.target.rollback(self.state.target_cache, launch.width)
        self.proposers[launch.proposal.source].withdraw(self.state, launch.proposal)

    def take_back(self, launch: Launch) -> None:
        """Undo a finished pass whose tokens the caller never saw: its kept tokens are still the newest verify
        write, which the target can drop, and their features the newest waiting ones."""
        self.state.drop_context(launch.kept)
        self.target.rollback(self.state.target_cache, launch.kept)
        self.proposers[launch.proposal.source].withdraw(self.state, launch.proposal)
        for name, proposer in self.proposers.items():  # the others observed the pass: they forget it
            if name != launch.proposal.source:
                proposer.unobserve(self.state, launch.kept)
        self.state.last_token = launch.previous_token
