"""The chat page of `dflash-mlx serve` in a real browser: headless Chromium (Debian's chromium and chromium-driver,
installed by .ci/run) driven by selenium, against `dflash-mlx serve` on the tiny demo pair in a subprocess.

A reply streams, Esc stops it and the server goes idle, a reload finds the conversation, every token is marked by
its origin with counts equal to the server's own, a keyed server gets its key asked for, and the page requests
nothing from any host but the server. Skipped (with the reason) only where Chromium or its driver is missing.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from dflash_mlx.demo import make_tiny_pair

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
DRIVER = shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    pytest.skip("Chromium or chromedriver is not installed (apt-get install chromium chromium-driver)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[dev])")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

KEY = "s3cret-key"
WAIT = 90  # seconds a page state may take to arrive on a loaded machine (never asserted as a speed)


def _wait(driver, condition):
    """Wait for a page state (the page re-renders as it streams: an element read a moment ago may be gone)."""
    return WebDriverWait(driver, WAIT, ignored_exceptions=[StaleElementReferenceException]).until(condition)


LONG_REPLY = 10_000_000  # max tokens of the reply Esc stops


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`dflash-mlx serve` on the demo pair, in a subprocess on a free loopback port."""

    def __init__(self, target, drafter, *extra):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dflash_mlx.cli", "serve", "--model", str(target), "--draft", str(drafter),
               "--port", str(self.port), "--served-model-name", "tiny", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read().decode()
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)

    def health(self):
        return httpx.get(self.base + "/health", timeout=10).json()

    def metric(self, name: str, headers=None) -> float:
        text = httpx.get(self.base + "/metrics", headers=headers or {}, timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
                   or line.startswith(name + "{"))

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("page"))


@pytest.fixture(scope="module")
def server(pair):
    served = Served(*pair)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def browser():
    offline = os.environ.get("SE_OFFLINE")
    os.environ["SE_OFFLINE"] = "true"  # selenium must never fetch a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--disable-background-networking", "--disable-component-update", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    try:
        driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    finally:
        if offline is None:
            os.environ.pop("SE_OFFLINE")
        else:
            os.environ["SE_OFFLINE"] = offline
    yield driver
    driver.quit()


def _open(driver, base):
    driver.get(base + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(base + "/")
    _wait(driver, lambda d: d.find_element(By.ID, "model").text.startswith("tiny"))


def _set(driver, element_id, value):
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(str(value))
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)


def _send(driver, text):
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def _watch_streaming(driver):
    """Record the token count the page shows each time it renders a reply still streaming."""
    driver.execute_script("""
        window.seenCounts = [];
        new MutationObserver(() => {
          const el = document.querySelector('article.assistant.streaming .stats');
          if (el) window.seenCounts.push(+el.dataset.drafter + +el.dataset.lookup + +el.dataset.target);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true});
    """)


def _done(driver):
    return not driver.find_elements(By.CSS_SELECTOR, "article.assistant.streaming") and \
        driver.find_element(By.ID, "stop").get_attribute("hidden") is not None


def _last_reply(driver):
    """The last reply as the page keeps it (localStorage), and the counts its stats line shows."""
    stored = driver.execute_script("return JSON.parse(localStorage.getItem('dflash-chat.conversations'))")
    reply = stored[0]["messages"][-1]
    shown = driver.execute_script("""
        const all = document.querySelectorAll('article.assistant .stats'), s = all[all.length - 1];
        return {drafter: +s.dataset.drafter, lookup: +s.dataset.lookup, target: +s.dataset.target};""")
    return reply, shown


