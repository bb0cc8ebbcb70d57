"""Stopping `dflash-mlx serve` in the middle of a long prefill: SIGTERM and Ctrl-C end the process within 5 s, with
no traceback, and the prompt chunks already done are written to `--prompt-cache-dir`. A prefill chunk cannot be
interrupted, so a chunk that outlasts the stop is left behind (the worker's own tests below hold such a pass with
an event). Also: serving beyond loopback without --api-key says so in one line."""

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import is_loopback, worker as worker_module
from dflash_mlx.server.errors import APIError
from dflash_mlx.server.generation import Delta, GenerationRequest, Outcome
from dflash_mlx.server.prefix_store import PREFIX, SUFFIX, _metadata
from dflash_mlx.server.worker import Job, Worker

PROMPT = [(7 * i) % 300 + 5 for i in range(6000)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("stop"), context=8192)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`dflash-mlx serve` in a subprocess, its stderr collected; `ask` sends the long prompt from a thread."""

    def __init__(self, demo, *args):
        self.port = _free_port()
        target_dir, drafter_dir = demo
        cmd = [sys.executable, "-m", "dflash_mlx.cli", "serve", "--model", str(target_dir), "--draft",
               str(drafter_dir), "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.err: list = []
        self._reader = threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True)
        self._reader.start()
        self.reply = None
        deadline = time.monotonic() + 180
        while not self._get("/health"):
            assert self.proc.poll() is None, "".join(self.err)
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)

    def _get(self, path):
        try:
            r = httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=5)
            return r.text if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def ask_in_background(self) -> None:
        def ask():
            try:
                self.reply = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", timeout=300,
                                        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4}).status_code
            except httpx.HTTPError as e:
                self.reply = e

        self._asker = threading.Thread(target=ask, daemon=True)
        self._asker.start()
        deadline = time.monotonic() + 120
        while "queue_running 1" not in (self._get("/metrics") or ""):  # the prefill has begun
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.err)
            time.sleep(0.05)

    def stop(self, sig) -> float:
        """Send `sig`; seconds until the process ended."""
        tic = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        took = time.monotonic() - tic
        self._reader.join(10)
        self._asker.join(30)  # the reply (or the dropped connection) has been seen
        return took

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def test_sigterm_mid_prefill_exits_fast_and_keeps_the_chunks_done(demo, tmp_path):
    served = Served(demo, "--prefill-step-size", "256", "--prompt-cache-dir", str(tmp_path))
    served.ask_in_background()
    time.sleep(0.3)  # a few chunks in
    took = served.stop(signal.SIGTERM)
    assert took <= 5.0, served.stderr
    assert "Traceback" not in served.stderr and "terminate called" not in served.stderr, served.stderr
    assert served.proc.returncode in (0, -signal.SIGTERM), served.stderr
    assert "api-key" not in served.stderr  # loopback: no warning
    assert served.reply in (200, 503)
    # The chunks prefilled before the signal are on disk: a prefix of the prompt, whole chunks of it.
    files = list(tmp_path.glob(f"{PREFIX}*{SUFFIX}"))
    if "not waiting for it" not in served.stderr:  # a chunk outlasting the stop leaves nothing to flush
        (path,) = files
        key = [int(t) for t in _metadata(path)["key"].strip("[]").split(",")]
        assert len(key) >= 256 and len(key) % 256 == 0 and key == PROMPT[: len(key)]


def test_ctrl_c_mid_prefill_exits_fast_without_a_traceback(demo):
    """Default 2048-token chunks: on a slow machine the one in flight outlasts the stop and is left behind."""
    served = Served(demo, "--host", "0.0.0.0")
    warnings = [line for line in served.stderr.splitlines() if "without --api-key" in line]
    assert len(warnings) == 1, served.stderr
    served.ask_in_background()
    took = served.stop(signal.SIGINT)
    assert took <= 5.0, served.stderr
    assert "Traceback" not in served.stderr and "terminate called" not in served.stderr, served.stderr
    assert served.proc.returncode == 130, served.stderr
    assert served.reply in (200, 503)


def test_loopback_addresses():
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "localhost", "::1"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.10", "example.com", ""]))


# -- the worker, a pass held open by the test ---------------------------------------------------------------------

class HeldPass:
    """A generator whose run yields `deltas` events at once, then blocks in its next "pass" until released."""

    cache = None

    def __init__(self, deltas: int):
        self.deltas, self.release, self.entered = deltas, threading.Event(), threading.Event()
        self.flushed = []

    def run(self, request, should_stop):
        for _ in range(self.deltas):
            yield Delta("x", [1])
        self.entered.set()
        self.release.wait(60)
        yield Outcome("cancelled", len(request.prompt), self.deltas, 0, 0, {})

    def persist(self, deadline):
        self.flushed.append(deadline)


@pytest.mark.parametrize("deltas", [0, 2])
def test_a_pass_outlasting_the_stop_is_answered_and_left_behind(deltas, monkeypatch, caplog):
    """Before any event the client gets a 503; after some, a cancelled Outcome counting what it got. `stop`
    returns while the pass still runs (one line), and the pass's late events go nowhere."""
    monkeypatch.setattr(worker_module, "ANSWER_AFTER_S", 0.0)
    caplog.set_level(logging.WARNING, "dflash_mlx")
    gen = HeldPass(deltas)
    worker = Worker(gen, on_exit=gen.persist)
    worker.stop_by_s = 0.0  # as `dflash-mlx serve` bounds it (to worker.STOP_BY_S)

    async def scenario():
        job = Job(GenerationRequest(prompt=[1, 2, 3], max_tokens=8), asyncio.get_running_loop())
        worker.submit(job)
        got = [await job.next() for _ in range(deltas)]
        await asyncio.get_running_loop().run_in_executor(None, gen.entered.wait, 60)
        worker.shutdown()
        try:
            last = await asyncio.wait_for(job.next(), 60)
        except APIError as e:
            last = e
        return job, got, last

    job, got, last = asyncio.run(scenario())
    if deltas:
        assert [d.tokens for d in got] == [[1]] * deltas
        assert isinstance(last, Outcome) and last.finish_reason == "cancelled"
        assert last.completion_tokens == deltas and last.prompt_tokens == 3
    else:
        assert isinstance(last, APIError) and last.status == 503
    worker.stop()
    assert worker.alive and job.ended
    assert any("still busy" in m for m in caplog.messages)
    gen.release.set()  # the pass ends; the worker flushes and leaves
    worker._thread.join(30)
    assert not worker.alive and len(gen.flushed) == 1 and gen.flushed[0] is not None
