"""`dflash-mlx serve` against hostile or unlucky input: lone surrogates, prompts far over the context, HEAD
/health, bad --port/--host, seeds MLX cannot take, and SIGTERM while a reply streams.

One server on the tiny demo pair (127.0.0.1) serves the in-process checks; the shutdown check runs the command in
a subprocess. Every request is bounded (small max_tokens, short timeouts)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from dflash_mlx import load
from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("hardening"))


@pytest.fixture(scope="module")
def live(dirs):
    app = create_app(*load(str(dirs[0]), str(dirs[1])), ServerSettings(model_name=MODEL))
    running = start_in_thread(app)
    running.app = app
    yield running
    running.stop()


def _post(live, path: str, raw: bytes, timeout: float = 60) -> httpx.Response:
    return httpx.post(live.base + path, content=raw, headers={"content-type": "application/json"}, timeout=timeout)


def _error_message(path: str, response: httpx.Response) -> str:
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


# A lone surrogate, as a JSON escape (json.dumps would write it the same way); the routes' other fields are fine.
LONE = "\\ud800"
SURROGATES = [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a%sb"}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "system", "content": "%s"}, {"role": "user", "content": "hi"}],'
                             ' "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}],'
                             ' "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop": ["%s"], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": '
                             '[{"type": "function", "function": {"name": "f", "description": "%s"}}]}'),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "%s", "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "hi", "stop": "%s", "max_tokens": 2}'),
    ("/v1/messages", '{"system": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'),
    ("/v1/messages", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}], "max_tokens": 2}'),
    ("/v1/messages", '{"messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["%s"], "max_tokens": 2}'),
    ("/v1/messages/count_tokens", '{"messages": [{"role": "user", "content": "%s"}]}'),
]


@pytest.mark.parametrize("path,template", SURROGATES)
def test_lone_surrogate_is_a_400(live, path, template):
    r = _post(live, path, (template % LONE).encode())
    assert r.status_code == 400, r.text
    assert "surrogate" in _error_message(path, r)
    # A pair of surrogates is one character (U+1F600), and fine.
    assert _post(live, path, (template % "\\ud83d\\ude00").encode()).status_code in (200, 404), template


# The documented rule (dflash_mlx/server/app.py): 8 bytes per token of context plus 16 KiB.
def _byte_limit(live) -> int:
    return 8 * live.app.state.server.context_length + 16 * 1024


@pytest.fixture
def tokenizer_calls(live, monkeypatch):
    """Count the server's tokenizer calls; the next one after `calls["delay"]` is set sleeps that long first."""
    inner = live.app.state.server.tokenizer._tokenizer
    calls = {"n": 0, "delay": 0.0, "started": threading.Event()}
    for name in ("encode", "apply_chat_template"):
        real = getattr(inner, name)

        def counted(*args, _real=real, **kwargs):
            calls["n"] += 1
            calls["started"].set()
            delay, calls["delay"] = calls["delay"], 0.0
            time.sleep(delay)
            return _real(*args, **kwargs)

        monkeypatch.setattr(inner, name, counted)
    return calls


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages",
                                  "/v1/messages/count_tokens"])
def test_prompt_over_the_byte_limit_is_refused_before_tokenizing(live, tokenizer_calls, path):
    text = "a" * (_byte_limit(live) + 1)
    body = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    tic = time.monotonic()
    r = _post(live, path, json.dumps(dict(body, max_tokens=2)).encode())
    assert r.status_code == 400, r.text
    assert time.monotonic() - tic < 5
    assert "bytes" in _error_message(path, r)
    assert tokenizer_calls["n"] == 0


def test_health_answers_during_a_slow_tokenization(live, tokenizer_calls):
    tokenizer_calls["delay"] = 1.5
    slow = threading.Thread(target=_post, args=(live, "/v1/chat/completions",
                                                json.dumps({"messages": HI, "max_tokens": 2}).encode()))
    slow.start()
    try:
        assert tokenizer_calls["started"].wait(30)
        tic = time.monotonic()
        assert httpx.get(live.base + "/health", timeout=30).status_code == 200
        assert time.monotonic() - tic < 1.0, "the event loop was blocked by the tokenizer"
    finally:
        slow.join(60)


def test_head_health(live):
    assert httpx.head(live.base + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("seed", [-1, 2**64, -(2**70)])
def test_seed_out_of_range_is_a_400(live, seed):
    for temperature in (0, 0.7):
        r = httpx.post(live.base + "/v1/chat/completions", timeout=60,
                       json={"messages": HI, "max_tokens": 2, "seed": seed, "temperature": temperature})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "seed" and "2**64-1" in error["message"], error


def test_seed_at_the_edges_is_fine(live):
    for seed in (0, 2**64 - 1):
        r = httpx.post(live.base + "/v1/chat/completions", timeout=60,
                       json={"messages": HI, "max_tokens": 2, "seed": seed, "temperature": 0.7})
        assert r.status_code == 200, r.text


# -- serve's --port / --host, checked before the model loads --------------------------------------------------------
@pytest.fixture
def no_loading(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("dflash_mlx.api.load", load)


def _one_error_line(capsys, *words) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for word in words:
        assert word in lines[0], err
    return lines[0]


@pytest.mark.parametrize("port", ["-1", "70000"])
def test_port_out_of_range(capsys, no_loading, port):
    assert main(["serve", "--port", port]) == 2
    _one_error_line(capsys, "--port")


def test_port_in_use(capsys, no_loading):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    _one_error_line(capsys, "in use", str(port))


@pytest.mark.parametrize("host", ["203.0.113.7", "no-such-host.invalid"])
def test_host_this_machine_cannot_listen_on(capsys, no_loading, host):
    assert main(["serve", "--host", host, "--port", "8080"]) == 2
    _one_error_line(capsys, host)


# -- SIGTERM mid-stream ---------------------------------------------------------------------------------------------
def test_sigterm_ends_streams_cleanly(dirs, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w+b")
    proc = subprocess.Popen([sys.executable, "-m", "dflash_mlx.cli", "serve", "--model", str(dirs[0]), "--draft",
                             str(dirs[1]), "--port", str(port), "--served-model-name", MODEL],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.name
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        lines, tic = [], None
        # As many tokens as the context allows: far more than the worker makes before the signal lands.
        body = {"messages": HI, "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                if len(lines) == 3:
                    proc.send_signal(signal.SIGTERM)
                    tic = time.monotonic()
        assert tic is not None and time.monotonic() - tic < 5, "the stream did not end promptly"
        assert lines[-1] == "[DONE]", lines[-3:]
        final = json.loads(lines[-2])
        assert final["choices"][0]["finish_reason"] == "stop", final
        assert final["dflash"]["finish_reason"] == "cancelled", final
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log.seek(0)
    output = log.read().decode(errors="replace")
    assert "Traceback" not in output and "CancelledError" not in output, output