def _requested_urls(driver):
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def test_a_reply_streams_with_origin_marks_that_match_the_server(server, browser):
    _open(browser, server.base)
    _set(browser, "max-tokens", 160)
    generated = server.metric("dflash_completion_tokens_total")
    _watch_streaming(browser)
    _send(browser, "The quick brown fox jumps over the lazy dog. The quick brown")
    _wait(browser, _done)
    seen = browser.execute_script("return window.seenCounts")
    reply, shown = _last_reply(browser)
    # It streamed: the page showed the reply growing before it was complete.
    partial = sorted({n for n in seen if 0 < n < 160})
    assert len(partial) >= 2, seen
    # Every token is marked; the page's counts are the server's own for this reply.
    server_counts = reply["stats"]["origin_counts"]
    assert shown == server_counts
    assert sum(shown.values()) == reply["stats"]["completion_tokens"] == 160
    assert server.metric("dflash_completion_tokens_total") - generated == 160
    # Each mark names its token: its tint is that token's origin (tokens markdown turned into nothing, such as
    # whitespace it joined, have no mark).
    marked = browser.execute_script("""
        return [...document.querySelectorAll('article.assistant .body .tok')].map(
            s => [+s.dataset.token, s.className.match(/o-(\\w+)/)[1]]);""")
    names = {"d": "drafter", "l": "lookup", "t": "target"}
    assert marked and all(origin == names[reply["tokens"][i][1]] for i, origin in marked)
    marks = {o: len({i for i, origin in marked if origin == o}) for o in ("drafter", "lookup", "target")}
    assert marks["target"] > 0 and marks["lookup"] > 0  # the demo model repeats: prompt lookup copies it
    assert all(marks[o] <= shown[o] for o in marks) and sum(marks.values()) >= 0.8 * sum(shown.values())
    assert browser.find_element(By.CSS_SELECTOR, "article.assistant .stat-tau").text.startswith("τ")
    assert browser.find_elements(By.CSS_SELECTOR, "article.assistant .histogram .bar")

    # Reload: the conversation is still there, marks and all.
    browser.refresh()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "article.assistant .tok"))
    assert browser.find_element(By.CSS_SELECTOR, ".conv.active .conv-title").text.startswith("The quick brown")
    assert _last_reply(browser)[1] == shown
    assert browser.find_element(By.CSS_SELECTOR, "article.user .body").text.startswith("The quick brown fox")

    # Regenerate: greedy decoding is deterministic, so the same reply comes back.
    first = reply["content"]
    browser.find_element(By.CSS_SELECTOR, "article.assistant .regenerate").click()
    _wait(browser, lambda d: _done(d) and len(d.find_elements(By.CSS_SELECTOR, "article")) == 2
                                       and _last_reply(d)[0].get("finish"))
    assert _last_reply(browser)[0]["content"] == first

    # Edit and resend: the conversation continues from the edited message.
    browser.find_element(By.CSS_SELECTOR, "article.user .edit").click()
    area = browser.find_element(By.CSS_SELECTOR, "article.user .edit-area")
    area.clear()
    area.send_keys("Hello! How are you today?", Keys.ENTER)
    _wait(browser, lambda d: _done(d) and _last_reply(d)[0].get("finish"))
    stored = browser.execute_script("return JSON.parse(localStorage.getItem('dflash-chat.conversations'))")
    assert [m["role"] for m in stored[0]["messages"]] == ["user", "assistant"]
    assert stored[0]["messages"][0]["content"] == "Hello! How are you today?"

    # Nothing was requested from any host but the server.
    urls = _requested_urls(browser)
    assert any(u.endswith("/v1/chat/completions") for u in urls)
    assert [u for u in urls if not (u.startswith(server.base + "/") or u.startswith("data:"))] == []


def _start_a_long_reply(server, browser) -> float:
    """Open the page and start a reply that cannot end before the page stops it, however fast the engine and
    however slow the page (a tiny model's looping text is copied 32 tokens a pass); return once tokens show, with
    the server's count of cancelled generations from before."""
    _open(browser, server.base)
    _set(browser, "max-tokens", LONG_REPLY)
    cancelled = server.metric("dflash_generations_cancelled_total")
    _send(browser, "Tell me a very long story.")
    _wait(browser,
        lambda d: int(d.find_element(By.CSS_SELECTOR, "article.assistant .stats").get_attribute("data-target")) > 0)
    return cancelled


