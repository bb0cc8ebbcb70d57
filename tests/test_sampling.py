"""Sampling is lossless: DFlash's sampled tokens follow exactly the distribution of sampling the target alone.

The reference distribution is mlx-lm's sampler (`make_sampler`: top-p, min-p, top-k on the log-probs, then the
temperature), re-implemented in numpy and checked against mlx-lm's own samples. Equality of distributions is a
chi-square goodness-of-fit test against the *exact* joint of the first three tokens (enumerated), at ALPHA with
fixed seeds, so every run gives the same verdict:
- the acceptors alone, vectorized over many blocks on synthetic target/draft logits (cheap, high power), with a
  negative control that must fail;
- end to end through `dflash_generate_step` on a tiny model with an 8-token vocabulary.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from scipy import stats

import tiny
from test_lookup import ScriptedChoice
from test_width import Scheduled
from dflash_mlx.decode.proposal import Proposal
from dflash_mlx.decode.acceptance import GreedyAcceptor, MatchAcceptor, SamplingAcceptor, make_acceptor
from dflash_mlx.errors import DFlashError
from dflash_mlx.decode.lookup import LookupIndex
from dflash_mlx.decode.sources import LOOKUP
from dflash_mlx.drafters.oracle import OracleDrafter
from dflash_mlx.decode.sampling import SamplingParams, log_distribution

ALPHA = 1e-3

FILTERS = {
    "plain": SamplingParams(temp=1.0),
    "topk_topp": SamplingParams(temp=0.8, top_k=3, top_p=0.9),
    "minp_hot": SamplingParams(temp=1.5, min_p=0.1),
}


# -- reference: mlx-lm's sampling distribution, independently in numpy ----------------------------------------------
def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities [..., V] that mlx-lm's `make_sampler(temp, top_p, min_p, top_k)` draws from."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    keep = np.ones(lp.shape, dtype=bool)
    order = np.argsort(-lp, axis=-1)  # most likely first
    rank = np.argsort(order, axis=-1)
    if 0 < params.top_p < 1:
        p_sorted = np.exp(np.take_along_axis(lp, order, -1))
        mass_before = np.cumsum(p_sorted, -1) - p_sorted  # mass of strictly more likely tokens
        keep &= np.take_along_axis(mass_before < params.top_p, rank, -1)
    if params.min_p > 0:
        keep &= lp >= lp.max(-1, keepdims=True) + np.log(params.min_p)
    if 0 < params.top_k < lp.shape[-1]:
        keep &= rank < params.top_k
    scaled = np.where(keep, lp / params.temp, -np.inf)
    e = np.exp(scaled - scaled.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of observed counts to exact probabilities; cells expecting < 5 are pooled.
    Any count in a zero-probability cell is an outright failure (p-value 0)."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # fold a thin pooled bin into the smallest big one
        j = np.argmin(exp[:-1])
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    assert len(exp) >= 2, "too few samples for a chi-square test"
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(stats.chi2.sf(stat, len(exp) - 1))


def joint_counts(seqs: np.ndarray, vocab: int) -> np.ndarray:
    counts = np.zeros((vocab,) * seqs.shape[1])
    np.add.at(counts, tuple(seqs.T), 1)
    return counts


def test_reference_matches_mlx_lm_sampler():
    """The numpy reference is the distribution mlx-lm's own sampler draws from (filters before temperature)."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(8) * 1.5).astype(np.float32)
    n = 20000
    mx.random.seed(0)
    for params in FILTERS.values():
        sampler = make_sampler(params.temp, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)
        lp = mx.array(logits) - mx.logsumexp(mx.array(logits))
        draws = np.array(sampler(mx.broadcast_to(lp, (n, 8))))
        ref = reference_probs(logits, params)
        assert chi2_pvalue(np.bincount(draws, minlength=8), ref) > ALPHA, params
        ours = np.exp(np.array(log_distribution(mx.broadcast_to(mx.array(logits), (n, 8)), params)[0]))
        np.testing.assert_allclose(ours, ref, atol=1e-5)


