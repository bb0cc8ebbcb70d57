"""`dflash-mlx chat --web` as a user runs it: the server comes up on the port, the page's address goes to the
browser ($BROWSER stands in for one here) and GET / answers the chat page."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_chat_web_serves_the_page_and_opens_it(tmp_path):
    target, drafter = make_tiny_pair(tmp_path)
    port = _free_port()
    opened = tmp_path / "opened.txt"
    browser = f"{sys.executable} -c \"import sys; open(sys.argv[1] + '.tmp', 'w').write(sys.argv[2]); " \
              f"__import__('os').replace(sys.argv[1] + '.tmp', sys.argv[1])\" {opened} %s"
    cmd = [sys.executable, "-m", "dflash_mlx.cli", "chat", "--web", "--model", str(target), "--draft", str(drafter),
           "--port", str(port), "--max-tokens", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "BROWSER": browser})
    try:
        deadline = time.monotonic() + 120
        while not opened.exists():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "no browser was opened"
            time.sleep(0.2)
        url = opened.read_text().strip()
        assert url == f"http://127.0.0.1:{port}/"
        page = httpx.get(url, headers={"accept": "text/html"})
        assert page.status_code == 200 and "<title>dflash-mlx chat</title>" in page.text
        r = httpx.post(url + "v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert r.json()["usage"]["completion_tokens"] <= 4  # --max-tokens is the page's default limit
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "chat page: http://127.0.0.1:" in proc.stdout.read().decode()


def test_chat_web_refuses_terminal_only_options(tmp_path, capsys):
    assert main(["chat", "--web", "--history", str(tmp_path / "h.json")]) != 0
    assert "--history and --pipeline are for the terminal chat" in capsys.readouterr().err
