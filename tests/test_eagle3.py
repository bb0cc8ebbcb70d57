"""EAGLE-3 drafters (dflash_mlx/drafters/eagle3.py, dflash_mlx/decode/proposers/eagle3.py).

Tiny fp32 targets built in code (dense, sliding-window, and the Qwen3.5 GatedDeltaNet hybrid and its MoE form of
benchmarks/mtp_reference.py) with steered EAGLE-3 drafters (benchmarks/eagle3_reference.py: they predict often,
not always). Checked: greedy output equals plain decoding for chains and trees at several depths and budgets, with
the full and a reduced draft vocabulary; sampled output follows the target's exact distribution (chains and trees);
the tokens and drafts accepted per pass equal the reference implementation's (mlx-vlm, tests/fixtures/eagle3/);
both published layouts and our converted one load to identical weights; unstated taps take the published default;
a mismatched target is one line; withdrawn and taken-back passes leave the draft state as it was.
"""

from __future__ import annotations

import functools
import json
import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

import tiny
from benchmarks.eagle3_reference import (DRAFTS, FIXTURES, MAX_TOKENS, VOCABS, build_drafter, qwen35_pair,
                                         save_specforge, save_speculators)
from benchmarks.mtp_reference import PROMPT, build as build_qwen35
from dflash_mlx.decode.acceptance import GreedyAcceptor, SamplingAcceptor
from dflash_mlx.decode.generation import Generation
from dflash_mlx.decode.planner import build_planner
from dflash_mlx.decode.proposers.eagle3 import Eagle3Proposer
from dflash_mlx.decode.sampling import SamplingParams
from dflash_mlx.decode.state import DecodeState
from dflash_mlx.decode.step import Decoder, drafting_proposer, proposers_for
from dflash_mlx.drafters.dflash import TargetBinding
from dflash_mlx.drafters.families import describe
from dflash_mlx.drafters.io import load_drafter, save_drafter
from dflash_mlx.errors import DFlashError
from dflash_mlx.models.loading import prepare
from dflash_mlx.targets import build_target
from dflash_mlx.targets.tree import tree_support

KINDS = ("llama", "qwen3", "qwen2", "llama_swa", "qwen3_5", "qwen3_5_moe")


def bind(model, drafter):
    target = build_target(model, drafter.config.target_layer_ids)
    drafter.bind(TargetBinding(target.embed, functools.partial(target.head, softcap=False), None, source=target))
    return target


@functools.lru_cache(maxsize=None)
def pair(kind: str, draft_vocab=None):
    """(model, drafter, target, prompt) for a tiny target family."""
    if kind.startswith("qwen3_5"):
        model, prompt = build_qwen35(kind)[1], PROMPT
    else:
        model, prompt = tiny.target(kind), tiny.prompt_ids(12)
    n = len(getattr(model, "language_model", model).layers)
    drafter = build_drafter(model, [0, n // 2, n - 1], draft_vocab=draft_vocab, prompts=[prompt],
                            follow_hot=bool(draft_vocab), block_size=6)
    return model, drafter, bind(model, drafter), prompt


def plain(model, prompt, n):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                             sampler=lambda x: mx.argmax(x, axis=-1))]


def decode(target, drafter, prompt, max_tokens=MAX_TOKENS, **kw):
    passes = list(Generation(target, drafter, prompt, max_tokens=max_tokens, lookup=False, **kw))
    return [t for p in passes for t in p.tokens], passes[1:]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_chains_and_trees_equal_plain_decoding(kind):
    model, drafter, target, prompt = pair(kind)
    expected = plain(model, prompt, MAX_TOKENS)
    for k in (1, 2, 4):
        tokens, passes = decode(target, drafter, prompt, width=k + 1)
        assert tokens == expected, (kind, k)
        drafted = [p for p in passes if p.width > 1]
        assert drafted and all(p.source == "eagle3" for p in drafted)
        assert any(p.accepted > 0 for p in drafted) and any(p.accepted < p.width - 1 for p in drafted), (kind, k)
    trees = tree_support(target, target.make_cache()) is None
    for depth, budget in ((2, 3), (4, 6), (5, 16)):
        tokens, passes = decode(target, drafter, prompt, width=depth + 1, tree_budget=budget)
        assert tokens == expected, (kind, depth, budget)
        if trees and budget > depth:  # a tree holds more nodes than its depth: branches were verified
            assert any(p.width > depth + 1 for p in passes), (kind, depth, budget)
            assert max(p.accepted for p in passes) <= depth
    # A prefill in chunks runs each chunk's known pairs as it goes.
    assert decode(target, drafter, prompt, width=3, prefill_step_size=4)[0] == expected


