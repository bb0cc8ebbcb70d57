"""The memory soak of benchmarks/server_soak.py, short: a few dozen mixed requests (every route, streams dropped
midway, a growing previous_response_id chain) against the tiny pair under a prefix-cache budget of a few entries.

Timing and RSS are left to the script (too noisy for a short run); here the invariants that keep memory flat are
checked after every request: the prefix cache within its budget and its byte count equal to the sum of its entries,
the response store within its bounds, the metrics table keyed by route templates only, and at the end MLX's
active memory no higher than after the warm-up plus the cache budget, with the worker idle.
"""

import importlib.util
import sys
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from dflash_mlx import load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "server_soak.py"
_spec = importlib.util.spec_from_file_location("server_soak", SCRIPT)
server_soak = sys.modules["server_soak"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_soak)

BUDGET = 2 << 20  # the tiny pair's snapshots are ~0.8 MiB: two or three fit, the rest are evicted


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("soak"))
    model, tokenizer, drafter = load(str(target_dir), str(drafter_dir))
    app = create_app(model, tokenizer, drafter, ServerSettings(model_name="soak", prompt_cache_bytes=BUDGET))
    app.state.responses.max_entries = 6  # so the chain outlives its stored turns and restarts
    running = start_in_thread(app)
    yield running, app
    running.stop()


def _entries(cache):
    return [node.entry for node in cache._subtree_entries(cache.root)]


def test_soak_keeps_memory_bounded(live):
    running, app = live
    server = app.state.server
    cache, store = server.generator.cache, app.state.responses

    def check(i):
        entries = _entries(cache)
        assert cache.nbytes <= BUDGET, f"request {i}: prefix cache {cache.nbytes} bytes > budget {BUDGET}"
        assert cache.nbytes == sum(e.nbytes for e in entries) and len(entries) == len(cache)
        assert len(store) <= store.max_entries and store.nbytes <= store.max_bytes

    server_soak.soak(running.base, 6, "soak", seed=1, after_each=check)
    server_soak.settle(app)
    active = mx.get_active_memory()
    kinds = server_soak.soak(running.base, 24, "soak", seed=2, after_each=check)
    server_soak.settle(app)
    assert {"chat_drop", "responses_drop", "responses_chain"} <= set(kinds)
    assert cache.evictions > 0 and cache.hits > 0
    assert server.worker.running == 0 and server.worker.waiting == 0
    # Arrays nobody holds are freed: what is live beyond the warm-up level fits in the cache's budget.
    assert mx.get_active_memory() <= active + BUDGET + (1 << 20)
    # Once idle, the server gave MLX's buffer cache back (server/memory.py).
    assert app.state.memory.caught_up and mx.get_cache_memory() == 0


def test_made_up_paths_do_not_grow_the_metrics_table(live):
    running, app = live
    metrics = app.state.server.metrics
    for i in range(20):
        assert httpx.get(f"{running.url}/models/made-up-{i}").status_code == 404
        assert httpx.get(f"{running.base}/nowhere/{i}").status_code == 404
    routes = {route for route, _ in metrics.requests}
    assert not any("made-up" in r or "nowhere" in r for r in routes), routes
    assert {"/v1/models/{name:path}", "unmatched"} <= routes
