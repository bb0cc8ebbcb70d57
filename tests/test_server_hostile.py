"""The server against the bodies a fuzzer and careless clients send: content of every JSON type where text is
wanted, nulls the OpenAI spec allows, bodies too big, too deep, not JSON or empty; a failure nobody foresaw
(answered in the route's dialect, the keep-alive connection still usable); Responses cut by max_output_tokens;
Anthropic's opening usage. Each case is one request on the tiny demo pair, max_tokens 1-2."""

from __future__ import annotations

import json
import logging
import socket

import pytest
from fastapi.testclient import TestClient

from dflash_mlx import load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("hostile"))
    return load(str(target_dir), str(drafter_dir))


@pytest.fixture(scope="module")
def app(pair):
    return create_app(*pair, ServerSettings(model_name="tiny"))


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as c:
        yield c


def openai_error(r, status=400):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def anthropic_error(r, status=400):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


def _tool_turn(content):
    return HI + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": content}]}]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("content,got", [(3, "a number"), ({"a": 1}, "an object"), (["x", "y"], "a string")])
def test_tool_result_content_of_another_type_is_a_400_naming_it(client, path, content, got):
    r = client.post(path, json={"max_tokens": 1, "messages": _tool_turn(content)})
    message = anthropic_error(r)["message"]
    assert "'messages.2.content.0.content" in message and got in message, message


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_tool_result_content_null_is_empty(client, path):
    r = client.post(path, json={"max_tokens": 1, "messages": _tool_turn(None)})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content,param", [(3, "input.0.content"), ({"a": 1}, "input.0.content"),
                                           (["x", "y"], "input.0.content.0")])
def test_responses_message_content_of_another_type_is_a_400(client, content, param):
    r = client.post("/v1/responses", json={"max_output_tokens": 1,
                                           "input": [{"type": "message", "role": "user", "content": content}]})
    error = openai_error(r)
    assert error["param"] == param and f"'{param}'" in error["message"], error


@pytest.mark.parametrize("output,param", [(3, "input.2.output"), ([1, 2], "input.2.output.0"),
                                          (["a"], "input.2.output.0")])
def test_function_call_output_of_another_type_is_a_400(client, output, param):
    items = [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                 "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c", "output": output}]
    error = openai_error(client.post("/v1/responses", json={"max_output_tokens": 1, "input": items}))
    assert error["param"] == param, error


def test_namespace_tools_not_a_list_is_a_400(client):
    r = client.post("/v1/responses", json={"max_output_tokens": 1, "input": "hi",
                                           "tools": [{"type": "namespace", "name": "ns", "tools": 5}]})
    error = openai_error(r)
    assert error["param"] == "tools.0.tools" and "array" in error["message"], error


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 1, "n": None, "stream": None, "logprobs": None}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "echo": None, "stream": None, "n": None}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "store": None, "stream": None,
                       "parallel_tool_calls": None}),
    ("/v1/messages", {"messages": HI, "max_tokens": 1, "stream": None}),
    ("/v1/chat/completions", {"messages": HI + [{"role": "function", "name": "f", "content": "42"}],
                              "max_tokens": 1}),
])
def test_schema_valid_bodies_are_served(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text


def test_a_token_array_prompt_is_the_prompt(client):
    one = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2})
    nested = client.post("/v1/completions", json={"prompt": [[5, 6, 7, 8]], "max_tokens": 2})
    assert one.status_code == nested.status_code == 200, nested.text
    assert nested.json()["choices"][0]["text"] == one.json()["choices"][0]["text"]
    error = openai_error(client.post("/v1/completions", json={"prompt": [[5], [6]], "max_tokens": 1}))
    assert error["param"] == "prompt", error


def test_a_field_is_named_by_its_path(client):
    error = openai_error(client.post("/v1/responses", json={"input": 5}))
    assert error["param"] == "input" and "expected a string or an array, got a number" in error["message"], error
    error = openai_error(client.post("/v1/responses", json={"input": {"str": 1}}))  # a key like a union's tag
    assert error["param"] == "input", error
    error = openai_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [5]}]}))
    assert error["param"] == "messages.0.content.0", error
    message = anthropic_error(client.post("/v1/messages", json={"messages": HI}))["message"]
    assert message == "'max_tokens' is required: add it to the request body"


def test_body_not_json_empty_or_too_deep(client):
    r = client.post("/v1/chat/completions", content=b"hello", headers={"content-type": "text/plain"})
    assert "Content-Type: application/json" in openai_error(r)["message"]
    r = client.post("/v1/messages", content=b"", headers={"content-type": "application/json"})
    message = anthropic_error(r)["message"]
    assert "empty" in message and "'messages' and 'max_tokens'" in message, message
    r = client.post("/v1/chat/completions", content=b"[1]", headers={"content-type": "application/json"})
    assert "must be a JSON object" in openai_error(r)["message"]
    deep = {"messages": HI, "max_tokens": 1, "metadata": {}}
    node = deep["metadata"]
    for _ in range(100):
        node["a"] = {}
        node = node["a"]
    error = openai_error(client.post("/v1/chat/completions", json=deep))
    assert "nests deeper than 64" in error["message"] and error["param"].startswith("metadata.a.a"), error
    r = client.post("/v1/chat/completions", content=b"[" * 100000, headers={"content-type": "application/json"})
    assert "nests deeper" in openai_error(r)["message"]