@pytest.mark.parametrize("kind", ("llama", "qwen3_5"))
def test_a_reduced_draft_vocabulary_stays_lossless_where_the_target_leaves_it(kind):
    """The head drafts only its d2t ids, and is steered to the target's likeliest token among them: wherever the
    target's own choice lies outside them, that draft must be rejected (a verify restricted to the draft
    vocabulary would accept it)."""
    model, drafter, target, prompt = pair(kind, draft_vocab=8)
    expected = plain(model, prompt, MAX_TOKENS)
    hot = set((np.arange(8) + np.array(drafter.d2t)).tolist())
    assert any(t not in hot for t in expected)  # the case the check is for does occur
    for kw in (dict(width=4), dict(width=4, tree_budget=8)):
        tokens, passes = decode(target, drafter, prompt, **kw)
        assert tokens == expected and any(p.accepted for p in passes), kw
        assert all(t in hot for p in passes for t in p.tokens[: p.accepted])


@pytest.mark.parametrize("name", sorted(VOCABS))
def test_tokens_and_acceptance_per_pass_equal_the_reference(tmp_path, name):
    fixture = json.loads((FIXTURES / f"qwen3_5_{name}.json").read_text())
    folder, model, drafter = qwen35_pair(tmp_path, VOCABS[name])
    loaded = load_drafter(save_speculators(drafter, model, tmp_path / "drafter"))
    target = prepare(model, loaded)
    assert fixture["prompt"] == PROMPT and fixture["plain"] == plain(model, PROMPT, MAX_TOKENS)
    assert sorted(fixture["runs"]) == sorted(str(k) for k in DRAFTS)
    for k, run in fixture["runs"].items():
        tokens, passes = decode(target, loaded, PROMPT, width=int(k) + 1)
        assert tokens == run["tokens"], (name, k)
        assert [p.accepted for p in passes] == run["accepted"], (name, k)


def test_both_layouts_and_ours_load_identical_weights(tmp_path):
    model, drafter, _, _ = pair("llama", draft_vocab=8)
    spec = load_drafter(save_speculators(drafter, model, tmp_path / "speculators"))
    forge = load_drafter(save_specforge(drafter, model, tmp_path / "specforge"))
    llama = load_drafter(save_specforge(drafter, model, tmp_path / "llama", architecture="LlamaForCausalLM"))
    ours = load_drafter(save_drafter(spec, tmp_path / "ours"))
    reference = dict(tree_flatten(drafter.parameters()))
    for loaded in (spec, forge, llama, ours):
        weights = dict(tree_flatten(loaded.parameters()))
        assert sorted(weights) == sorted(reference)  # the embedding copy and t2d are not kept
        for key, value in reference.items():
            assert weights[key].dtype == value.dtype and mx.array_equal(weights[key], value).item(), key
        assert loaded.config.target_layer_ids == drafter.config.target_layer_ids
        assert loaded.config.draft_vocab_size == 8 and describe(loaded).startswith("EAGLE-3 drafter")
    assert (spec.config.layout, forge.config.layout) == ("speculators", "specforge")
    assert spec.config.block_size == 4  # speculative_tokens 3 -> passes of up to 4 tokens
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "eagle3"


def test_unstated_taps_take_the_published_default_and_say_so(tmp_path, caplog):
    model = tiny.build_target("llama", num_hidden_layers=12)
    drafter = build_drafter(model, [0, 1, 2])
    loaded = load_drafter(save_specforge(drafter, model, tmp_path / "d", state_taps=False))
    assert loaded.config.target_layer_ids is None
    with caplog.at_level(logging.WARNING, logger="dflash_mlx"):
        target = prepare(model, loaded)
    # vLLM and SGLang capture the inputs of layers 2, N // 2 and N - 3: the outputs of 1, 5 and 8 for N = 12.
    assert loaded.config.target_layer_ids == [1, 5, 8] and target.tap_layer_ids == [1, 5, 8]
    assert "names no tapped target layers" in caplog.text and "[1, 5, 8]" in caplog.text
    # Converted, the default stays unstated (it belongs to the target, not to the checkpoint).
    assert "target_layer_ids" not in save_drafter(loaded, tmp_path / "ours").joinpath("config.json").read_text()