# -- the acceptors alone: synthetic target and draft logits, vectorized over many blocks ---------------------------
V, B = 6, 3  # synthetic vocabulary; block = [committed, d0, d1]
N = 20000  # blocks per synthetic test (one shape for all: MLX compiles mlx-lm's filters once per shape)


class World:
    """A synthetic target: logits of the 1st, 2nd, 3rd token given the tokens before it, and a drafter's rows."""

    def __init__(self, seed: int, drafter: str):
        rng = np.random.default_rng(seed)
        self.t0 = rng.standard_normal(V) * 1.5
        self.t1 = rng.standard_normal((V, V)) * 1.5
        self.t2 = rng.standard_normal((V, V, V)) * 1.5
        if drafter == "oracle_exact":  # target ignores the drafts, drafter knows it: q == p row for row
            self.t1[:] = self.t1[0]
            self.t2[:] = self.t2[0, 0]
            self.q = np.stack([self.t0, self.t1[0]])
        elif drafter == "near_oracle":
            self.q = np.stack([self.t0, self.t1[np.argmax(self.t0)]]) + 0.3 * rng.standard_normal((2, V))
        else:
            self.q = rng.standard_normal((2, V)) * 1.5

    def target_rows(self, draft: np.ndarray) -> np.ndarray:
        """Target logits [N, B, V] of a verify pass over [committed, draft[:, 0], draft[:, 1]]."""
        n = draft.shape[0]
        return np.stack([np.broadcast_to(self.t0, (n, V)), self.t1[draft[:, 0]], self.t2[draft[:, 0], draft[:, 1]]],
                        axis=1)

    def exact_joint(self, params: SamplingParams) -> np.ndarray:
        p0, p1, p2 = (reference_probs(t, params) for t in (self.t0, self.t1, self.t2))
        return p0[:, None, None] * p1[:, :, None] * p2


def sample_first_three(world: World, acceptor, params: SamplingParams, n: int, seed: int, fixed=None):
    """One verify cycle per row, then plain target sampling completes each sequence to three tokens. `fixed`:
    drafts [n, 2] given in advance (copied from a context), proposed as point masses."""
    if fixed is not None:
        proposal = acceptor.propose_tokens(mx.array(fixed.astype(np.int32)))
    else:
        draft_logits = mx.array(np.broadcast_to(world.q, (n, 2, V)).astype(np.float32))
        proposal = acceptor.propose(draft_logits)
    d = np.array(proposal.tokens)
    acc, fix = acceptor.verify(proposal, mx.array(world.target_rows(d).astype(np.float32)))
    acc, fix = np.array(acc), np.array(fix)
    seq = np.where(np.arange(3) < acc[:, None], np.pad(d, ((0, 0), (0, 1))), fix)
    rng = np.random.default_rng(seed)
    p1, p2 = reference_probs(world.t1, params), reference_probs(world.t2, params)
    for col, rows in ((1, lambda s: p1[s[:, 0]]), (2, lambda s: p2[s[:, 0], s[:, 1]])):
        cdf = np.cumsum(rows(seq), axis=-1)
        drawn = np.minimum((cdf < rng.random((n, 1)) * cdf[:, -1:]).sum(-1), V - 1)
        seq[:, col] = np.where(acc < col, drawn, seq[:, col])
    return seq, acc


@pytest.mark.parametrize("drafter", ["random", "near_oracle"])
@pytest.mark.parametrize("filters", list(FILTERS))
def test_rejection_sampling_is_lossless(drafter, filters):
    params = FILTERS[filters]
    world = World(seed=10 * list(FILTERS).index(filters) + (drafter == "near_oracle"), drafter=drafter)
    seq, acc = sample_first_three(world, SamplingAcceptor(params, seed=1), params, n=N, seed=2)
    assert chi2_pvalue(joint_counts(seq, V), world.exact_joint(params)) > ALPHA
    if drafter == "near_oracle":
        assert acc.mean() > 1.0  # q close to p: most drafts survive


