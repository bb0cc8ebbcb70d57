"""`dflash-mlx serve` as a user runs it: a subprocess on a loopback port, answering the openai client."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai

from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_options_fail_before_loading(capsys):
    assert main(["serve", "--prompt-cache-bytes", "lots"]) == 2
    assert "--prompt-cache-bytes 'lots' is not a size" in capsys.readouterr().err
    assert main(["serve", "--chat-template-args", "{not json"]) == 2
    assert "--chat-template-args is not JSON" in capsys.readouterr().err


def test_serve_command(tmp_path):
    target_dir, drafter_dir = make_tiny_pair(tmp_path)
    port = _free_port()
    cmd = [sys.executable, "-m", "dflash_mlx.cli", "serve", "--model", str(target_dir), "--draft", str(drafter_dir),
           "--port", str(port), "--served-model-name", "tiny", "--prompt-cache-bytes", "64MiB", "--max-tokens", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens <= 5 and "dflash" in r.model_extra  # --max-tokens is the default
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode in (0, 1, 130, -signal.SIGINT)