@pytest.mark.parametrize("change, words", [
    (dict(hidden_size=48), "hidden size 64 does not match the target's 48"),
    (dict(vocab_size=91), "vocabulary (97) does not match the target's (91)"),
    (dict(num_hidden_layers=2), "taps target layers [0, 2, 3] but the target has 2 layers"),
])
def test_a_mismatched_target_is_one_line(change, words):
    _, drafter, _, _ = pair("llama")
    other = tiny.build_target("llama", **change)
    with pytest.raises(DFlashError) as e:
        prepare(other, drafter)
    assert words in str(e.value) and "\n" not in str(e.value)
    bind(tiny.target("llama"), drafter)  # (the shared drafter stays bound to its own target)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampled_output_follows_the_target_distribution(mode):
    from test_sampling import chi2_pvalue, exact_target_joint, joint_counts

    V = 8
    model = tiny.build_target("qwen3", seed=3, vocab_size=V)
    prompt = [1, 5, 2, 7]
    drafter = build_drafter(model, [0, 1, 3], prompts=[prompt, [3, 3]])
    target = bind(model, drafter)
    params = SamplingParams(temp=0.8)  # peaked enough that 300 samples fill a dozen cells of the 3-token joint
    tree = dict(tree_budget=4) if mode == "tree" else {}
    seqs, accepted = [], 0
    for seed in range(300):
        passes = list(Generation(target, drafter, prompt, max_tokens=4, width=3, lookup=False,
                                 acceptor=SamplingAcceptor(params, seed=seed), **tree))
        seqs.append([t for p in passes for t in p.tokens][:3])
        accepted += sum(p.accepted for p in passes)
    assert chi2_pvalue(joint_counts(np.array(seqs), V), exact_target_joint(model, prompt, params)) > 1e-3
    assert accepted > 40  # drafts are accepted often: the test exercises acceptance, not only rejection


def _state(cache):
    kv = [(c.offset, np.array(c.keys[..., : c.offset, :]) if c.offset else None) for c in cache[:-1]]
    q = cache[-1]
    return kv, (None if q.hidden is None else np.array(q.hidden)), list(q.tokens), q.skip, \
        (None if q.seed is None else np.array(q.seed))


