"""Who gets in and what stops: the API key on every route but /health (compared in constant time), a model name
that is never a path, checkpoints that bring their own code, and a non-streamed request whose client left while
events kept coming (the test owns the interleaving: events queued ahead, a request that says when it is gone)."""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import threading

import pytest
from fastapi.testclient import TestClient
from starlette.routing import Route

from dflash_mlx import load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.errors import DFlashError
from dflash_mlx.models.loading import TRUST_REMOTE_CODE, load_target
from dflash_mlx.server import ServerSettings, create_app, worker as worker_module
from dflash_mlx.server.generation import Delta, GenerationRequest, Outcome
from dflash_mlx.server.streaming import collect
from dflash_mlx.server.worker import Job, Worker

HI = [{"role": "user", "content": "hi"}]
KEY = "s3cret-key"
PUBLIC = {"/health", "/"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("guard"))


@pytest.fixture(scope="module")
def pair(dirs):
    return load(str(dirs[0]), str(dirs[1]))


def _routes(app):
    """(method, path) of every route the app serves, path parameters filled in."""
    for route in app.routes:
        if not isinstance(route, Route):
            continue
        path = route.path.replace("{name:path}", "tiny").replace("{response_id}", "resp_x")
        for method in sorted(route.methods or {"GET"}):
            yield method, path


def test_the_key_is_wanted_on_every_route_but_health(pair, monkeypatch):
    app = create_app(*pair, ServerSettings(model_name="tiny", api_key=KEY))
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    routes = list(_routes(app))
    assert {p for _, p in routes} >= {"/v1/chat/completions", "/v1/completions", "/v1/messages",
                                      "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/resp_x",
                                      "/v1/models", "/v1/models/tiny", "/metrics", "/openapi.json", "/docs"}
    with TestClient(app) as client:
        for method, path in routes:
            body = {"messages": HI, "max_tokens": 1} if method == "POST" else None
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
                r = client.request(method, path, json=body, headers=headers)
                if path in PUBLIC:
                    assert r.status_code != 401, (method, path)
                    continue
                assert r.status_code == 401, (method, path, headers, r.status_code)
                if method != "HEAD":
                    assert "API key" in r.text and KEY not in r.text, (method, path)
            for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code != 401, (method, path, headers)
        # a wrong key on an unknown path learns nothing of what exists
        assert client.get("/v1/nothing-here").status_code == 401
    assert compared  # the comparison is hmac's constant-time one


def test_a_model_name_is_never_a_path(pair, dirs, tmp_path):
    """A request naming a folder (even one holding a real model) is served by the loaded model; nothing under that
    name is opened or listed."""
    seen = []
    watching = threading.Event()
    marker = str(tmp_path / "not-a-model")

    def audit(event, args):
        if watching.is_set() and event in ("open", "os.listdir", "os.scandir", "os.stat") and args and \
                ("not-a-model" in str(args[0]) or str(dirs[0]) in str(args[0])):
            seen.append((event, args[0]))

    sys.addaudithook(audit)  # hooks cannot be removed; this one does nothing once the event is cleared
    app = create_app(*pair, ServerSettings(model_name="tiny"))
    strict = create_app(*pair, ServerSettings(model_name="tiny", strict_model_names=True))
    try:
        with TestClient(app) as client, TestClient(strict) as strict_client:
            watching.set()
            want = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "temperature": 0})
            for name in (marker, str(dirs[0]), "../../" + marker, "file://" + marker):
                r = client.post("/v1/chat/completions",
                                json={"model": name, "messages": HI, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
                assert strict_client.post("/v1/chat/completions",
                                          json={"model": name, "messages": HI, "max_tokens": 1}).status_code == 404
                assert client.get("/v1/models/" + name.lstrip("/")).status_code == 404
    finally:
        watching.clear()
    assert not seen, seen


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_a_checkpoint_asking_for_remote_code_is_refused(dirs, tmp_path, monkeypatch, file):
    import shutil

    target = tmp_path / "remote"
    shutil.copytree(dirs[0], target)
    config = json.loads((target / file).read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel", "AutoTokenizer": ["evil.Tok", None]}
    (target / file).write_text(json.dumps(config))
    monkeypatch.delenv(TRUST_REMOTE_CODE, raising=False)
    with pytest.raises(DFlashError, match=f"asks to run its own Python code .*{file}.*{TRUST_REMOTE_CODE}=1"):
        load_target(str(target))
    if file == "config.json":  # mlx-lm builds its own model class; opting in loads it
        monkeypatch.setenv(TRUST_REMOTE_CODE, "1")
        model, _ = load_target(str(target))
        assert model is not None


class _Request:
    """A client that says it has gone after `after` questions."""

    def __init__(self, after: int):
        self.after, self.asked = after, 0

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return self.asked > self.after


def test_a_gone_client_is_noticed_while_events_keep_coming(monkeypatch):
    """Events already queued (a fast generation) do not keep the handler from asking: it stops after the first."""
    monkeypatch.setattr(worker_module, "POLL_SECONDS", 0.0)  # ask at every event: the count is then exact

    async def run():
        job = Job(GenerationRequest([1], 10), asyncio.get_running_loop())
        for i in range(1000):
            job._events.put_nowait(Delta("x", [1]))
        read = []
        outcome = await collect(job, _Request(after=3), await job.next(), read.append)
        return job, outcome, read

    job, outcome, read = asyncio.run(run())
    assert outcome is None and job.cancelled
    assert len(read) <= 4  # not the 1000 queued


class _Endless:
    """A generator that yields a pass forever until told to stop (then its Outcome), and says when it closed."""

    def __init__(self):
        self.closed = threading.Event()
        self.passes = 0

    def run(self, request, should_stop, batched=False):
        try:
            while not should_stop():
                self.passes += 1
                yield Delta("x", [1])
            yield Outcome("cancelled", 1, self.passes, 0, 1, {})
        finally:
            self.closed.set()


def test_a_gone_client_stops_the_worker_job(monkeypatch):
    monkeypatch.setattr(worker_module, "POLL_SECONDS", 0.0)
    generator = _Endless()
    worker = Worker(generator, max_queue=4)

    async def run():
        job = Job(GenerationRequest([1], 10**9), asyncio.get_running_loop())
        worker.submit(job)
        return job, await collect(job, _Request(after=5), await job.next(), lambda delta: None)

    try:
        job, outcome = asyncio.run(run())
        assert outcome is None and job.cancelled
        assert generator.closed.wait(60), "the generation did not stop"
    finally:
        worker.stop()
    assert worker.running == 0


def test_the_chat_pages_files_load_without_the_key_and_nothing_else_does(pair):
    """A browser loads the page and its files before the page can ask for the key; they hold nothing of anyone's.
    A path that only starts like them reaches no route."""
    app = create_app(*pair, ServerSettings(model_name="tiny", api_key=KEY))
    with TestClient(app) as client:
        assert client.get("/static/app.js").status_code == 200
        assert client.get("/", headers={"Accept": "text/html"}).status_code == 200
        assert client.post("/static/app.js", json={}).status_code == 401
        assert client.get("/static/../metrics").status_code in (401, 404)
        assert client.get("/v1/models").status_code == 401