def test_exact_oracle_is_always_accepted():
    """q == p row for row: rejection is impossible, so misaligned rows (q_i judged against p_{i+1}) would show."""
    params = FILTERS["topk_topp"]
    world = World(seed=5, drafter="oracle_exact")
    seq, acc = sample_first_three(world, SamplingAcceptor(params, seed=3), params, n=N, seed=4)
    assert (acc == B - 1).all()
    assert chi2_pvalue(joint_counts(seq, V), world.exact_joint(params)) > ALPHA


def test_match_acceptor_with_mlx_lm_sampler_is_lossless():
    params = FILTERS["topk_topp"]
    world = World(seed=7, drafter="random")
    mx.random.seed(11)
    sampler = make_sampler(params.temp, top_p=params.top_p, top_k=params.top_k)
    seq, _ = sample_first_three(world, MatchAcceptor(sampler), params, n=N, seed=12)
    assert chi2_pvalue(joint_counts(seq, V), world.exact_joint(params)) > ALPHA


class _NaiveResidual(SamplingAcceptor):
    """A classic bug: on rejection, resample from p instead of the residual max(p - q, 0)."""

    @staticmethod
    def _fix_distribution(logp_row, logq_row):
        return logp_row


def test_negative_control_detects_a_wrong_residual():
    params = FILTERS["plain"]
    world = World(seed=9, drafter="random")
    seq, _ = sample_first_three(world, _NaiveResidual(params, seed=1), params, n=N, seed=2)
    assert chi2_pvalue(joint_counts(seq, V), world.exact_joint(params)) < 1e-6


def _fixed_drafts(world: World, n: int, seed: int) -> np.ndarray:
    """Copied drafts: half the rows the target's likeliest path (often right), half random tokens."""
    rng = np.random.default_rng(seed)
    likely = np.array([np.argmax(world.t0), np.argmax(world.t1[np.argmax(world.t0)])])
    return np.where(rng.random((n, 1)) < 0.5, likely, rng.integers(0, V, size=(n, 2)))


@pytest.mark.parametrize("filters", list(FILTERS))
def test_point_mass_drafts_are_lossless(filters):
    """Lookup drafts: q = one-hot, accepted with probability p(x), residual p without x."""
    params = FILTERS[filters]
    world = World(seed=20 + list(FILTERS).index(filters), drafter="random")
    seq, acc = sample_first_three(world, SamplingAcceptor(params, seed=5), params, n=N, seed=6,
                                  fixed=_fixed_drafts(world, N, 7))
    assert chi2_pvalue(joint_counts(seq, V), world.exact_joint(params)) > ALPHA
    assert acc.mean() > 0.3  # the likely path is often kept


class _UniformQ(SamplingAcceptor):
    """A wrong point-mass proposal: treating a copied draft as drawn from a uniform q."""

    def propose_tokens(self, draft):
        return Proposal(draft, mx.full(draft.shape + (V,), -np.log(V), dtype=mx.float32))


def test_negative_control_detects_a_wrong_point_mass():
    params = FILTERS["plain"]
    world = World(seed=21, drafter="random")
    seq, _ = sample_first_three(world, _UniformQ(params, seed=5), params, n=N, seed=6,
                                fixed=_fixed_drafts(world, N, 7))
    assert chi2_pvalue(joint_counts(seq, V), world.exact_joint(params)) < 1e-6


def test_seed_reproduces_and_varies():
    params = FILTERS["plain"]
    world = World(seed=3, drafter="random")
    a = sample_first_three(world, SamplingAcceptor(params, seed=42), params, n=N, seed=0)[0]
    b = sample_first_three(world, SamplingAcceptor(params, seed=42), params, n=N, seed=0)[0]
    c = sample_first_three(world, SamplingAcceptor(params, seed=43), params, n=N, seed=0)[0]
    assert (a == b).all() and (a != c).any()