def _same(a, b):
    assert [x[0] for x in a[0]] == [x[0] for x in b[0]]
    for (_, x), (_, y) in zip(a[0], b[0]):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a[1:], b[1:]):
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("budget", [None, 6])
def test_withdraw_and_take_back_leave_the_draft_state_as_it_was(budget):
    model, drafter, target, prompt = pair("qwen3")
    expected = plain(model, prompt, 30)
    proposer = drafting_proposer(drafter)
    assert isinstance(proposer, Eagle3Proposer) and proposer.widest == drafter.block_size
    state = DecodeState.fresh(target, drafter)
    planner = build_planner(drafting=proposer, width=4, tree_budget=budget)
    dec = Decoder(target, drafter, proposers_for(proposer, None), planner, GreedyAcceptor(), state, max_tokens=30)
    tokens = dec.start(mx.array(prompt)).tokens

    def launch():
        proposal = dec.propose()
        logits, hidden, write = dec.forward(proposal)
        return dec.verify(proposal, logits[0], hidden, write)

    i = 0
    while dec.wants:
        before = _state(state.draft_cache)
        dec.withdraw(launch())  # abandoned before it commits
        _same(_state(state.draft_cache), before)
        if i % 2 == 1 and dec.limit - dec.emitted > 1:  # finished, then taken back unseen
            done = launch()
            dec.finish(done, done.packed.tolist(), 0.0)
            dec.take_back(done)
            _same(_state(state.draft_cache), before)
        done = launch()
        tokens += dec.finish(done, done.packed.tolist(), 0.0).tokens
        i += 1
    assert tokens == expected[: len(tokens)] and len(tokens) > 15 and i > 5


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory):
    """A tiny target folder with a tokenizer (the demo's) and a steered EAGLE-3 drafter for it in both layouts."""
    from mlx_lm.utils import load as mlx_lm_load

    from dflash_mlx.demo import make_tiny_pair

    root = tmp_path_factory.mktemp("eagle3")
    target_dir, _ = make_tiny_pair(root / "pair")
    model, tokenizer = mlx_lm_load(str(target_dir))
    n = len(model.layers)
    prompt = tokenizer.encode("def add(a, b):")
    drafter = build_drafter(model, [0, n // 2, n - 1], prompts=[prompt])
    return (target_dir, save_speculators(drafter, model, root / "speculators"),
            save_specforge(drafter, model, root / "specforge"), prompt, plain(model, prompt, 24))


@pytest.mark.parametrize("layout", [1, 2])
def test_load_recognises_either_layout_and_stream_generate_equals_plain(on_disk, layout):
    from dflash_mlx import load, stream_generate

    target_dir, prompt, want = on_disk[0], on_disk[3], on_disk[4]
    model, tokenizer, drafter = load(str(target_dir), drafter=str(on_disk[layout]))
    assert drafter.drafts_with == "eagle3"
    for kw in (dict(width=None), dict(width=3), dict(width=4, tree_budget=6)):
        got = [r.token for r in stream_generate(model, tokenizer, prompt, drafter, max_tokens=24, lookup=False,
                                                **kw)]
        assert got == want, kw


def test_cli_generate_and_convert_with_an_eagle3_draft(on_disk, tmp_path, capsys):
    from dflash_mlx import load, stream_generate
    from dflash_mlx.cli import main

    target_dir, spec = on_disk[0], on_disk[1]
    args = ["generate", "--model", str(target_dir), "-p", "hello", "--max-tokens", "16", "--ignore-chat-template"]
    assert main(args + ["--draft", str(spec), "--width", "1"]) == 0
    alone = capsys.readouterr().out
    assert main(args + ["--draft", str(spec), "--width", "3"]) == 0
    assert capsys.readouterr().out == alone
    for bits in (8, 4):  # our own layout, quantized: still lossless
        out = tmp_path / f"q{bits}"
        assert main(["convert", str(spec), str(out), "-q", "--q-bits", str(bits), "--q-group-size", "32"]) == 0
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "eagle3" and config["quantization"]["bits"] == bits
        model, tokenizer, drafter = load(str(target_dir), drafter=str(out))
        got = [r.token for r in stream_generate(model, tokenizer, on_disk[3], drafter, max_tokens=24, width=3,
                                                lookup=False)]
        assert got == on_disk[4], bits


def test_lookup_adaptive_widths_a_batch_and_a_second_turn_stay_lossless():
    """EAGLE-3 beside prompt lookup and plain passes (adaptive widths and trees), in a shared batch, and continuing
    a conversation's state into a second turn: the output is still the target's greedy output."""
    from dflash_mlx.decode.batching import Batch, BatchedGeneration

    model, drafter, target, prompt = pair("qwen3_5_moe")
    expected = plain(model, prompt, MAX_TOKENS)
    echo = prompt + expected[:12] + prompt  # repeats itself, so lookup finds copies
    passes = list(Generation(target, drafter, echo, max_tokens=MAX_TOKENS, lookup=True))
    assert [t for p in passes for t in p.tokens] == plain(model, echo, MAX_TOKENS)
    assert {"eagle3"} <= {p.source for p in passes[1:]}

    batch = Batch(target, drafter)
    prompts = [prompt, prompt[3:]]
    gens = [iter(BatchedGeneration(batch, p, max_tokens=20, width=3, lookup=False)) for p in prompts]
    out, live = [[], []], {0, 1}
    while live:
        for i in sorted(live):
            try:
                out[i] += next(gens[i]).tokens
            except StopIteration:
                live.discard(i)
    assert out == [plain(model, p, 20) for p in prompts] and max(batch.sizes) == 2

    state = DecodeState.fresh(target, drafter)
    first = [t for p in Generation(target, drafter, prompt, max_tokens=10, width=3, state=state, lookup=False)
             for t in p.tokens]
    follow = [5, 17, 29]
    second = [t for p in Generation(target, drafter, follow, max_tokens=15, width=4, state=state, lookup=False,
                                    tree_budget=5) for t in p.tokens]
    assert second == plain(model, prompt + first + follow, 15)


def test_tree_candidates_are_each_rows_top_k_with_ties_by_lower_id():
    from dflash_mlx.decode.proposers.eagle3 import _top

    rng = np.random.default_rng(0)
    for _ in range(100):
        V = int(rng.integers(2, 40))
        k = int(rng.integers(1, V + 1))
        logq = rng.integers(0, 6, size=(3, V)).astype(np.float32)  # many ties
        ids, lps = _top(logq, k)
        expected = np.argsort(-logq, axis=-1, kind="stable")[:, :k]
        assert (ids == expected).all() and (lps == np.take_along_axis(logq, expected, axis=-1)).all()


def test_server_replies_as_plain_decoding_and_bench_runs_it(on_disk):
    import openai

    from dflash_mlx import load
    from dflash_mlx.bench import BenchConfig, format_table, run_bench
    from dflash_mlx.server import ServerSettings, create_app, start_in_thread

    target_dir, spec = on_disk[0], on_disk[1]
    model, tokenizer, drafter = load(str(target_dir), drafter=str(spec))
    messages = [{"role": "user", "content": "hi"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = tokenizer.decode(plain(model, ids, 12))
    running = start_in_thread(create_app(model, tokenizer, drafter, ServerSettings(model_name="m")))
    try:
        client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=300)
        for _ in range(2):  # the second time from the prefix cache
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
            assert want.startswith(reply.choices[0].message.content)
    finally:
        running.stop()
    report = run_bench(BenchConfig(model=str(target_dir), draft=str(spec), num_prompts=1, max_tokens=12,
                                   profile=False, verify_prompts=0, warmup=False, progress=False, lookup=False,
                                   chat_template=False, tree_budgets=[4]))
    rows = [line.split() for line in format_table(report).splitlines()
            if line.startswith(("mlx-lm", "eagle3 ")) and ":" not in line]
    assert {" ".join(r[:-10]) for r in rows} == {"mlx-lm", "eagle3 adaptive", "eagle3 adaptive tree=4", "eagle3 B=4"}
    assert all(r[-1] == "1/1" for r in rows)  # every method's output equals plain decoding's
