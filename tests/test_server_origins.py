"""The server's per-token origins (`"dflash": {"origins": true}`) and the chat page's routes, on the tiny demo pair.

Plain OpenAI clients must see nothing new; a client that asks gets, in each chunk, the text and origin of every
token (drafter, lookup or target), and counts that agree with the reply's own statistics.
"""

import json
import re

import httpx
import pytest

from dflash_mlx import load
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread
from dflash_mlx.server.chat_page import STATIC

PROMPT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. The quick brown"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("origins"))
    model, tokenizer, drafter = load(str(target_dir), str(drafter_dir))
    running = start_in_thread(create_app(model, tokenizer, drafter, ServerSettings(model_name="tiny")))
    yield running
    running.stop()


def _stream(live, **extra):
    body = dict(messages=PROMPT, max_tokens=48, temperature=0, stream=True, **extra)
    chunks = []
    with httpx.stream("POST", live.url + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_plain_clients_see_nothing_new(live):
    chunks = _stream(live)
    *middle, final = chunks
    assert all("dflash" not in c for c in middle)
    assert "origin_counts" not in final["dflash"] and "tokens" not in final["dflash"]
    whole = httpx.post(live.url + "/chat/completions", json=dict(messages=PROMPT, max_tokens=8), timeout=120).json()
    assert "origin_counts" not in whole["dflash"] and "tokens" not in whole["dflash"]


def test_streamed_origins_cover_every_token(live):
    chunks = _stream(live, dflash={"origins": True})
    *middle, final = chunks
    tokens = [t for c in middle for t in c.get("dflash", {}).get("tokens", [])]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in middle)
    stats = final["dflash"]
    assert len(tokens) == stats["completion_tokens"] == 48
    assert "".join(t["text"] for t in tokens) == content  # no stop string: the tokens' text is the reply
    counts = {o: sum(t["origin"] == o for t in tokens) for o in ("drafter", "lookup", "target")}
    assert counts == stats["origin_counts"]
    # Each verify pass commits its accepted drafts, then one token of the target's own; the prompt's pass commits
    # one target token. A last pass the token limit cut may lose its own token and some drafts.
    assert stats["cycles"] <= counts["target"] <= stats["cycles"] + 1
    assert counts["drafter"] + counts["lookup"] <= stats["accepted"]
    if counts["target"] == stats["cycles"] + 1:
        assert counts["drafter"] + counts["lookup"] == stats["accepted"]
    by_source = stats["sources"]
    assert counts["lookup"] <= by_source.get("lookup", {}).get("tokens", 0)
    assert counts["lookup"] > 0  # the demo model repeats itself: prompt lookup copies some of it


def test_whole_response_carries_tokens_and_counts(live):
    body = dict(messages=PROMPT, max_tokens=24, temperature=0, dflash={"origins": True})
    r = httpx.post(live.url + "/chat/completions", json=body, timeout=120).json()
    d = r["dflash"]
    assert "".join(t["text"] for t in d["tokens"]) == r["choices"][0]["message"]["content"]
    assert sum(d["origin_counts"].values()) == len(d["tokens"]) == r["usage"]["completion_tokens"]


@pytest.mark.parametrize("bad", [True, "yes", {"origins": "yes"}])
def test_a_malformed_extension_is_a_400(live, bad):
    r = httpx.post(live.url + "/chat/completions", json=dict(messages=PROMPT, max_tokens=4, dflash=bad), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "dflash"


def test_root_is_the_page_for_browsers_and_json_for_clients(live):
    base = live.url[: -len("/v1")]
    page = httpx.get(base + "/", headers={"accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(base + "/").json()["name"] == "dflash-mlx"
    assert httpx.get(base + "/", headers={"accept": "application/json"}).json()["model"] == "tiny"
    # Everything the page loads is served here: no other host is named in its own files.
    for src in re.findall(r'(?:src|href)="([^"]+)"', page.text):
        assert src.startswith("/static/") or src.startswith("data:"), src
        if src.startswith("/static/"):
            assert httpx.get(base + src).status_code == 200, src
    for name in ("index.html", "app.js", "render.js", "style.css"):
        assert not re.search(r"https?://", (STATIC / name).read_text()), name


def test_vendored_libraries_are_pinned_with_their_licenses():
    vendor = STATIC / "vendor"
    assert "marked v18.2.1" in (vendor / "marked.umd.js").read_text()[:200]
    assert "Highlight.js v11.11.1" in (vendor / "highlight.min.js").read_text()[:200]
    assert "under the MIT license" in (vendor / "marked.LICENSE.md").read_text()
    assert "BSD 3-Clause" in (vendor / "highlight.LICENSE").read_text()
    assert "sourceMappingURL" not in (vendor / "marked.umd.js").read_text()  # no request for a map file


def test_no_lookup_server_never_copies_from_the_context(live, tmp_path):
    """`serve --no-lookup` (and `chat --web --no-lookup`): no pass drafts from the context, the reply unchanged."""
    target_dir, drafter_dir = make_tiny_pair(tmp_path)
    model, tokenizer, drafter = load(str(target_dir), str(drafter_dir))
    off = start_in_thread(create_app(model, tokenizer, drafter, ServerSettings(model_name="tiny", lookup=False)))
    try:
        body = dict(messages=PROMPT, max_tokens=48, temperature=0, dflash={"origins": True})
        with_lookup = httpx.post(live.url + "/chat/completions", json=body, timeout=120).json()
        without = httpx.post(off.url + "/chat/completions", json=body, timeout=120).json()
    finally:
        off.stop()
    assert with_lookup["dflash"]["origin_counts"]["lookup"] > 0  # the prompt invites copies: the test can fail
    assert without["dflash"]["origin_counts"]["lookup"] == 0
    assert without["choices"][0]["message"]["content"] == with_lookup["choices"][0]["message"]["content"]


def test_collapse_is_logged_once_per_server_and_counted(tmp_path, caplog):
    """The random demo drafter's drafts are never accepted: every request collapses, one warning is logged, and
    /metrics counts them all (an agent's session sends hundreds of requests)."""
    import logging

    target_dir, drafter_dir = make_tiny_pair(tmp_path)
    model, tokenizer, drafter = load(str(target_dir), str(drafter_dir))
    # A fixed width drafts every pass, so each request surely sees the collapse; no lookup copies.
    settings = ServerSettings(model_name="tiny", lookup=False, width=4, max_batch=1)
    server = start_in_thread(create_app(model, tokenizer, drafter, settings))
    try:
        with caplog.at_level(logging.WARNING, logger="dflash_mlx"):
            for text in ("hello", "hello there", "good morning"):
                body = dict(messages=[{"role": "user", "content": text}], max_tokens=80, temperature=0)
                assert httpx.post(server.url + "/chat/completions", json=body, timeout=120).status_code == 200
        metrics = httpx.get(server.url.rsplit("/v1", 1)[0] + "/metrics", timeout=30).text
    finally:
        server.stop()
    warnings = [r.getMessage() for r in caplog.records if "acceptance collapsed" in r.getMessage()]
    assert len(warnings) == 1 and "logged once per server" in warnings[0], warnings
    assert "dflash_collapsed_generations_total 3" in metrics.splitlines()