# -- end to end: dflash_generate_step on a tiny 8-token model -------------------------------------------------------
E2E_VOCAB, E2E_BLOCK = 8, 3
PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def e2e():
    model = tiny.build_target("llama", seed=3, num_hidden_layers=1, vocab_size=E2E_VOCAB)
    drafter, target = tiny.make_drafter(model, block_size=E2E_BLOCK, vocab_size=E2E_VOCAB,
                                        mask_token_id=E2E_VOCAB - 1, num_hidden_layers=1, target_layer_ids=[0])
    return model, drafter, target


def exact_target_joint(model, prompt, params: SamplingParams, processors=()) -> np.ndarray:
    """P(x1, x2, x3) of plain target sampling: every 2-token continuation in one batched forward pass."""
    pairs = list(itertools.product(range(E2E_VOCAB), repeat=2))
    logits = model(mx.array([prompt + list(p) for p in pairs]))[:, -3:].astype(mx.float32)  # [V*V, 3, V]

    def probs(row: mx.array, history) -> np.ndarray:
        row = row[None]
        for processor in processors:
            row = processor(mx.array(history), row)
        return reference_probs(np.array(row[0]), params)

    V_ = E2E_VOCAB
    p0 = probs(logits[0, 0], prompt)
    p1 = np.stack([probs(logits[a * V_, 1], prompt + [a]) for a in range(V_)])
    p2 = np.stack([probs(logits[i, 2], prompt + list(pairs[i])) for i in range(V_ * V_)]).reshape(V_, V_, V_)
    return p0[:, None, None] * p1[:, :, None] * p2


