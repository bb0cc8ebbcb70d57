"""The decode core's protocols as callers see them: every acceptor verifies a tree through the `verify` it verifies
a chain with; a proposer's optional methods have defaults, for subclasses and for objects of the shape alike; one
rule says which runs must follow from their seed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from dflash_mlx.decode.acceptance import (GreedyAcceptor, MatchAcceptor, SamplingAcceptor, make_acceptor,
                                          reproducible)
from dflash_mlx.decode.proposal import Offer, Proposal, TreeProposal
from dflash_mlx.decode.proposers import Proposer, as_proposer
from dflash_mlx.decode.sampling import SamplingParams

V = 11


def _logits(choices):
    """Rows whose argmax is each of `choices`, [len, V]."""
    rows = np.full((len(choices), V), -4.0, dtype=np.float32)
    for i, c in enumerate(choices):
        rows[i, c] = 4.0
    return mx.array(rows)


@pytest.mark.parametrize("acceptor", [GreedyAcceptor(), MatchAcceptor(make_sampler(temp=0.0)),
                                      SamplingAcceptor(SamplingParams(temp=0.0), [lambda tokens, x: x], seed=0)],
                         ids=["greedy", "match", "sampling-at-temp-0"])
def test_a_chain_as_a_tree_verifies_as_the_chain(acceptor):
    target = [3, 7, 2, 9, 5]  # the target's choice after slot i
    for drafts in ([3, 7, 2, 9], [3, 7, 4, 9], [1, 7, 2, 9], []):
        logits = _logits(target[: len(drafts) + 1])
        acc, choice = acceptor.verify(Proposal(mx.array(drafts, dtype=mx.int32)), logits)
        chain = TreeProposal(mx.array(drafts, dtype=mx.int32), parents=tuple(range(len(drafts))))
        tree_acc, path, fix = acceptor.verify(chain, logits)
        a = int(acc.item())
        assert int(tree_acc.item()) == a and int(fix.item()) == int(choice[a].item()), drafts
        assert path.tolist()[:a] == list(range(1, a + 1)) and all(s == 0 for s in path.tolist()[a:])


def test_a_tree_keeps_the_sibling_the_target_chose():
    """Slot 1 and slot 2 are siblings under the root; the target chose the second: the path goes through it."""
    tree = TreeProposal(mx.array([4, 3, 7], dtype=mx.int32), parents=(0, 0, 2))
    logits = _logits([3, 0, 7, 8])  # after root: 3 (slot 2); after slot 2: 7 (slot 3); after slot 3: 8
    for acceptor in (GreedyAcceptor(), MatchAcceptor(make_sampler(temp=0.0))):
        acc, path, fix = acceptor.verify(tree, logits)
        assert (int(acc.item()), path.tolist(), int(fix.item())) == (2, [2, 3], 8)


class _Chains(Proposer):
    name, widest = "chains", 4

    def offer(self, state, widest):
        return Offer(self.name, min(widest, self.widest))

    def propose(self, state, acceptor, width, offer):
        return acceptor.propose_tokens(mx.zeros((width - 1,), dtype=mx.int32))

    def observe(self, state, tokens, features):
        pass

    def withdraw(self, state, proposal):
        pass


class _Shaped:
    """The shape without the base class, with an `unobserve` of its own and no `propose_tree`."""

    name, widest = "shaped", 3

    def __init__(self):
        self.forgot = []

    def offer(self, state, widest):
        return Offer(self.name, widest)

    def propose(self, state, acceptor, width, offer):
        return Proposal.empty()

    def observe(self, state, tokens, features):
        pass

    def withdraw(self, state, proposal):
        pass

    def unobserve(self, state, tokens):
        self.forgot.append(tokens)


def test_a_proposers_optional_methods_have_defaults():
    chains = _Chains()
    assert as_proposer(chains) is chains
    assert chains.propose_tree(None, GreedyAcceptor(), 4, 8, None) is None  # chains only
    chains.unobserve(None, 3)  # nothing to forget
    shaped = _Shaped()
    adopted = as_proposer(shaped)
    assert isinstance(adopted, Proposer) and (adopted.name, adopted.widest) == ("shaped", 3)
    assert adopted.propose_tree(None, GreedyAcceptor(), 3, 8, None) is None
    adopted.unobserve(None, 2)
    assert shaped.forgot == [2]
    assert adopted.offer(None, 5) == Offer("shaped", 5)


def test_one_rule_for_reproducible_runs():
    assert reproducible(SamplingAcceptor(SamplingParams(temp=0.8), seed=3))
    assert not reproducible(SamplingAcceptor(SamplingParams(temp=0.8)))
    assert not reproducible(GreedyAcceptor()) and not reproducible(make_acceptor(seed=5))  # greedy: no draws
    assert reproducible(make_acceptor(temp=0.7, seed=5)) and not reproducible(make_acceptor(temp=0.7))
    assert reproducible(make_acceptor(sampler=make_sampler(temp=0.5), seed=2))
    assert not reproducible(make_acceptor(sampler=make_sampler(temp=0.5)))
