"""`serve --prompt-cache-dir`: prefix-cache entries kept on disk (evicted ones, and every one at shutdown) are found
again after a restart, restore caches bit for bit (dense and hybrid targets, with the drafter's pending features),
and the folder is used with care: other pairs' files are never loaded, foreign files never touched, a damaged
file is skipped, the folder keeps its byte budget."""

import httpx
import mlx.core as mx
import pytest
from mlx_lm.utils import _get_classes

from cache_compare import CONFIGS, assert_caches_equal
from dflash_mlx import load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.decode.state import DecodeState, prefill
from dflash_mlx.server import ServerSettings, create_app, start_in_thread
from dflash_mlx.server.prefix_cache import PrefixCache, Snapshot
from dflash_mlx.server.prefix_store import PREFIX, SUFFIX, PrefixStore, fingerprint
from tiny import make_drafter, prompt_ids, randomize, target


def _snapshot(model, n=12, seed=1):
    drafter, t = make_drafter(model, block_size=4)
    state = DecodeState.fresh(t, drafter)
    tokens = prompt_ids(n, seed=seed)
    prefill(t, drafter, mx.array(tokens, dtype=mx.int32), state)
    # Some target features still wait for the drafter (as after a verify pass): they must survive the round trip.
    state.last_token = tokens[-1]
    _, hidden = t(mx.array([[tokens[-1], 3, 4]], dtype=mx.int32), state.target_cache)
    state.add_context(hidden)
    state.last_token = 4
    key = tokens + [3, 4]
    return key, Snapshot.take(state.target_cache, state.draft_cache, state.pending_context, len(key))


def _hybrid():
    model_class, args_class = _get_classes(CONFIGS["qwen3_5"])
    return randomize(model_class(args_class.from_dict(CONFIGS["qwen3_5"])), 3)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_an_entry_round_trips_bit_for_bit(kind, tmp_path):
    model = _hybrid() if kind == "qwen3_5" else target(kind)
    key, snap = _snapshot(model)
    PrefixStore(tmp_path, "pair-a", 1 << 30).save(key, snap)
    again = PrefixStore(tmp_path, "pair-a", 1 << 30)  # a restart: the folder is read anew
    length, stored = again.best(key + [9, 9], len(key) + 1)
    assert length == len(key) and stored.cuttable == snap.cuttable
    loaded = again.load(stored)
    assert loaded.length == snap.length and loaded.nbytes == snap.nbytes
    for cut in ([len(key)] + ([len(key) - 5] if snap.cuttable else [])):
        ours, theirs = loaded.restore(cut), snap.restore(cut)
        assert_caches_equal(ours[0], theirs[0])
        assert_caches_equal(ours[1], theirs[1])
        assert (ours[2] is None) == (theirs[2] is None)
        if ours[2] is not None:
            assert mx.array_equal(ours[2], theirs[2]).item()
    if not snap.cuttable:  # a recurrent state serves only prompts that extend its whole key
        assert again.best(key[:-1] + [99], len(key) + 1)[0] == 0


def test_other_pairs_and_foreign_files_are_left_alone(tmp_path):
    key, snap = _snapshot(target("qwen3"))
    foreign = tmp_path / "notes.safetensors"
    foreign.write_bytes(b"not ours")
    PrefixStore(tmp_path, "pair-a", 1 << 30).save(key, snap)
    assert PrefixStore(tmp_path, "pair-b", 1 << 30).entries == {}  # another target/drafter: never loaded
    # A budget smaller than one entry keeps none of ours, and touches nothing else.
    store = PrefixStore(tmp_path, "pair-a", 1 << 30)
    store.max_bytes = 1
    store._keep_budget(keep=())
    assert foreign.read_bytes() == b"not ours"
    assert not list(tmp_path.glob(f"{PREFIX}*{SUFFIX}")) and store.entries == {}