class _Recording(SamplingAcceptor):
    """Keeps the committed tokens on the host for the near-oracle drafter below."""

    def __init__(self, *args, log, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    def observe(self, tokens):
        self.log.extend(int(t) for t in (tokens.tolist() if isinstance(tokens, mx.array) else tokens))
        super().observe(tokens)


class NearOracle(OracleDrafter):
    """Draft rows = the target's own logits along its greedy path after the committed tokens, plus fixed noise."""

    def __init__(self, model, log, block_size, mask_token_id, noise=0.3):
        super().__init__([], E2E_VOCAB, block_size, mask_token_id)
        self.model, self.log = model, log
        self.noise = noise * np.random.default_rng(0).standard_normal((block_size - 1, E2E_VOCAB))

    def __call__(self, block_ids, cache):
        path, rows = list(self.log), []
        for i in range(block_ids.shape[1] - 1):
            logits = self.model(mx.array([path]))[0, -1].astype(mx.float32)
            rows.append(logits + mx.array(self.noise[i].astype(np.float32)))
            path.append(int(mx.argmax(logits).item()))
        return mx.stack(rows)[None]


def _run_many(e2e, params, n, drafter_kind="random", processors=(), widths=None, **options):
    model, drafter, target = e2e
    seqs, accepted = [], 0
    for seed in range(n):
        log = []
        acceptor = _Recording(params, processors, seed=seed, log=log)
        d = NearOracle(model, log, E2E_BLOCK, E2E_VOCAB - 1) if drafter_kind == "near_oracle" else drafter
        width = None if widths is None else Scheduled(widths[seed % len(widths):] + widths[: seed % len(widths)])
        tokens, cycles = tiny.run_dflash(PROMPT, target, d, max_tokens=4, acceptor=acceptor, planner=width,
                                         **options)
        seqs.append(tokens[:3])
        accepted += sum(c.accepted for c in cycles)
    return np.array(seqs), accepted / n


@pytest.mark.parametrize("drafter_kind,filters", [("random", "topk_topp"), ("near_oracle", "plain")])
def test_dflash_sampling_matches_target_sampling(e2e, drafter_kind, filters):
    params = FILTERS[filters]
    seqs, accepted = _run_many(e2e, params, 400, drafter_kind)
    assert chi2_pvalue(joint_counts(seqs, E2E_VOCAB), exact_target_joint(e2e[0], PROMPT, params)) > ALPHA
    if drafter_kind == "near_oracle":
        assert accepted > 1.0


def test_sampling_with_a_width_changing_every_cycle(e2e):
    """Widths 3, 1, 2 in turn (rotated per run): every committed token still follows the target's distribution."""
    params = FILTERS["plain"]
    seqs, accepted = _run_many(e2e, params, 400, "near_oracle", widths=[3, 1, 2])
    assert chi2_pvalue(joint_counts(seqs, E2E_VOCAB), exact_target_joint(e2e[0], PROMPT, params)) > ALPHA
    assert accepted > 0.5


@pytest.mark.parametrize("budget,filters", [(4, "plain"), (6, "topk_topp")])
def test_sampling_with_draft_trees(e2e, budget, filters):
    """Every drafted block verified as a DDTree (several children per level): still the target's distribution."""
    params = FILTERS[filters]
    seqs, accepted = _run_many(e2e, params, 400, "near_oracle", tree_budget=budget)
    assert chi2_pvalue(joint_counts(seqs, E2E_VOCAB), exact_target_joint(e2e[0], PROMPT, params)) > ALPHA
    assert accepted > 0.5


def test_sampling_with_lookup_dflash_and_plain_passes_mixed(e2e):
    """Copied drafts (point masses) beside the drafter's and plain passes in one generation stay exact."""
    model, drafter, target = e2e
    params = FILTERS["topk_topp"]
    seqs, lookup_accepted = [], 0
    schedule = [(LOOKUP, 3), ("dflash", 3), (LOOKUP, 2), ("plain", 1)]
    for seed in range(400):
        acceptor = SamplingAcceptor(params, seed=seed)
        choice = ScriptedChoice(schedule[seed % 4:] + schedule[: seed % 4], lookup_width=3)
        tokens, cycles = tiny.run_dflash(PROMPT + [1, 2], target, drafter, max_tokens=4, acceptor=acceptor,
                                         lookup=LookupIndex(min_n=1), sources=choice)
        seqs.append(tokens[:3])
        lookup_accepted += sum(c.accepted for c in cycles if c.source == LOOKUP)
    exact = exact_target_joint(model, PROMPT + [1, 2], params)
    assert chi2_pvalue(joint_counts(np.array(seqs), E2E_VOCAB), exact) > ALPHA
    assert lookup_accepted > 20


def test_history_dependent_processors_are_lossless(e2e):
    """Repetition penalty: each verify row and each draft row sees the prompt plus the tokens before it."""
    params = SamplingParams(temp=0.7)
    processors = make_logits_processors(repetition_penalty=3.0, logit_bias={0: 1.0})
    seqs, _ = _run_many(e2e, params, 400, "random", processors)
    exact = exact_target_joint(e2e[0], PROMPT, params, processors)
    assert chi2_pvalue(joint_counts(seqs, E2E_VOCAB), exact) > ALPHA
    # The penalty matters here: ignoring it is a different distribution.
    assert chi2_pvalue(joint_counts(seqs, E2E_VOCAB), exact_target_joint(e2e[0], PROMPT, params)) < ALPHA


def test_temperature_zero_is_greedy(e2e):
    model, drafter, target = e2e
    prompt = tiny.prompt_ids(6, vocab=E2E_VOCAB)
    ref = tiny.greedy(model, prompt, 20)
    assert isinstance(make_acceptor(temp=0.0, seed=3), GreedyAcceptor)
    out, _ = tiny.run_dflash(prompt, target, drafter, max_tokens=20, acceptor=make_acceptor(temp=0.0))
    assert out == ref
    # Sampling machinery at temperature 0 (taken when processors are present) is greedy too, processors included.
    processors = make_logits_processors(repetition_penalty=1.5, repetition_context_size=4)
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=20,
                                            logits_processors=processors)]
    out, _ = tiny.run_dflash(prompt, target, drafter, max_tokens=20,
                             acceptor=make_acceptor(temp=0.0, top_k=2, repetition_penalty=1.5,
                                                    repetition_context_size=4))
    assert out == ref
    # So is match sampling with an argmax sampler object, processors included.
    argmax = make_acceptor(sampler=lambda logprobs: mx.argmax(logprobs, axis=-1), logits_processors=processors)
    assert isinstance(argmax, MatchAcceptor)
    assert tiny.run_dflash(prompt, target, drafter, max_tokens=20, acceptor=argmax)[0] == ref