def _server_goes_idle(server, cancelled: float, why: str) -> None:
    deadline = time.monotonic() + WAIT
    while server.health()["running"] or server.health()["waiting"]:
        assert time.monotonic() < deadline, why
        time.sleep(0.1)
    assert server.metric("dflash_generations_cancelled_total") == cancelled + 1


def test_esc_stops_the_reply_and_the_server_goes_idle(server, browser):
    cancelled = _start_a_long_reply(server, browser)
    assert server.health()["running"] == 1
    browser.find_element(By.ID, "input").send_keys(Keys.ESCAPE)
    _wait(browser, _done)
    _server_goes_idle(server, cancelled, "the server kept generating after the page stopped")
    reply, shown = _last_reply(browser)
    assert reply["stopped"] and 0 < sum(shown.values()) < LONG_REPLY
    assert browser.find_element(By.CSS_SELECTOR, "article.assistant .stopped").text == "stopped"


def test_a_reload_while_streaming_keeps_what_had_arrived(server, browser):
    """Reloading the page mid-reply keeps the reply so far, marked "interrupted"; the server stops generating it."""
    cancelled = _start_a_long_reply(server, browser)
    browser.refresh()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "article.assistant .stopped"))
    reply, shown = _last_reply(browser)
    assert reply["stopped"] and reply["interrupted"] and "partial" not in reply
    assert reply["content"] and 0 < sum(shown.values()) < LONG_REPLY
    assert browser.find_element(By.CSS_SELECTOR, "article.assistant .stopped").text == "interrupted"
    assert not browser.find_elements(By.CSS_SELECTOR, "article.assistant.streaming")
    _server_goes_idle(server, cancelled, "the server kept generating after the page went away")


def test_shift_enter_is_a_new_line_and_the_page_fits_a_phone(server, browser):
    _open(browser, server.base)
    box = browser.find_element(By.ID, "input")
    box.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "second line")
    assert box.get_attribute("value") == "first line\nsecond line"
    assert not browser.find_elements(By.CSS_SELECTOR, "article.msg")  # nothing was sent
    box.clear()
    browser.set_window_size(390, 844)
    try:
        sidebar = browser.find_element(By.ID, "sidebar")
        _wait(browser, lambda d: sidebar.rect["x"] + sidebar.rect["width"] <= 1)  # tucked away (it slides)
        composer = browser.find_element(By.ID, "composer")
        assert composer.rect["x"] >= 0 and composer.rect["x"] + composer.rect["width"] <= 390
        assert browser.execute_script("return document.documentElement.scrollWidth") <= 390
        browser.find_element(By.ID, "open-side").click()
        _wait(browser, lambda d: d.find_element(By.ID, "sidebar").rect["x"] >= 0)
        browser.find_element(By.ID, "close-side").click()
    finally:
        browser.set_window_size(1280, 900)


def test_a_keyed_server_gets_its_key_asked_for(pair, browser):
    served = Served(*pair, "--api-key", KEY)
    try:
        browser.get(served.base + "/")
        browser.execute_script("localStorage.clear()")
        browser.get(served.base + "/")
        _wait(browser, lambda d: d.find_element(By.ID, "key-dialog").get_attribute("open"))
        browser.find_element(By.ID, "key-input").send_keys(KEY, Keys.ENTER)
        _wait(browser, lambda d: d.find_element(By.ID, "model").text.startswith("tiny"))
        _set(browser, "max-tokens", 8)
        _send(browser, "Hello")
        _wait(browser, lambda d: _done(d) and d.find_elements(By.CSS_SELECTOR, "article.assistant"))
        reply, shown = _last_reply(browser)
        assert sum(shown.values()) == 8 and not reply.get("error")
        assert served.metric("dflash_requests_total", {"authorization": f"Bearer {KEY}"}) > 0
    finally:
        served.stop()
