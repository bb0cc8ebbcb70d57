"""The PyTorch trainer (`dflash_mlx.torch_train`) against the MLX drafter, on tiny in-code models (fp32, CPU).

Its forward must be ours: the same checkpoint gives the same logits in PyTorch's training forward and in the MLX
drafter's inference forward, block by block; the rows, anchors and labels come from the same seeded recipe; and a
drafter trained in PyTorch loads with our loader and drafts for our engine, losslessly.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from dflash_mlx.drafter_io import read_drafter, save_drafter  # noqa: E402
from dflash_mlx.torch_train.checkpoint import load_drafter, save_drafter as torch_save  # noqa: E402
from dflash_mlx.train.vocab import maps  # noqa: E402
from tiny import VOCAB, make_drafter, target  # noqa: E402

MASK = VOCAB - 1


def _inference_logits(drafter, hidden, tokens, anchor):
    cache = drafter.make_cache()
    drafter.append_context(hidden[:, :anchor], cache)
    block = mx.array([[tokens[anchor]] + [MASK] * (drafter.block_size - 1)])
    return drafter(block, cache)[0]


def _torch_embed_head(t):
    # The tiny target's embedding and head as plain matrices (head(I) reads W^T off the head).
    E = torch.tensor(np.asarray(t.embed(mx.arange(VOCAB)[None])[0]))
    W = torch.tensor(np.asarray(t.head(mx.eye(t.hidden_size)[None])[0])).T  # [V, H]
    return (lambda ids: E[ids]), (lambda h: h @ W.T)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("variant", ["full", "reduced_vocab", "gqa_wide"])
def test_torch_training_forward_equals_the_mlx_inference_forward(tmp_path, kind, variant):
    extra = {}
    if variant == "reduced_vocab":
        extra = dict(draft_vocab_size=40)
    if variant == "gqa_wide":
        extra = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=48)
    drafter, t = make_drafter(target(kind), block_size=5, rope_theta=5000.0, **extra)
    if variant == "reduced_vocab":
        ids = np.sort(np.random.default_rng(0).choice(VOCAB, 40, replace=False))
        drafter.d2t = mx.array(maps(ids, VOCAB)[0])
    save_drafter(drafter, tmp_path / "d")  # fp32 as built
    model = load_drafter(tmp_path / "d").eval()

    tokens = [int(x) for x in np.random.default_rng(1).integers(0, VOCAB - 1, 40)]
    _, hidden = t(mx.array(tokens)[None])
    anchors = [1, 7, 8, 19, 30, 35]  # the first and last possible anchors included (S - B = 35)
    embed, head = _torch_embed_head(t)
    with torch.no_grad():
        h = model.block_hidden(torch.tensor(np.asarray(hidden)), torch.tensor([tokens]), torch.tensor([anchors]), embed)
        logits = model.logits(h, head)[0].numpy()  # [A, B-1, V or N]
    if variant == "reduced_vocab":
        logits = np.asarray(drafter.to_target_vocab(mx.array(logits)))  # draft ids -> target ids (ours)
    for i, a in enumerate(anchors):
        ref = np.asarray(_inference_logits(drafter, hidden, tokens, a))
        finite = np.isfinite(ref)
        assert (finite == np.isfinite(logits[i])).all()
        np.testing.assert_allclose(logits[i][finite], ref[finite], atol=2e-5, rtol=1e-5, err_msg=f"anchor {a}")


def test_torch_checkpoint_round_trips_through_our_loader(tmp_path):
    drafter, _ = make_drafter(target("qwen3"), block_size=4, draft_vocab_size=40)
    drafter.d2t = mx.array(maps(np.arange(0, 80, 2), VOCAB)[0])
    save_drafter(drafter, tmp_path / "mlx")
    model = load_drafter(tmp_path / "mlx")
    torch_save(model, tmp_path / "torch", dtype=torch.float32)
    again = read_drafter(tmp_path / "torch")
    ours, theirs = dict(tree_flatten(drafter.parameters())), dict(tree_flatten(again.parameters()))
    assert ours.keys() == theirs.keys()
    for k in ours:
        np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(theirs[k]), err_msg=k)
    assert again.config.to_dict() == drafter.config.to_dict()