def test_bad_options_are_refused():
    for kwargs in (dict(temp=-1.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2.0), dict(top_k=1.5),
                   dict(sampler=make_sampler(0.5), temp=0.7), dict(temp=1.0, repetition_penalty=0.0)):
        with pytest.raises(DFlashError):
            make_acceptor(**kwargs)


# -- the public API and the CLI -------------------------------------------------------------------------------------
# Real runs use plain temperature sampling: on the CPU backend every new (filter, shape) costs a kernel compile, and
# the filters themselves are covered above. The keyword plumbing is checked by recording `make_acceptor`'s arguments.
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from dflash_mlx import api
    from dflash_mlx.demo import make_tiny_pair

    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("pair"))
    return (target_dir, drafter_dir), api.load(str(target_dir), str(drafter_dir))


def _record_acceptors(monkeypatch):
    """Record make_acceptor's arguments; decode greedily (no filter kernels to compile)."""
    from dflash_mlx.decode import generation

    calls = []
    monkeypatch.setattr(generation, "make_acceptor", lambda *a, **k: calls.append((a, k)) or GreedyAcceptor())
    return calls


def test_api_sampling(pair, monkeypatch):
    from dflash_mlx import api

    _, (model, tokenizer, drafter) = pair
    ids = tokenizer.encode("Hello there")

    def tokens(**kwargs):
        return [r.token for r in api.stream_generate(model, tokenizer, ids, drafter, max_tokens=8, **kwargs)]

    greedy = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=8)]
    greedy = greedy[: next((i + 1 for i, t in enumerate(greedy) if t in set(tokenizer.eos_token_ids)), len(greedy))]
    assert tokens(temp=0.0) == greedy
    # An mlx-lm sampler object runs through match sampling; an argmax sampler must give greedy output.
    assert tokens(sampler=lambda logprobs: mx.argmax(logprobs, axis=-1)) == greedy
    a = tokens(temp=0.9, seed=7)
    assert a == tokens(temp=0.9, seed=7) and a != tokens(temp=0.9, seed=8)
    assert api.generate(model, tokenizer, ids, drafter, max_tokens=6, temp=0.9, seed=1) == \
        api.generate(model, tokenizer, ids, drafter, max_tokens=6, temp=0.9, seed=1)

    calls = _record_acceptors(monkeypatch)
    processor = lambda tokens, logits: logits  # noqa: E731
    tokens(temp=0.9, top_p=0.95, top_k=40, min_p=0.02, min_tokens_to_keep=2, seed=3, repetition_penalty=1.2,
           repetition_context_size=4, logits_processors=[processor])
    assert calls[-1] == ((), dict(temp=0.9, top_p=0.95, top_k=40, min_p=0.02, min_tokens_to_keep=2, seed=3,
                                  repetition_penalty=1.2, repetition_context_size=4, logits_processors=[processor]))


def test_cli_sampling_flags(pair, capsys, monkeypatch):
    from dflash_mlx.cli import main

    (target_dir, drafter_dir), _ = pair
    base = ["generate", "--model", str(target_dir), "--draft", str(drafter_dir), "--prompt", "Hello",
            "--max-tokens", "8"]
    outputs = []
    for _ in range(2):
        capsys.readouterr()
        assert main(base + ["--temp", "0.9", "--seed", "3"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]

    capsys.readouterr()
    assert main(base + ["--temp", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "temperature" in err and len(err.strip().splitlines()) == 1

    calls = _record_acceptors(monkeypatch)
    assert main(base + ["--temp", "0.7", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05", "--seed", "11"]) == 0
    assert {k: calls[-1][1][k] for k in ("temp", "top_p", "top_k", "min_p", "seed")} == \
        dict(temp=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=11)
