"""The trainer's fast path and its recipe, on tiny in-code models: the compiled, accumulated step equals a plain
reference step; dense anchors see only the context before them; `--labels target` takes the target's argmax at the
right position; taps are decoder-layer outputs; resume restores everything; device choice; the model card."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from dflash_mlx.errors import DFlashError
from dflash_mlx.train import block_hidden, slot_weights
from dflash_mlx.train.data import PreparedData
from dflash_mlx.train.device import DeviceChoice, features_on_device, pick_device
from dflash_mlx.train.features import FeatureCache
from dflash_mlx.train.trainer import TrainConfig, Trainer, lr_schedule
from tiny import VOCAB, greedy, make_drafter, target

MASK = VOCAB - 1
ROWS, SEQ, B = 6, 40, 4


def _random_data(rows=ROWS, seq=SEQ):
    tokens = np.random.default_rng(5).integers(0, VOCAB - 1, (rows, seq)).astype(np.int32)
    trainable = np.ones_like(tokens, dtype=np.uint8)
    trainable[0, :10] = 0  # a prompt span: no label there
    return PreparedData(tokens, trainable, [[1, 2, 3, 4, 5, 6]], {"sources": ["random"]})


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    _, t = make_drafter(target("qwen3"), block_size=B)
    c = FeatureCache.create(tmp_path_factory.mktemp("cache"), _random_data(), feature_dim=2 * 64, topk=0,
                            fingerprint={"t": 1})
    c.extract(t, progress=False)
    return c


def _trainer(cache, **overrides):
    drafter, _ = make_drafter(target("qwen3"), block_size=B, seed=overrides.pop("seed", 1))
    config = TrainConfig(**dict(dict(steps=10, lr=3e-3, anchors=12, rows_per_step=2, warmup=2), **overrides))
    return Trainer(drafter, cache, config)


# -- the fast path equals a plain reference ---------------------------------------------------------------------------
def _per_block_loss(trainer, batch):
    """The old way, one block at a time through the inference forward: weighted CE per slot, summed in numpy."""
    drafter = trainer.drafter
    w = slot_weights(B, trainer.gamma)
    feats = batch["features"].astype(mx.float32)
    num, den = 0.0, 0.0
    for r in range(feats.shape[0]):
        for i, a in enumerate(np.array(batch["anchors"][r]).tolist()):
            kv = drafter.make_cache()
            drafter.append_context(feats[r : r + 1, :a], kv)
            block = mx.array([[int(batch["tokens"][r, a])] + [MASK] * (B - 1)])
            logp = np.array(nn.log_softmax(drafter(block, kv)[0], axis=-1))
            for k, label in enumerate(np.array(batch["labels"][r, i]).tolist()):
                if label >= 0:
                    num += -logp[k, label] * w[k]
                    den += w[k]
    return num / den


def test_batched_loss_equals_the_per_block_reference(cache):
    trainer = _trainer(cache)
    batch = trainer.batch(3)
    assert (np.array(batch["labels"]) >= 0).sum() > 0
    assert trainer.loss(batch)[0].item() == pytest.approx(_per_block_loss(trainer, batch), rel=1e-5)


def test_compiled_accumulated_step_equals_a_reference_step(cache):
    fast = _trainer(cache, batch_blocks=3 * 24, compile=True)  # 3 micro-batches of 2 rows x 12 anchors
    assert fast.config.accum == 3
    ref = _trainer(cache)
    params0 = dict(tree_flatten(ref.drafter.trainable_parameters()))
    # Reference: the mean loss over all slots of the three micro-batches, one uncompiled gradient, clip, AdamW.
    batches = [ref.batch(0, i) for i in range(3)]
    w = slot_weights(B, ref.gamma)
    totals = [float((w * (np.array(b["labels"]) >= 0)).sum()) for b in batches]

    def loss_all(model):
        return sum(ref._loss(b)[0] * t for b, t in zip(batches, totals)) / sum(totals)

    loss, grads = nn.value_and_grad(ref.drafter, lambda: loss_all(ref.drafter))()
    # The compiled micro-steps' weight-summed gradients, accumulated, equal the reference gradient.
    acc = None
    for b, t in zip(batches, totals):
        g = fast._micro(b, mx.array(t))[2]
        acc = g if acc is None else tree_map(mx.add, acc, g)
    acc = tree_map(lambda g: g / sum(totals), acc)
    for (k, a), (_, b) in zip(tree_flatten(acc), tree_flatten(grads)):
        assert mx.allclose(a, b, atol=1e-6, rtol=1e-4).item(), k
    grads, _ = optim.clip_grad_norm(grads, 1.0)
    opt = optim.AdamW(learning_rate=lr_schedule(ref.config), betas=[0.9, 0.95], weight_decay=0.01)
    opt.init(ref.drafter.trainable_parameters())
    opt.update(ref.drafter, grads)
    mx.eval(ref.drafter.parameters())

    m = fast.train_step()
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-4)
    assert fast.predicted == sum(int((np.array(b["labels"]) >= 0).sum()) for b in batches)
    # Adam's first step is ~lr * sign(g): rounding-level gradient differences on near-zero entries move a weight by
    # a small fraction of that, so the parameters agree to 5% of the step's largest move.
    for (k, a), (_, b) in zip(tree_flatten(fast.drafter.trainable_parameters()),
                              tree_flatten(ref.drafter.trainable_parameters())):
        assert not mx.array_equal(a, params0[k]).item(), f"{k} did not move"
        assert mx.abs(a - b).max().item() < 0.05 * mx.abs(b - params0[k]).max().item(), k


def test_dense_anchors_never_see_context_at_or_after_the_anchor():
    drafter, t = make_drafter(target("qwen3"), block_size=B)
    S = 24
    tokens = mx.array(np.random.default_rng(2).integers(0, VOCAB - 1, (1, S)).astype(np.int32))
    feats = t(tokens)[1]
    anchors = mx.array([list(range(1, S - B + 1))])  # every possible anchor: dense
    base = block_hidden(drafter, drafter.binding.embed, feats, tokens, anchors, MASK)
    for p in (5, 11, S - B):
        noisy = feats.at[:, p:].add(mx.random.normal(feats[:, p:].shape, key=mx.random.key(p)) * 10)
        h = block_hidden(drafter, drafter.binding.embed, noisy, tokens, anchors, MASK)
        changed = mx.abs(h - base).max(axis=(0, 2, 3))  # per anchor
        for i, a in enumerate(range(1, S - B + 1)):
            if a <= p:
                assert changed[i].item() == 0.0, f"anchor {a} saw context at {p}"
            else:
                assert changed[i].item() > 0, f"anchor {a} ignores its context at {p}"


# -- labels ---------------------------------------------------------------------------------------------------------
def test_target_labels_are_the_targets_argmax_at_the_previous_position(cache):
    trainer = _trainer(cache, labels="target")
    batch = trainer.batch(7)
    model = target("qwen3")
    anchors, labels = np.array(batch["anchors"]), np.array(batch["labels"])
    tokens = np.array(batch["tokens"])
    checked = 0
    for r in range(tokens.shape[0]):
        logits = model(mx.array(tokens[r : r + 1]))[0]
        direct = np.array(mx.argmax(logits, axis=-1))
        for i, a in enumerate(anchors[r].tolist()):
            for k in range(1, B):
                if labels[r, i, k - 1] >= 0:
                    assert labels[r, i, k - 1] == direct[a + k - 1]  # logits at a+k-1 predict token a+k
                    checked += 1
            # Slot 1 is exactly what greedy decoding of the row's prefix up to the anchor produces next.
            if i < 3 and labels[r, i, 0] >= 0:
                assert labels[r, i, 0] == greedy(model, tokens[r, : a + 1].tolist(), 1)[0]
    assert checked > 0
    data_labels = np.array(_trainer(cache).batch(7)["labels"])
    assert (data_labels != labels).any(), "target labels should differ from the text on a random target"


def test_data_labels_are_the_next_tokens_and_respect_the_mask(cache):
    batch = _trainer(cache).batch(4)
    tokens, anchors, labels = (np.array(batch[k]) for k in ("tokens", "anchors", "labels"))
    for r in range(tokens.shape[0]):
        for i, a in enumerate(anchors[r].tolist()):
            for k in range(1, B):
                if labels[r, i, k - 1] >= 0:
                    assert labels[r, i, k - 1] == tokens[r, a + k]
    assert (anchors >= 1).all() and (anchors <= SEQ - B).all()


def test_taps_are_the_outputs_of_decoder_layer_k(cache):
    model = target("qwen3")
    row = np.asarray(cache.tokens[2])
    h = model.model.embed_tokens(mx.array(row)[None])
    outs = []
    for layer in model.model.layers:
        h = layer(h, mask="causal", cache=None)
        outs.append(h)
    _, t = make_drafter(model, block_size=B)
    want = mx.concatenate([outs[k] for k in t.tap_layer_ids], axis=-1)[0]
    got = np.asarray(cache.features()[2], dtype=np.float32)
    np.testing.assert_allclose(got, np.array(want), rtol=2e-3, atol=2e-3)
    assert t.tap_layer_ids == [1, 3]


def test_old_cache_without_argmax_refuses_target_labels(cache, tmp_path):
    old = FeatureCache(cache.path, dict(cache.meta, format=1))
    drafter, _ = make_drafter(target("qwen3"), block_size=B)
    with pytest.raises(DFlashError, match="predates --labels target"):
        Trainer(drafter, old, TrainConfig(labels="target"))


# -- recipe ------------------------------------------------------------------------------------------------------------
def test_recipe_defaults():
    from dflash_mlx.train.args import TrainArgs
    from dflash_mlx.train.recipe import default_taps

    args = TrainArgs(target="t", out="o")
    assert (args.num_layers, args.block_size, args.lr, args.grad_clip) == (5, 16, 6e-4, 1.0)
    assert args.anchors >= 128 and args.seq_len == 512 and args.batch_blocks >= 512
    config = args.train_config()
    assert config.warmup == 80 and config.accum == 4  # 4% of 2000 steps; 512 blocks = 4 x 128
    assert default_taps(24, 5) == [1, 6, 11, 16, 21]
    assert default_taps(36, 5) == [1, 9, 17, 25, 33]
    assert len(set(default_taps(4, 5))) == len(default_taps(4, 5))  # shallow targets: distinct layers
    with pytest.raises(DFlashError, match="--labels"):
        TrainConfig(labels="teacher")


def test_target_embedding_and_head_are_frozen(cache):
    trainer = _trainer(cache)
    names = [k for k, _ in tree_flatten(trainer.drafter.trainable_parameters())]
    assert not any("embed" in k or "lm_head" in k for k in names)
    model = target("qwen3")
    before = {k: mx.array(v) for k, v in tree_flatten(model.parameters())}
    trainer.train_step()
    for k, v in tree_flatten(model.parameters()):
        assert mx.array_equal(v, before[k]).item(), k


# -- resume ------------------------------------------------------------------------------------------------------------
def test_resume_restores_weights_and_optimizer_state_exactly(cache, tmp_path):
    first = _trainer(cache, batch_blocks=48)
    for _ in range(2):
        first.train_step()
    step_dir = first.save(tmp_path / "run")
    second = _trainer(cache, batch_blocks=48, seed=42)  # another init: nothing may survive the load
    second.load(step_dir)
    for (k, a), (_, b) in zip(tree_flatten(first.drafter.parameters()), tree_flatten(second.drafter.parameters())):
        assert mx.array_equal(a, b).item(), k
    sa, sb = dict(tree_flatten(first.optimizer.state)), dict(tree_flatten(second.optimizer.state))
    assert sa.keys() == sb.keys() and all(mx.array_equal(sa[k], sb[k]).item() for k in sa)
    assert (second.step, second.predicted, second.flops) == (first.step, first.predicted, first.flops)
    # The compiled step runs on the restored state: both continue identically.
    first.train_step()
    second.train_step()
    for (k, a), (_, b) in zip(tree_flatten(first.drafter.parameters()), tree_flatten(second.drafter.parameters())):
        assert mx.array_equal(a, b).item(), k


# -- device ------------------------------------------------------------------------------------------------------------
def test_device_choice():
    cpu = pick_device(mx.Device(mx.cpu), info=lambda d: {"device_name": "EPYC"})
    assert (cpu.backend, cpu.memory) == ("cpu", None) and not features_on_device(1, cpu)
    metal = pick_device(mx.Device(mx.gpu), info=lambda d: {"device_name": "Apple M3", "memory_size": 64 << 30,
                                                           "max_recommended_working_set_size": 48 << 30},
                        metal=True, cuda=False)
    assert (metal.backend, metal.memory) == ("metal", 48 << 30) and "Apple M3" in metal.describe()
    cuda = pick_device(mx.Device(mx.gpu), info=lambda d: {"device_name": "NVIDIA H100", "total_memory": 80 << 30},
                       metal=False, cuda=True)
    assert (cuda.backend, cuda.memory) == ("cuda", 80 << 30)
    assert features_on_device(30 << 30, cuda) and not features_on_device(40 << 30, cuda)
    busy = pick_device(mx.Device(mx.gpu), info=lambda d: {"total_memory": 80 << 30, "free_memory": 20 << 30},
                       metal=False, cuda=True)
    assert busy.memory == 20 << 30 and not features_on_device(10 << 30, busy)  # what is free, not the total
    unknown = DeviceChoice(mx.Device(mx.gpu), "cuda", "?", None)
    assert not features_on_device(1, unknown)
    here = pick_device()
    assert here.device == mx.default_device()


def test_features_on_device_give_the_same_batches(cache):
    host, dev = _trainer(cache), _trainer(cache)
    dev = Trainer(dev.drafter, cache, dev.config, device_features=True)
    a, b = host.batch(2), dev.batch(2)
    for k in a:
        assert mx.array_equal(a[k], b[k]).item(), k


def _eos(target_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(target_dir).eos_token_ids or []


# -- the command: card, resume ---------------------------------------------------------------------------------------
def test_command_card_and_resume(tmp_path):
    from dflash_mlx.cli import main
    from dflash_mlx.demo import CORPUS, make_tiny_pair
    from dflash_mlx.train.args import TrainArgs
    from dflash_mlx.train.session import setup_run

    target_dir, _ = make_tiny_pair(tmp_path / "pair")
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"f{i}.txt").write_text("\n".join(CORPUS[i:] + CORPUS[:i]) * 3)
    out = tmp_path / "drafter"
    argv = ["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--steps", "2",
            "--block-size", "4", "--num-layers", "2", "--anchors", "16", "--batch-blocks", "32", "--seq-len", "48",
            "--eval-prompts", "2", "--eval-every", "1", "--eval-tokens", "6", "--checkpoint-every", "1",
            "--labels", "target", "--draft-vocab", "64"]
    assert main(argv) == 0
    card = (out / "README.md").read_text()
    for needle in ("## Recipe", "γ", "learning rate", "gradient clip", "blocks per optimizer step",
                   "the target's own argmax", "| step | slots seen | training FLOPs | held-out τ |"):
        assert needle in card, needle
    assert sum(1 for line in card.splitlines() if line.startswith("| 2 |")) == 1  # τ at steps 0, 1, 2
    try:
        import matplotlib  # noqa: F401

        assert (out / "tau_curve.png").stat().st_size > 1000 and "tau_curve.png" in card
    except ImportError:
        assert "matplotlib is not installed" in card
    saved = json.loads((out / "train_state" / "latest.json").read_text())
    params = mx.load(str(out / "train_state" / saved["dir"] / "params.safetensors"))
    # --resume rebuilds everything from the checkpoint: the weights are the saved ones, never a fresh init.
    args, *_, trainer, _, _ = setup_run(TrainArgs(target=str(target_dir), out=str(out), progress=False), True,
                                        lambda *_: None)
    assert args.labels == "target" and trainer.step == 2
    # The reduced vocabulary is drawn from the labels trained on: the target's choices, not the text.
    from dflash_mlx.train.vocab import select_vocab

    c, V = trainer.cache, trainer.drafter.config.vocab_size
    chosen = np.arange(64) + np.array(trainer.drafter.d2t)
    eos = list(_eos(target_dir))
    want = select_vocab(np.asarray(c.argmax())[:, :-1], np.asarray(c.trainable)[:, 1:], 64, V, always=eos)
    from_text = select_vocab(np.asarray(c.tokens), np.asarray(c.trainable), 64, V, always=eos)
    assert chosen.tolist() == want.tolist() and want.tolist() != from_text.tolist()
    mine = dict(tree_flatten(trainer.drafter.parameters()))
    assert mine.keys() == params.keys() and all(mx.array_equal(mine[k], params[k]).item() for k in params)
    assert main(argv + ["--resume", "--steps", "3"]) == 0  # extends the run by one step
    assert json.loads((out / "train_state" / "latest.json").read_text())["step"] == 3


def test_logsumexp_with_saved_softmax_matches_mlx():
    from dflash_mlx.train.loss import logsumexp

    x = mx.random.normal((3, 5, 50), key=mx.random.key(0)) * 4
    w = mx.random.normal((3, 5), key=mx.random.key(1))
    mine, ref = (lambda x: (logsumexp(x) * w).sum()), (lambda x: (mx.logsumexp(x, axis=-1) * w).sum())
    assert mine(x).item() == pytest.approx(ref(x).item(), rel=1e-6)
    for grad in (mx.grad(mine), mx.compile(mx.grad(mine))):
        assert mx.allclose(grad(x), mx.grad(ref)(x), atol=1e-6).item()