def test_the_folder_keeps_its_budget_least_recently_used_first(tmp_path):
    store = PrefixStore(tmp_path, "pair-a", 1 << 30)
    entries = [_snapshot(target("qwen3"), n=10 + i, seed=i) for i in range(3)]
    store.save(*entries[0])
    size = store.entries[tuple(entries[0][0])].nbytes
    store.max_bytes = int(2.5 * size)
    store.save(*entries[1])
    store.load(store.entries[tuple(entries[0][0])])  # used again: the older one now is entry 1
    store.save(*entries[2])
    assert set(store.entries) == {tuple(entries[0][0]), tuple(entries[2][0])}


def test_a_damaged_file_is_skipped(tmp_path):
    key, snap = _snapshot(target("qwen3"))
    PrefixStore(tmp_path, "pair-a", 1 << 30).save(key, snap)
    (path,) = tmp_path.glob(f"{PREFIX}*{SUFFIX}")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the header survives, the tensors do not
    store = PrefixStore(tmp_path, "pair-a", 1 << 30)  # cut short: removed as the folder is read
    assert store.entries == {} and not path.exists()


def test_evictions_reach_the_store():
    seen = []
    cache = PrefixCache(1 << 30)
    cache.on_evict = lambda key, snap: seen.append(key)
    (k1, s1), (k2, s2) = _snapshot(target("qwen3"), seed=1), _snapshot(target("qwen3"), seed=2)
    cache.max_bytes = s1.nbytes + s2.nbytes // 2
    cache.insert(k1, s1)
    cache.insert(k2, s2)
    assert seen == [tuple(k1)] and [k for k, _ in cache.items()] == [tuple(k2)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("disk"))
    return load(str(target_dir), str(drafter_dir))


def _ask(base, ids):
    body = {"model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 0}
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]


def test_a_restarted_server_finds_its_prompts_warm(pair, tmp_path):
    long_prompt = [(7 * i) % 90 + 3 for i in range(60)]
    other = [(11 * i) % 80 + 5 for i in range(40)]
    settings = dict(model_name="tiny", prompt_cache_dir=str(tmp_path))

    running = start_in_thread(create_app(*pair, ServerSettings(**settings)))
    try:
        first, usage = _ask(running.base, long_prompt)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        _ask(running.base, other)
    finally:
        running.stop()  # the worker writes every cached entry as it ends
    assert len(list(tmp_path.glob(f"{PREFIX}*{SUFFIX}"))) >= 2

    running = start_in_thread(create_app(*pair, ServerSettings(**settings)))
    try:
        again, usage = _ask(running.base, long_prompt + [4, 5])  # the same system prompt, a new question
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(long_prompt) - 1
        assert again == _ask_alone(pair, long_prompt + [4, 5])
        repeat, usage = _ask(running.base, long_prompt)
        assert repeat == first and usage["prompt_tokens_details"]["cached_tokens"] == len(long_prompt) - 1
    finally:
        running.stop()


def _ask_alone(pair, ids):
    running = start_in_thread(create_app(*pair, ServerSettings(model_name="tiny", prompt_cache_bytes=0)))
    try:
        return _ask(running.base, ids)[0]
    finally:
        running.stop()


def test_another_pair_does_not_load_the_files(pair, tmp_path):
    model, tokenizer, drafter = pair
    assert fingerprint(model, drafter) != fingerprint(model, None)
    running = start_in_thread(create_app(*pair, ServerSettings(model_name="tiny", prompt_cache_dir=str(tmp_path))))
    ids = [(5 * i) % 70 + 3 for i in range(30)]
    try:
        _ask(running.base, ids)
    finally:
        running.stop()
    # The same target without the drafter is another pair: its caches hold no drafter state.
    running = start_in_thread(create_app(model, tokenizer, None, ServerSettings(model_name="tiny",
                                                                                prompt_cache_dir=str(tmp_path))))
    try:
        assert _ask(running.base, ids)[1]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        running.stop()


def test_a_file_as_the_folder_is_one_clear_line(tmp_path, capsys):
    from dflash_mlx.cli import main

    path = tmp_path / "file"
    path.write_text("x")
    assert main(["serve", "--prompt-cache-dir", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--prompt-cache-dir" in err and "is a file" in err and len(err.strip().splitlines()) == 1
    assert path.read_text() == "x"