def test_bulk_outside_the_prompt_is_a_413_naming_the_field(client):
    body = {"messages": HI, "max_tokens": 1, "metadata": {"x": "a" * 200_000}}
    error = openai_error(client.post("/v1/chat/completions", json=body), 413)
    assert error["param"] == "metadata" and error["code"] == "request_too_large", error
    assert "context_length_exceeded" not in json.dumps(error) and "shorten the messages" not in error["message"]
    big_prompt = {"messages": [{"role": "user", "content": "a " * 100_000}], "max_tokens": 1}
    error = openai_error(client.post("/v1/chat/completions", json=big_prompt))
    assert error["code"] == "context_length_exceeded", error


def test_a_body_over_the_bound_is_a_413_naming_both_sizes(pair):
    app = create_app(*pair, ServerSettings(model_name="tiny", max_body_bytes=100_000))
    with TestClient(app) as client:
        body = json.dumps({"messages": HI, "max_tokens": 1, "stop": ["x" * 50] * 4000}).encode()
        r = client.post("/v1/messages", content=body, headers={"content-type": "application/json"})
        error = anthropic_error(r, 413)
        assert error["type"] == "request_too_large", error
        assert f"{len(body)} bytes" in error["message"] and "100000 bytes" in error["message"], error
        assert client.post("/v1/messages", json={"messages": HI, "max_tokens": 1}).status_code == 200


def test_a_cut_responses_reply_marks_its_message_incomplete(client):
    body = {"input": "hello there", "max_output_tokens": 1, "temperature": 0}
    reply = client.post("/v1/responses", json=body).json()
    assert reply["status"] == "incomplete"
    messages = [item for item in reply["output"] if item["type"] == "message"]
    assert messages and all(item["status"] == "incomplete" for item in messages), reply["output"]
    with client.stream("POST", "/v1/responses", json=dict(body, stream=True)) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "message"]
    assert done and all(item["status"] == "incomplete" for item in done)


def test_anthropic_message_start_usage_counts_the_cache(client):
    body = {"messages": [{"role": "user", "content": "tell me about caches " * 8}], "max_tokens": 2, "stream": True}
    for _ in range(2):  # the second reads its prompt from the prefix cache
        with client.stream("POST", "/v1/messages", json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    start = events[0]["message"]["usage"]
    final = next(e for e in events if e["type"] == "message_delta")["usage"]
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        assert start[key] == final[key], (start, final)
    assert start["cache_read_input_tokens"] > 0


def _raw_requests(base: str, requests) -> list:
    """Send HTTP/1.1 requests one after another on ONE connection; the status line of each answer (None where
    the connection was closed instead)."""
    host, port = base.split("//")[1].split(":")
    statuses = []
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        reader = sock.makefile("rb")
        for path, body in requests:
            data = json.dumps(body).encode()
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            status = reader.readline()
            if not status:
                statuses.append(None)
                break
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            statuses.append((int(status.split()[1]), json.loads(reader.read(length))))
    return statuses


def test_an_unforeseen_failure_is_answered_in_dialect_and_the_connection_lives(pair, caplog):
    app = create_app(*pair, ServerSettings(model_name="tiny"))
    server = app.state.server
    check_body = server.check_body

    def fails_on_marker(body):
        if getattr(body, "temperature", None) == 0.125:
            raise RuntimeError("a bug nobody foresaw")
        check_body(body)

    server.check_body = fails_on_marker
    uvicorn_log = []
    handler = logging.Handler()
    handler.emit = lambda record: uvicorn_log.append(record)
    logging.getLogger("uvicorn.error").addHandler(handler)
    running = start_in_thread(app)
    try:
        with caplog.at_level(logging.INFO, logger="dflash_mlx.server"):
            answers = _raw_requests(running.base, [
                ("/v1/chat/completions", {"messages": HI, "max_tokens": 1, "temperature": 0.125}),
                ("/v1/messages", {"messages": HI, "max_tokens": 1, "temperature": 0.125}),
                ("/v1/chat/completions", {"messages": HI, "max_tokens": 1}),
            ])
    finally:
        running.stop()
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert [a and a[0] for a in answers] == [500, 500, 200], answers
    assert answers[0][1]["error"]["type"] == "server_error" and "RuntimeError" in answers[0][1]["error"]["message"]
    assert answers[1][1]["type"] == "error" and answers[1][1]["error"]["type"] == "api_error"
    assert "a bug nobody foresaw" not in json.dumps(answers)  # the details stay in the log
    failures = [r for r in caplog.records if "a bug nobody foresaw" in r.getMessage()]
    assert len(failures) == 2 and all("\n" not in r.getMessage() for r in failures), failures
    assert not any(r.exc_info for r in caplog.records if r.levelno >= logging.ERROR)
    assert not any(r.levelno >= logging.ERROR for r in uvicorn_log), [r.getMessage() for r in uvicorn_log]
