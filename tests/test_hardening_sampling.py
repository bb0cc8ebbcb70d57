"""Sampling checks that do not lean on the code they test.

- From the command line, top-k, top-p and min-p run for real (no recording of `make_acceptor`): at a hot
  temperature each filter, set to keep only the most likely token, must reproduce mlx-lm's greedy text exactly,
  while the same temperature without a filter must not (the negative control).
- End to end through `dflash_generate_step`, with a confident drafter (one-hot proposals of the greedy path, so
  about half the drafts are rejected and the residual distribution decides the output): the joint of the first
  three tokens matches the exact target distribution, and the same sample count rejects an acceptor with the
  classic wrong residual, so the test has the power to see that bug.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import tiny
from dflash_mlx.decode.acceptance import SamplingAcceptor
from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.drafters.oracle import OracleDrafter
from test_sampling import ALPHA, E2E_BLOCK, E2E_VOCAB, FILTERS, PROMPT, chi2_pvalue, exact_target_joint, joint_counts

PROMPT_TEXT = "Tell me something"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cli_pair(tmp_path_factory):
    from mlx_lm.utils import load as mlx_lm_load

    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("pair"))
    model, tokenizer = mlx_lm_load(str(target))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT_TEXT}], add_generation_prompt=True)
    greedy = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=MAX_TOKENS)]
    eos = set(tokenizer.eos_token_ids)
    greedy = greedy[: next((i for i, t in enumerate(greedy) if t in eos), len(greedy))]
    return target, drafter, tokenizer.decode(greedy)


def _cli_text(capsys, pair, *flags):
    target, drafter, _ = pair
    capsys.readouterr()
    code = main(["generate", "-m", str(target), "-d", str(drafter), "-p", PROMPT_TEXT, "--max-tokens",
                 str(MAX_TOKENS), "--temp", "5", "--seed", "7", "--width", "2", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.strip()


@pytest.mark.parametrize("flags", [("--top-k", "1"), ("--top-p", "0.001"), ("--min-p", "1.0")],
                         ids=["top-k", "top-p", "min-p"])
def test_cli_filter_keeping_one_token_is_greedy(cli_pair, capsys, flags):
    assert _cli_text(capsys, cli_pair, *flags) == cli_pair[2].strip()


def test_cli_hot_sampling_without_a_filter_is_not_greedy(cli_pair, capsys):
    # The negative control: the filters above are what made those runs greedy.
    assert _cli_text(capsys, cli_pair) != cli_pair[2].strip()
    assert _cli_text(capsys, cli_pair, "--top-k", "2") != cli_pair[2].strip()


class _WrongResidual(SamplingAcceptor):
    """The classic bug: on rejection, resample from p instead of the residual max(p - q, 0)."""

    @staticmethod
    def _fix_distribution(logp_row, logq_row):
        return logp_row


SAMPLES = 250


@pytest.fixture(scope="module")
def confident():
    model = tiny.build_target("llama", seed=3, num_hidden_layers=1, vocab_size=E2E_VOCAB)
    target = tiny.TargetModel(model, [0])
    oracle = OracleDrafter(PROMPT + tiny.greedy(model, PROMPT, 8), E2E_VOCAB, E2E_BLOCK, E2E_VOCAB - 1)
    return model, target, oracle


def _first_three(confident, acceptor_class, params):
    _, target, oracle = confident
    seqs, accepted = [], 0
    for seed in range(SAMPLES):
        tokens, cycles = tiny.run_dflash(PROMPT, target, oracle, max_tokens=3,
                                         acceptor=acceptor_class(params, seed=seed))
        seqs.append(tokens[:3])
        accepted += sum(c.accepted for c in cycles)
    return np.array(seqs), accepted / SAMPLES


def test_confident_drafter_sampling_matches_the_target_and_a_wrong_residual_does_not(confident):
    params = FILTERS["topk_topp"]
    exact = exact_target_joint(confident[0], PROMPT, params)
    seqs, accepted = _first_three(confident, SamplingAcceptor, params)
    assert 0.2 < accepted < 0.9  # drafts are accepted and rejected: both branches decide tokens
    assert chi2_pvalue(joint_counts(seqs, E2E_VOCAB), exact) > ALPHA
    wrong, _ = _first_three(confident, _WrongResidual, params)
    assert chi2_pvalue(joint_counts(wrong, E2E_VOCAB), exact) < 1e-6
