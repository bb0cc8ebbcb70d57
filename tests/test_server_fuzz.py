"""Fuzzing every route on the tiny demo pair: schemathesis from the server's own /openapi.json (valid and invalid
requests for each operation, the replies checked against the schema: status codes, content types, shapes), and
hypothesis-generated Anthropic and Responses bodies. Each answer: no 5xx, no traceback in the log, errors in the
route's dialect saying what is wrong (tests/fuzz_requests.py). Derandomized with fixed example counts, so a run
is the same run everywhere; bodies ask for at most 2 tokens. `benchmarks/server_fuzz.py` is the long run."""

from __future__ import annotations

import logging

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance, \
    status_code_conformance

from dflash_mlx import load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app

import fuzz_requests

EXAMPLES = 6  # per operation and mode (valid, invalid); the benchmark runs thousands
BODIES = 60  # hypothesis bodies per route
def fixed(examples: int) -> settings:
    # No shrinking: a failure is reported as found (shrinking a server request can take minutes).
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("fuzz"))
    return create_app(*load(str(target_dir), str(drafter_dir)), ServerSettings(model_name="tiny"))


class _Logged(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(self.format(record))


@pytest.fixture
def log():
    """Everything the server and uvicorn log during the test, tracebacks formatted in."""
    handler = _Logged()
    loggers = [logging.getLogger(name) for name in ("dflash_mlx", "uvicorn", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.lines
    for logger in loggers:
        logger.removeHandler(handler)


def without_lifespan(app):
    """The app without its lifespan, whose end stops the server's worker: schemathesis ends the lifespans it
    started after each test, and a TestClient as it closes, but the module's tests share one app."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                return await send({"type": "lifespan.shutdown.complete"})

    return wrapped


@pytest.fixture(scope="module")
def operations(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", without_lifespan(app))
    return {op.label: op for op in (result.ok() for result in schema.get_all_operations())}


LABELS = ["GET /health", "HEAD /health", "GET /", "GET /metrics", "GET /v1/models", "GET /v1/models/{name}",
          "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages",
          "POST /v1/messages/count_tokens", "POST /v1/responses", "GET /v1/responses/{response_id}",
          "DELETE /v1/responses/{response_id}"]


def test_the_schema_lists_every_route(operations):
    assert set(LABELS) <= set(operations), sorted(operations)


@pytest.mark.parametrize("label", LABELS)
def test_schemathesis(operations, label, log):
    operation = operations[label]
    path = label.split(" ", 1)[1]
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @fixed(EXAMPLES)
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            fuzz_requests.bounded(path, case.body)
            response = case.call()
            case.validate_response(response, checks=CHECKS)
            found = fuzz_requests.problems(path, response.status_code, response.text)
            assert not found, (case.body, found)

        try:
            run()
        except Unsatisfiable:  # an operation with nothing to get wrong (no parameters, no body)
            assert mode is GenerationMode.NEGATIVE
    assert not fuzz_requests.traceback_lines(log), log


@pytest.mark.parametrize("path,bodies", [("/v1/messages", fuzz_requests.anthropic_bodies()),
                                         ("/v1/messages/count_tokens", fuzz_requests.anthropic_bodies()),
                                         ("/v1/responses", fuzz_requests.responses_bodies())])
def test_generated_bodies(app, log, path, bodies):
    statuses = set()
    with TestClient(without_lifespan(app)) as client:  # the app's lifespan would stop the worker on leaving
        @fixed(BODIES)
        @given(body=bodies)
        def run(body):
            r = client.post(path, json=fuzz_requests.bounded(path, body))
            statuses.add(r.status_code)
            found = fuzz_requests.problems(path, r.status_code, r.text)
            assert not found, (body, found)

        run()
    assert not fuzz_requests.traceback_lines(log), log
    assert 400 in statuses  # the generator reached the refusals, not just the happy path


HI = [{"role": "user", "content": "hi"}]
STREAMS = [("POST /v1/chat/completions", {"messages": HI, "max_tokens": 2, "stream": True}),
           ("POST /v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
           ("POST /v1/messages", {"messages": HI, "max_tokens": 2, "stream": True}),
           ("POST /v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True})]


@pytest.mark.parametrize("label,body", STREAMS)
def test_streams_match_the_schema(operations, label, body):
    """A streamed reply, event by event, is what the schema says (schemathesis reads each server-sent event)."""
    case = operations[label].Case(body=body, media_type="application/json")
    response = case.call()
    assert response.status_code == 200 and "data: " in response.text
    case.validate_response(response, checks=CHECKS)
