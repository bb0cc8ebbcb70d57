"""The newer drafter families go through every door unchanged: a DFlash 2 drafter (dynamic convolutions, candidate
selector) and a DSpark drafter with a confidence head (Markov walk, cut blocks) serve concurrent batched requests
and a chat session on a tokenized tiny target, each reply equal to the target's plain greedy decoding."""

import threading
import time

import httpx
import mlx_lm
import mlx.core as mx
import numpy as np
import pytest

import tiny
from dflash_mlx.models.loading import load_target
from dflash_mlx.chat import ChatSession
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.drafters.dflash2 import DFlash2Config, DFlash2Drafter
from dflash_mlx.drafters.dspark import DSparkDrafter
from dflash_mlx.drafters.dspark_config import DSparkConfig
from dflash_mlx.server import ServerSettings, create_app, start_in_thread

PROMPTS = [[5, 17, 23, 8, 41], [12, 3, 77, 9], [30, 31, 32, 33, 34, 35, 36]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    target_dir, _ = make_tiny_pair(tmp_path_factory.mktemp("families"))
    model, tokenizer = load_target(str(target_dir))
    return model, tokenizer


def _shape(model, tokenizer):
    n = tiny.num_layers(model)
    return dict(hidden_size=model.args.hidden_size, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, vocab_size=model.args.vocab_size, rope_theta=10000.0,
                target_layer_ids=[1, n - 2], mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"))


def _dflash2(model, tokenizer):
    return tiny.randomize(DFlash2Drafter(DFlash2Config(
        **_shape(model, tokenizer), num_target_layers=tiny.num_layers(model), block_size=8, conv_kernel_size=2,
        conv_group_size=16, selector_rank=8, selector_top_k=5)), 2)


def _dspark(model, tokenizer):
    V = model.args.vocab_size
    drafter = tiny.randomize(DSparkDrafter(DSparkConfig(
        **_shape(model, tokenizer), dspark_block=7, logits_start=0, block_size=8, markov_rank=V,
        enable_confidence_head=True)), 4)
    # A Markov head that follows the target's greedy bigrams on these prompts, so drafts are accepted.
    w2 = np.zeros((V, V), dtype=np.float32)
    for ids in PROMPTS:
        plain = tiny.greedy(model, ids, 24)
        for a, b in zip(ids + plain, plain):
            if not w2[:, a].any():  # the first successor seen wins
                w2[b, a] = 12.0
    drafter.markov_head.markov_w1.weight = mx.eye(V)
    drafter.markov_head.markov_w2.weight = mx.array(w2)
    return drafter


FAMILIES = {"dflash2": _dflash2, "dspark": _dspark}


def _all_at_once(app, base, jobs):
    """Run `jobs` [(ids, max_tokens, options)] with the worker held until every one is queued, so all three start
    in the same round and share their verify passes whatever the machine's load. Returns the replies' texts."""
    from test_server_batching import _complete

    worker = app.state.server.worker
    gate = threading.Event()
    held = worker.call_soon(lambda: gate.wait(120))  # runs on the worker thread: no job starts meanwhile
    out = [None] * len(jobs)

    def one(i):
        out[i] = _complete(base, *jobs[i][:2], **jobs[i][2])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while worker.waiting < len(jobs) and time.monotonic() < deadline:  # a wait for a state, not a timing claim
        time.sleep(0.01)
    assert worker.waiting == len(jobs), "the requests were not all queued"
    gate.set()
    held.result(120)
    for t in threads:
        t.join(180)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_server_replies_are_plain_greedy(target, family):
    """Three requests sharing verify passes (all queued before the worker takes any): each reply is mlx-lm's
    plain greedy reply."""
    model, tokenizer = target
    drafter = FAMILIES[family](model, tokenizer)
    walks = []
    drafter.draft_walk = lambda block_ids, cache, walk=drafter.draft_walk: walks.append(1) or walk(block_ids, cache)
    jobs = [(PROMPTS[0], 96, {})] + [(ids, 24, {}) for ids in PROMPTS[1:]]
    want = [mlx_lm.generate(model, tokenizer, ids, max_tokens=n) for ids, n, _ in jobs]  # plain greedy, mlx-lm's
    app = create_app(model, tokenizer, drafter, ServerSettings(model_name="tiny", max_batch=4))
    running = start_in_thread(app)
    try:
        assert _all_at_once(app, running.base, jobs) == want
        assert max(app.state.server.worker.generator.batch.sizes) >= 2  # passes were shared
        assert walks  # the drafter ran
    finally:
        running.stop()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_turns_are_plain_greedy(target, family):
    """Two turns on the session's caches: each reply is the target's greedy reply to everything before it."""
    model, tokenizer = target
    session = ChatSession(model, tokenizer, FAMILIES[family](model, tokenizer), max_tokens=16)
    eos, drafted = set(tokenizer.eos_token_ids), 0
    for text in ("def add(a, b):", "And a second question"):
        before = len(session.seen)
        "".join(session.send(text))
        context = before + session.last_prefill_tokens - (1 if before else 0)
        reply = session.seen[context:]
        want = tiny.greedy(model, session.seen[:context], 16)
        stop = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
        assert reply == want[:stop], text
        drafted += session.last_stats.source_counts().get("dflash", {}).get("passes", 0)
    assert drafted > 0  # the drafter ran
