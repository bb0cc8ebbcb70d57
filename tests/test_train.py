"""The trainer on tiny in-code models: block mask, training forward == inference forward, loss weights, learning,
exact resume, reduced-vocabulary drafters, feature-cache resume, data rendering, and the command end to end."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.drafters.io import load_drafter, save_drafter
from dflash_mlx.decode.loop import dflash_generate_step
from dflash_mlx.errors import DFlashError
from dflash_mlx.train import block_hidden, block_loss, block_mask, default_gamma, sample_anchors, slot_weights
from dflash_mlx.train.masks import band_limits, sample_banded_anchors
from dflash_mlx.train.data import PreparedData, chat_document, pack, record_messages
from dflash_mlx.train.features import FeatureCache
from dflash_mlx.train.trainer import TrainConfig, Trainer
from dflash_mlx.train.vocab import head_rows, maps, select_vocab
from tiny import VOCAB, build_target, make_drafter, target

MASK = VOCAB - 1


# -- the block mask ---------------------------------------------------------------------------------------------
def test_block_mask_sees_context_before_anchor_and_own_block():
    anchors, S, B = mx.array([[2, 7], [1, 5]]), 10, 3
    m = np.array(block_mask(anchors, S, B))
    assert m.shape == (2, 1, 6, S + 6)
    for r in range(2):
        for a_i, a in enumerate(np.array(anchors[r])):
            for slot in range(B):
                row = m[r, 0, a_i * B + slot]
                assert row[:S].tolist() == [p < a for p in range(S)]
                own = [a_i * B <= j < (a_i + 1) * B for j in range(6)]
                assert row[S:].tolist() == own


def test_block_mask_sliding_and_causal():
    m = np.array(block_mask(mx.array([[6]]), 8, 3, sliding_window=3, block_causal=True))[0, 0]
    # The window runs over absolute positions: slot i (position 6+i) sees context above 6+i-3.
    assert m[:, :8].tolist() == [[p in (4, 5) for p in range(8)], [p == 5 for p in range(8)], [False] * 8]
    assert m[:, 8:].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_sample_anchors_respects_bounds_and_label_mask():
    rng = np.random.default_rng(0)
    trainable = np.zeros(40, dtype=np.uint8)
    trainable[20:30] = 1
    a = sample_anchors(rng, trainable, 5, 4)
    assert len(a) == 5 and all(19 <= x <= 28 for x in a) and list(a) == sorted(a)
    assert len(set(sample_anchors(rng, np.ones(40, np.uint8), 30, 4).tolist())) == 30  # distinct when possible
    assert len(sample_anchors(rng, np.ones(4, np.uint8), 3, 4)) == 0  # no block fits


def test_banded_anchors_keep_each_candidates_chance_and_their_band():
    rng = np.random.default_rng(0)
    S, B, A, bands = 64, 4, 8, 4
    limits = band_limits(S, bands)
    counts = np.zeros(S)
    for _ in range(4000):
        a = sample_banded_anchors(rng, np.ones(S, np.uint8), A, B, bands)
        assert len(a) == A and list(a) == sorted(a) and len(set(a.tolist())) == A
        for c in range(bands):
            assert (a[c * 2:(c + 1) * 2] <= limits[c]).all()
        np.add.at(counts, a, 1)
    # Every candidate (1..S-B) drawn with probability A / candidates per row, as by sample_anchors.
    share = counts[1:S - B + 1] / 4000
    assert np.abs(share - A / (S - B)).max() < 0.03 and counts[0] == 0 and counts[S - B + 1:].sum() == 0
    late = np.zeros(S, np.uint8)
    late[40:] = 1  # labels only late in the row: the first groups reach past their limits
    assert sample_banded_anchors(rng, late, A, B, bands) is None
    assert sample_banded_anchors(rng, np.ones(S, np.uint8), 6, B, bands) is None  # not divisible into 4 groups


def test_trainer_uses_bands_when_every_row_allows_them(tiny_cache):
    banded = _trainer(tiny_cache)
    assert banded.bands == 4 and banded.batch(0)["bands"] == 4
    plain = _trainer(tiny_cache, context_bands=1)
    assert plain.bands == 1 and plain.batch(0)["bands"] == 1
    # Same weights, same micro-batch: the loss with banded contexts equals the loss over whole contexts.
    batch = banded.batch(3)
    full = dict(batch, bands=1)
    assert banded.loss(batch)[0].item() == pytest.approx(banded.loss(full)[0].item(), rel=1e-5)
    late = np.asarray(tiny_cache.trainable).copy()
    late[:, : SEQ // 2] = 0  # labels in the second half only: no row can be banded
    tiny_cache.trainable = late
    assert _trainer(tiny_cache).batch(0)["bands"] == 1


# -- training forward == inference forward ---------------------------------------------------------------------------
def _features(t, tokens):
    _, hidden = t(mx.array(tokens)[None])
    return hidden


def _inference_logits(drafter, hidden, tokens, anchor):
    cache = drafter.make_cache()
    drafter.append_context(hidden[:, :anchor], cache)
    block = mx.array([[tokens[anchor]] + [MASK] * (drafter.block_size - 1)])
    return drafter(block, cache)[0]


@pytest.mark.parametrize("bands", [1, 3])
@pytest.mark.parametrize("variant", ["full", "sliding", "reduced_vocab"])
def test_training_forward_equals_inference_forward(variant, bands):
    extra = {}
    if variant == "sliding":
        extra = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    if variant == "reduced_vocab":
        extra = dict(draft_vocab_size=40)
    drafter, t = make_drafter(target("qwen3"), block_size=4, **extra)
    if variant == "reduced_vocab":
        ids = np.sort(np.random.default_rng(0).choice(VOCAB, 40, replace=False))
        drafter.d2t = mx.array(maps(ids, VOCAB)[0])
    tokens = [int(x) for x in np.random.default_rng(1).integers(0, VOCAB - 1, 30)]
    hidden = _features(t, tokens)
    anchors = [1, 10, 12, 20, 21, 26]  # in 3 bands of 2: at most 10, 20 and 30, two of them at the limit
    h = block_hidden(drafter, drafter.binding.embed, hidden, mx.array([tokens]), mx.array([anchors]), MASK, bands)
    train_logits = drafter.to_target_vocab(drafter.draft_logits(h))[0]  # [A, B-1, V]
    for i, a in enumerate(anchors):
        ref = _inference_logits(drafter, hidden, tokens, a)
        assert mx.abs(train_logits[i] - ref).max().item() < 1e-5, (variant, a)


# -- loss ------------------------------------------------------------------------------------------------------------
def test_slot_weights_follow_the_recipe():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    w = slot_weights(16)
    assert w.shape == (15,) and w[0] == 1.0
    np.testing.assert_allclose(w, np.exp(-np.arange(15) / 7), rtol=1e-6)
    np.testing.assert_allclose(slot_weights(8, gamma=2.0), np.exp(-np.arange(7) / 2), rtol=1e-6)


def test_block_loss_weights_slots_and_skips_unlabelled():
    V = 5
    logits = mx.zeros((1, 1, 3, V))
    logits[0, 0, 0, 2] = 5.0  # slot 1 confidently right, slots 2..3 uniform
    labels = mx.array([[[2, 1, -1]]])
    w = mx.array([1.0, 0.5, 0.25])
    loss, stats = block_loss(logits, labels, w)
    ce1 = float(mx.logsumexp(logits[0, 0, 0]) - 5.0)
    ce2 = float(np.log(V))
    assert loss.item() == pytest.approx((ce1 * 1.0 + ce2 * 0.5) / 1.5, rel=1e-6)
    assert stats["acc1"].item() == 1.0
    assert stats["tau"].item() == pytest.approx(2.0)  # slot 1 right, slot 2 wrong (argmax 0 != 1)
    # With the target's distribution mixed in: soft CE against a one-hot teacher on slot 1 only.
    t_ids = mx.array([[[[2, 3], [-1, -1], [-1, -1]]]])
    t_logp = mx.log(mx.array([[[[1.0, 1e-9], [1, 1], [1, 1]]]]))
    loss2, stats2 = block_loss(logits, labels, w, t_ids, t_logp, kl=0.5)
    assert stats2["soft"].item() == pytest.approx(ce1, rel=1e-4)
    assert loss2.item() == pytest.approx(0.5 * loss.item() + 0.5 * ce1, rel=1e-4)


# -- a feature cache of a tiny target --------------------------------------------------------------------------------
ROWS, SEQ = 12, 48


def _pattern_data(rows=ROWS, seq=SEQ, eval_prompts=2):
    """Learnable rows: each token is a fixed function of the previous one (x -> 7x + 3 mod 89)."""
    tokens = np.zeros((rows, seq), dtype=np.int64)
    tokens[:, 0] = np.random.default_rng(0).integers(0, 89, rows)
    for i in range(1, seq):
        tokens[:, i] = (7 * tokens[:, i - 1] + 3) % 89
    trainable = np.ones_like(tokens, dtype=np.uint8)
    prompts = [[int(x) for x in (3 + 2 * np.arange(12)) % 90], [int(x) for x in (5 + 5 * np.arange(12)) % 90]]
    return PreparedData(tokens.astype(np.int32), trainable, prompts[:eval_prompts], {"sources": ["pattern"]})


@pytest.fixture
def tiny_cache(tmp_path):
    drafter, t = make_drafter(target("qwen3"), block_size=4)
    cache = FeatureCache.create(tmp_path / "cache", _pattern_data(), feature_dim=2 * 64, topk=4,
                                fingerprint={"t": 1})
    cache.extract(t, progress=False)
    return cache


def _trainer(cache, seed=1, **overrides):
    drafter, _ = make_drafter(target("qwen3"), block_size=4, seed=seed)
    config = TrainConfig(**dict(dict(steps=40, lr=3e-3, anchors=8, rows_per_step=2, warmup=2), **overrides))
    return Trainer(drafter, cache, config)


def test_feature_cache_resumes_where_it_stopped(tmp_path, tiny_cache):
    _, t = make_drafter(target("qwen3"), block_size=4)
    cache = FeatureCache.create(tmp_path / "partial", _pattern_data(), feature_dim=128, topk=4,
                                fingerprint={"t": 1})
    assert cache.extract(t, progress=False, stop_after=5)["rows"] == 5
    reopened = FeatureCache.open(tmp_path / "partial", {"t": 1})
    assert reopened.rows_done == 5 and not reopened.complete
    assert reopened.extract(t, progress=False)["rows"] == ROWS - 5
    assert reopened.complete
    np.testing.assert_array_equal(np.asarray(reopened.features()), np.asarray(tiny_cache.features()))
    for mine, ref in zip(reopened.teacher(), tiny_cache.teacher()):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(ref))
    # Features are the target's own tapped outputs, stored in fp16.
    _, hidden = t(mx.array(np.asarray(tiny_cache.tokens[3]))[None])
    np.testing.assert_allclose(np.asarray(tiny_cache.features()[3], dtype=np.float32), np.array(hidden[0]),
                               rtol=2e-3, atol=2e-3)
    with pytest.raises(DFlashError, match="other settings"):
        FeatureCache.open(tmp_path / "partial", {"t": 2})


def test_a_few_steps_reduce_the_loss(tiny_cache):
    trainer = _trainer(tiny_cache, steps=80, lr=5e-3)
    fixed = trainer.batch(10_000)  # a batch the run never draws
    before = trainer.loss(fixed)[0].item()
    losses = [trainer.train_step()["loss"] for _ in range(80)]
    after = trainer.loss(fixed)[0].item()
    assert after < 0.85 * before, (before, after, losses[::10])
    assert trainer.predicted == 80 * 2 * 8 * 3


def test_kl_loss_trains(tiny_cache):
    trainer = _trainer(tiny_cache, kl=0.5, steps=5)
    m = [trainer.train_step() for _ in range(5)]
    assert all(np.isfinite(x["soft"]) for x in m)


def test_resume_reproduces_an_uninterrupted_run(tmp_path, tiny_cache):
    full = _trainer(tiny_cache, steps=6)
    for _ in range(6):
        full.train_step()
    first = _trainer(tiny_cache, steps=6)
    for _ in range(3):
        first.train_step()
    step_dir = first.save(tmp_path / "run")
    second = _trainer(tiny_cache, seed=99, steps=6)  # different init: everything must come from the checkpoint
    second.load(step_dir)
    assert second.step == 3
    for _ in range(3):
        second.train_step()
    for (k, a), (_, b) in zip(tree_flatten(full.drafter.parameters()), tree_flatten(second.drafter.parameters())):
        assert mx.array_equal(a, b).item(), k
    sa, sb = dict(tree_flatten(full.optimizer.state)), dict(tree_flatten(second.optimizer.state))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert mx.array_equal(sa[k], sb[k]).item(), k
    assert second.predicted == full.predicted


# -- reduced vocabulary ----------------------------------------------------------------------------------------------
def test_select_vocab_and_maps():
    tokens = np.array([[5, 5, 5, 9, 9, 3, 1, 1, 1, 1]])
    ids = select_vocab(tokens, np.ones_like(tokens), 3, 20, always=[17])
    assert ids.tolist() == [1, 5, 17]
    d2t, t2d = maps(ids, 20)
    assert (np.arange(3) + d2t).tolist() == [1, 5, 17]
    assert t2d[5] == 1 and t2d[9] == -1


def test_reduced_vocab_drafter_round_trips_and_drafts_target_ids(tmp_path, tiny_cache):
    drafter, t = make_drafter(target("qwen3"), block_size=4, draft_vocab_size=32)
    ids = select_vocab(np.asarray(tiny_cache.tokens), np.asarray(tiny_cache.trainable), 32, VOCAB)
    drafter.d2t = mx.array(maps(ids, VOCAB)[0])
    drafter.lm_head.weight = head_rows(t, ids)
    # The reduced head is the target head's rows: draft logits == target logits at those ids.
    h = mx.random.normal((1, 3, 64))
    np.testing.assert_allclose(np.array(drafter.draft_logits(h)), np.array(t.head(h)[..., mx.array(ids)]),
                               rtol=1e-5, atol=1e-5)
    trainer = Trainer(drafter, tiny_cache, TrainConfig(steps=3, anchors=8, lr=1e-3))
    assert trainer.t2d[ids].tolist() == list(range(32))
    # The reduced head is frozen: the step differentiates only the trained parameters (no head weight gradient).
    grads = trainer._micro(trainer.batch(0), mx.array(1.0))[2]
    names = [k for k, _ in tree_flatten(grads)]
    assert names == [k for k, _ in tree_flatten(drafter.trainable_parameters())]
    assert not any("lm_head" in k or "d2t" in k for k in names)
    head = mx.array(drafter.lm_head.weight)
    for _ in range(3):
        trainer.train_step()
    assert mx.array_equal(drafter.lm_head.weight, head).item()
    save_drafter(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["draft_vocab_size"] == 32
    loaded = load_drafter(tmp_path / "d")
    for (k, a), (_, b) in zip(tree_flatten(drafter.parameters()), tree_flatten(loaded.parameters())):
        assert mx.array_equal(a, b).item(), k
    assert loaded.d2t.dtype == mx.int32
    loaded.bind(drafter.binding)
    proposed = set()
    for cycle in dflash_generate_step(mx.array([3, 5, 7, 9]), t, loaded, max_tokens=24):
        proposed.update(cycle.tokens)
    cache = loaded.make_cache()
    loaded.append_context(t(mx.array([[3, 5, 7, 9]]))[1], cache)
    logits = loaded(mx.array([[9, MASK, MASK, MASK]]), cache)
    assert logits.shape == (1, 3, VOCAB)
    assert set(np.array(mx.argmax(logits, -1)).ravel().tolist()) <= set(ids.tolist())


# -- data ------------------------------------------------------------------------------------------------------------
def test_record_formats():
    assert record_messages({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}) \
        == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert record_messages({"prompt": "p", "response": "r"})[1] == {"role": "assistant", "content": "r"}
    assert record_messages({"text": "x"}) is None


def test_truncated_json_array_yields_its_complete_records(tmp_path):
    from dflash_mlx.train.data import read_records

    file = tmp_path / "dump.json"
    file.write_text('[{"text": "a"}, {"text": "b"},\n {"text": "c')
    assert [r["text"] for r in read_records(file)] == ["a", "b"]


def test_chat_documents_train_only_on_assistant_turns(tmp_path):
    from dflash_mlx.demo import make_tiny_pair
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    target_dir, _ = make_tiny_pair(tmp_path)
    tok = load_tokenizer(target_dir)
    messages = [{"role": "user", "content": "Hello! How are you?"}, {"role": "assistant", "content": "I am fine."},
                {"role": "user", "content": "And the weather?"}, {"role": "assistant", "content": "The sun."}]
    doc = chat_document(tok, messages)
    text = tok.decode([t for t, m in zip(doc.tokens, doc.trainable) if m])
    assert "I am fine." in text and "The sun." in text and "Hello" not in text and "weather" not in text
    assert tok.decode(doc.prompt).endswith("<|im_start|>assistant\n")
    tokens, trainable = pack([doc, doc, doc], 16)
    assert tokens.shape[1] == 16 and trainable.shape == tokens.shape


# -- the command, end to end -----------------------------------------------------------------------------------------
def test_train_command_end_to_end(tmp_path):
    from dflash_mlx import load
    from dflash_mlx.cli import main
    from dflash_mlx.demo import CORPUS, make_tiny_pair

    target_dir, _ = make_tiny_pair(tmp_path / "pair")
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"f{i}.txt").write_text("\n".join(CORPUS[i:] + CORPUS[:i]) * 3)
    chats = [{"messages": [{"role": "user", "content": CORPUS[i]}, {"role": "assistant", "content": CORPUS[i - 1]}]}
             for i in range(6)]
    (data / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in chats))
    out = tmp_path / "drafter"
    argv = ["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--steps", "4",
            "--block-size", "4", "--num-layers", "2", "--anchors", "8", "--batch-blocks", "16", "--seq-len", "64", "--eval-prompts", "2",
            "--eval-every", "2", "--eval-tokens", "8", "--checkpoint-every", "2", "--draft-vocab", "128",
            "--kl", "0.3"]
    assert main(argv) == 0
    assert (out / "README.md").is_file() and "Held-out τ" in (out / "README.md").read_text()
    model, tokenizer, drafter = load(str(target_dir), drafter=str(out))
    assert drafter.config.draft_vocab_size == 128 and drafter.config.block_size == 4
    assert main(argv) == 2  # a finished run in --out: refuses to overwrite it without --resume
    assert main(argv + ["--resume"]) == 0  # nothing left to do, but it resumes cleanly


def test_regenerate_replaces_answers_with_the_targets_greedy_output(tmp_path):
    from mlx_lm import load as mlx_load

    from dflash_mlx.demo import make_tiny_pair
    from dflash_mlx.train.data import regenerate
    from tiny import greedy

    target_dir, _ = make_tiny_pair(tmp_path)
    model, tok = mlx_load(str(target_dir))
    docs = [chat_document(tok, [{"role": "user", "content": c}, {"role": "assistant", "content": "x"}])
            for c in ("Hello!", "The quick brown fox")]
    new = regenerate(model, tok, docs, max_tokens=6, batch_size=1, progress=False)
    for old, doc in zip(docs, new):
        n = len(old.prompt)
        assert doc.tokens[:n] == old.prompt and doc.trainable == [0] * n + [1] * (len(doc.tokens) - n)
        assert doc.tokens[n:] == greedy(model, old.prompt, 6, stop_tokens=tok.eos_token_ids)


@pytest.mark.parametrize("kind", ["qwen2", "gemma3_text"])
def test_drafter_starts_with_the_targets_output_gain(kind):
    # RMSNorm(ones) = its gain; the target's head is calibrated for that gain (Gemma stores it as 1 + w).
    from dflash_mlx.targets import TargetModel
    from dflash_mlx.train.drafter import output_scale

    from cache_compare import build

    model = build_target(kind) if kind == "qwen2" else build(kind)  # its own copy: the norm is changed below
    norm = TargetModel(model).inner.norm
    norm.weight = mx.random.uniform(0.5, 9.0, norm.weight.shape, key=mx.random.key(3))  # a trained-looking gain
    t = TargetModel(model)
    gain = output_scale(t, mx.ones((t.hidden_size,)))
    h = mx.random.normal((2, 3, t.hidden_size), key=mx.random.key(4))
    ref = norm(h)
    ours = mx.fast.rms_norm(h, gain, norm.eps)
    assert mx.allclose(ours, ref, atol=1e-4, rtol=1e-4), "drafter norm with this gain must equal the target's norm"
    assert float(gain.mean()) > 1.5, "the gain was not taken from the target"
