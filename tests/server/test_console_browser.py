"""The console in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`, driven by Selenium)
against real servers in subprocesses. It loads the page, chats from it and sees the answer stream in, watches both
lanes and the transfer move under a small load, takes the screenshot (1280x800), checks a phone-width screen has no
horizontal scroll, and, against an adaptive server with an API key, enters the key the page asks for and sees a
device's role change marked. No CSP violation or script error.

Set NODESERVE_CONSOLE_SCREENSHOT=docs/console.png to write the screenshot where the docs show it."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
DISAGG = 'mode = "disaggregated"\nprefill = ["cpu:0"]\ndecode = ["cpu:1"]'
ADAPTIVE = 'mode = "adaptive"\ndevices = ["cpu:0", "cpu:1"]'


@pytest.fixture(scope="module")
def browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip(f"the browser test needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,800",
                "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _viewport(driver, width: int, height: int, mobile: bool = False) -> None:
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                                   "deviceScaleFactor": 1, "mobile": mobile})


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _lanes(driver) -> dict[str, dict]:
    return driver.execute_script("""
        const out = {};
        for (const l of document.querySelectorAll('.lane')) out[l.dataset.device] = {
            role: l.dataset.role, steps: +l.dataset.steps, decodeRate: +(l.dataset.decodeRate || 0),
            changes: +(l.dataset.roleChanges || 0), changed: l.classList.contains('role-changed'),
            note: l.querySelector('.role-note').textContent};
        return out;""")


def _chat(url: str, content: str, max_tokens: int, key: str | None = None) -> str:
    body = json.dumps({"model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + "/v1/chat/completions", body, headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["message"]["content"]


def _errors(driver) -> list[str]:
    """Script errors and CSP violations the page logged."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _open(driver, url: str, key: str | None = None) -> None:
    from selenium.webdriver.common.by import By

    driver.get("about:blank")  # away from an earlier test's page, whose server is gone
    driver.get_log("browser")  # and what it logged
    _viewport(driver, 1280, 800)
    driver.get(url + "/")
    if key is not None:  # the page asks for it, and sends it in a header from then on
        form = driver.find_element(By.ID, "key-form")
        _wait(form.is_displayed, 10, "the page to ask for the API key")
        assert "needs the API key" in driver.find_element(By.ID, "conn").text
        driver.find_element(By.ID, "key-input").send_keys(key)
        form.submit()
        driver.get_log("browser")  # the feed's 401 before the key, logged by the browser
    _wait(lambda: driver.execute_script("return document.body.dataset.feed") == "live", 30, "the feed to go live")
    _wait(lambda: len(_lanes(driver)) == 2, 10, "two lanes")


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_the_console_chats_and_shows_both_devices_working(browser, make_server, tmp_path):
    from selenium.webdriver.common.by import By

    server = make_server(devices=DISAGG, profile=True)  # the profile: SLO admission predicts each TTFT
    _open(browser, server.url)
    lanes = _lanes(browser)
    assert lanes["cpu:0"]["role"] == "prefill" and lanes["cpu:1"]["role"] == "decode"

    # A chat from the page: the answer grows chunk by chunk, then matches the API's greedy answer.
    question = "Name three primes."
    box = browser.find_element(By.ID, "chat-input")
    box.send_keys(question)
    for field, value in (("chat-temp", "0"), ("chat-max", "40")):
        el = browser.find_element(By.ID, field)
        el.clear()
        el.send_keys(value)
    browser.find_element(By.ID, "chat-send").click()
    lengths = set()

    def done():
        state, text = browser.execute_script("const m = document.querySelector('.msg.assistant');"
                                             "return m ? [m.dataset.state, m.textContent] : [null, '']")
        if text:
            lengths.add(len(text))
        return state if state in ("done", "error") else None
    assert _wait(done, 120, "the chat answer") == "done"
    answer = browser.execute_script("return document.querySelector('.msg.assistant').textContent")
    assert len(lengths) >= 3, lengths  # seen streaming in, not all at once
    assert answer == _chat(server.url, question, 40)
    timing = browser.find_element(By.ID, "chat-timing").text
    assert "TTFT" in timing and "tok/s" in timing and "gap p50" in timing
    assert browser.execute_script("return document.querySelectorAll('.msg.assistant .tok[title]').length") >= 3

    # A small load: both lanes draw new steps, the copy lane too, and requests show where they run.
    before = _lanes(browser)
    # Four short chats and one long prompt (its prefill chunks show on cpu:0 while cpu:1 decodes the others).
    jobs = [(f"Count from {i} to {i + 30}.", 64) for i in range(4)]
    jobs.append(("Summarize this: " + "The quick brown fox jumps over the lazy dog. " * 60, 32))
    threads = [threading.Thread(target=_chat, args=(server.url, text, n)) for text, n in jobs]
    for t in threads:
        t.start()
        time.sleep(0.3)
    seen_states = set()

    def busy():
        seen_states.update(browser.execute_script(
            "return [...document.querySelectorAll('#req-body .state')].map(s => s.textContent)"))
        now = _lanes(browser)
        return now["cpu:0"]["steps"] > before["cpu:0"]["steps"] and now["cpu:1"]["decodeRate"] > 0 \
            and now["cpu:1"]["steps"] > before["cpu:1"]["steps"] and "decode" in seen_states
    _wait(busy, 90, "both lanes to update under load")
    time.sleep(3)  # a fuller picture: the batch decoding, the long prefill, the copies
    shot = tmp_path / "console.png"
    browser.save_screenshot(str(shot))
    for t in threads:
        t.join()
    assert int(browser.execute_script("return document.querySelector('[data-transfer]').dataset.copies || 0")) > 0
    _wait(lambda: "ended" in browser.find_element(By.ID, "req-body").text, 10, "finished requests listed")
    assert browser.find_element(By.ID, "slo-attain").text.endswith("%")
    assert _png_size(shot) == (1280, 800)
    if os.environ.get("NODESERVE_CONSOLE_SCREENSHOT"):
        shutil.copy(shot, os.environ["NODESERVE_CONSOLE_SCREENSHOT"])

    # A phone-width screen: everything in one column, nothing wider than the screen.
    _viewport(browser, 390, 844, mobile=True)
    time.sleep(0.5)
    width, inner = browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
    assert width <= inner, (width, inner)
    assert browser.find_element(By.ID, "chat-input").is_displayed()
    assert _errors(browser) == []


def test_the_console_asks_for_the_key_and_marks_a_role_change_in_adaptive_mode(browser, make_server):
    # A TPOT target of 2 ms makes every prompt "long" (as in test_api's adaptive test): the first request dedicates a
    # device to prefill at once. With an API key, which the page asks for.
    key = "console-test-key"
    server = make_server(f'api_key = "{key}"\n[slo]\ntpot_s = 0.002\n', devices=ADAPTIVE)
    _open(browser, server.url, key)
    assert {lane["role"] for lane in _lanes(browser).values()} == {"adaptive"}
    _chat(server.url, "What is the capital of France?", 8, key)

    def changed():
        lanes = [lane for lane in _lanes(browser).values() if lane["changes"] >= 1]
        return lanes[0] if lanes else None
    lane = _wait(changed, 20, "a role change on the page")
    assert lane["role"] == "prefill" and lane["changed"] and "changed" in lane["note"]
    assert _errors(browser) == []
