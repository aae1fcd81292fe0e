"""The chat page at ``/`` (issue 30), in a real browser: headless chromium driven by selenium
against ``superfluid serve --runtime toy`` (slowed to ~50 tokens/s, so that streaming and
stopping are seen) and once against the default model, which also takes the README's
screenshot (``SUPERFLUID_WEB_UI_SCREENSHOT=docs/web_ui.png`` writes it there).

The page is checked as a person uses it (typing, Enter, the Stop button, a reload), and
what it shows is compared with what the API answers to the same request directly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from browser_helpers import chromium, wait_for
from serve_helpers import ROOT, Server

from superfluid import web

# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def toy():
    s = Server("--runtime-arg", "step_delay=0.02")  # one token per ~20 ms
    yield s
    s.cleanup()


@pytest.fixture(scope="module")
def browser():
    d = chromium()
    yield d
    d.quit()


def open_page(d, base: str) -> None:
    """The page with nothing stored: each test starts from a first visit."""
    d.get(base + "/")
    d.execute_script("localStorage.clear()")
    d.get(base + "/")
    wait_for(lambda: d.execute_script("return document.getElementById('model').textContent") not in ("", "…"),
             what="the model name")


def fill(d, id_: str, value: str) -> None:
    """A setting's value, as typing it would leave it (its input event fires)."""
    d.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                     "e.dispatchEvent(new Event('input')); e.dispatchEvent(new Event('change'));", id_, value)


def type_message(d, text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = d.find_element(By.ID, "input")
    box.click()
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


_LAST = """
const all = document.querySelectorAll('#messages .msg.assistant');
const m = all[all.length - 1];
if (!m) return null;
return {state: m.dataset.state, text: m.querySelector('.content').textContent,
        stats: m.querySelector('.stats').textContent, data: Object.assign({}, m.querySelector('.stats').dataset),
        error: m.querySelector('.error').textContent, count: all.length};
"""


def last_answer(d) -> dict | None:
    return d.execute_script(_LAST)


def finished(d, n: int, timeout: float = 30.0) -> dict:
    """The n-th answer once it has stopped streaming."""
    def done():
        a = last_answer(d)
        return a if a and a["count"] == n and a["state"] != "streaming" else None

    return wait_for(done, timeout, what=f"answer {n} to finish")


def watch_stream(d, n: int, timeout: float = 60.0) -> tuple[list[int], dict]:
    """The n-th answer's text lengths seen while it streamed (one per poll), and the answer at its end."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        a = last_answer(d)
        if a and a["count"] == n:
            if a["state"] != "streaming":
                return seen, a
            seen.append(len(a["text"]))
        time.sleep(0.01)
    raise AssertionError(f"answer {n} still streaming after {timeout:.0f} s")


def direct(base: str, messages: list[dict], **fields) -> tuple[str, dict]:
    """The same chat request straight to the API, streamed: (text, usage)."""
    body = {"model": httpx.get(base + "/v1/models").json()["data"][0]["id"], "messages": messages, "stream": True,
            "stream_options": {"include_usage": True}, **fields}
    text, usage = "", None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for c in event["choices"]:
                text += c["delta"].get("content") or ""
    return text, usage


def metric(base: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(base + "/metrics").text, re.M)
    assert m, f"no {name} in /metrics"
    return float(m.group(1))


# ------------------------------------------------------------------ served files (no browser)


def test_page_and_assets_are_served_and_self_contained(toy):
    r = httpx.get(toy.base + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<script src="/web/app.js"' in r.text and 'href="/web/style.css"' in r.text
    for name, media_type in web.ASSETS.items():
        a = httpx.get(f"{toy.base}/web/{name}")
        assert a.status_code == 200 and a.headers["content-type"] == media_type
        assert a.content == (web.HERE / name).read_bytes()
    for name in ["index.html", *web.ASSETS]:  # no CDN: nothing is loaded from another host
        assert not re.search(r"https?://", (web.HERE / name).read_text()), name
    assert httpx.get(toy.base + "/web/__init__.py").status_code == 404  # only the named files


def test_the_page_ships_as_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert set(data["superfluid.web"]) == {"index.html", *web.ASSETS}


def test_no_web_ui_turns_the_page_off_and_the_api_is_the_same(toy):
    off = Server("--no-web-ui")
    try:
        r = httpx.get(off.base + "/")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert httpx.get(off.base + "/web/app.js").status_code == 404
        assert httpx.get(off.v1 + "/models").json()["data"][0]["id"] == "toy"
        # the page adds no API: the schema is the same with it and without it
        assert httpx.get(off.base + "/openapi.json").json() == httpx.get(toy.base + "/openapi.json").json()
    finally:
        off.cleanup()


# ------------------------------------------------------------------ in the browser, on the toy model


def test_a_streamed_answer_appears_token_by_token_with_its_stats(toy, browser):
    open_page(browser, toy.base)
    assert browser.find_element("id", "model").text == "toy"  # from /v1/models
    fill(browser, "temperature", "0")
    fill(browser, "max-tokens", "40")
    type_message(browser, "Hello there")
    seen, a = watch_stream(browser, 1)
    growing = sorted({n for n in seen if n > 0})
    assert len(growing) >= 2, f"the text did not grow while streaming: {seen}"
    assert a["state"] == "done" and a["error"] == ""
    text, usage = direct(toy.base, [{"role": "user", "content": "Hello there"}], temperature=0, max_tokens=40)
    assert a["text"] == text and len(text) > growing[0]
    s = a["data"]
    assert int(s["tokens"]) == usage["completion_tokens"] and int(s["prompt"]) == usage["prompt_tokens"]
    assert float(s["ttftMs"]) > 0 and float(s["tps"]) > 0
    assert f"{usage['completion_tokens']} tokens" in a["stats"] and "to first token" in a["stats"]
    assert "tokens/s" in a["stats"] and "from the prefix cache" in a["stats"]


def test_the_settings_are_sent_and_a_follow_up_is_served_from_the_prefix_cache(toy, browser):
    open_page(browser, toy.base)
    for id_, value in {"system": "Be brief.", "temperature": "0.9", "top-p": "0.8", "seed": "11",
                       "max-tokens": "12"}.items():
        fill(browser, id_, value)
    type_message(browser, "Tell me a story")
    a = finished(browser, 1)
    kw = dict(temperature=0.9, top_p=0.8, seed=11, max_tokens=12)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    text, _ = direct(toy.base, history, **kw)
    assert a["text"] == text  # the same seeded sample: every setting reached the request
    type_message(browser, "Go on")
    b = finished(browser, 2)
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on"}]
    assert b["text"] == direct(toy.base, history, **kw)[0]
    assert int(b["data"]["cached"]) > 0, b  # the first turn's prompt came from the prefix cache
    assert f"{b['data']['cached']} of {b['data']['prompt']} prompt tokens" in b["stats"]


def test_stop_ends_a_long_answer_mid_stream_and_frees_the_lane(toy, browser):
    open_page(browser, toy.base)
    fill(browser, "max-tokens", "400")  # ~8 s at the toy's pace, if nothing stopped it
    fill(browser, "extra", '{"ignore_eos": true}')
    type_message(browser, "Write a long essay")
    wait_for(lambda: len((last_answer(browser) or {}).get("text", "")) > 20, what="some text")
    assert metric(toy.base, "superfluid_running_requests") == 1  # the answer holds a lane
    browser.find_element("id", "stop").click()
    a = finished(browser, 1, timeout=5)
    assert a["state"] == "stopped" and "stopped" in a["stats"]
    # A dropped chat stream waits --stream-grace (5 s) for its client to resume it, then is aborted.
    wait_for(lambda: metric(toy.base, "superfluid_running_requests") == 0, timeout=5 + 5,
             what="the server to free the lane")
    ticks = metric(toy.base, "superfluid_ticks_total")
    time.sleep(0.3)
    assert metric(toy.base, "superfluid_ticks_total") == ticks  # nothing runs on for the closed request
    assert last_answer(browser)["text"] == a["text"]
    assert 0 < int(a["data"]["tokens"]) < 400
    assert browser.find_element("id", "send").is_displayed()  # ready for the next message
    fill(browser, "max-tokens", "8")
    type_message(browser, "Shorter, please")  # the stopped text is part of the conversation
    assert finished(browser, 2)["state"] == "done"


def test_a_reload_finds_the_conversation_and_new_chat_starts_another(toy, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, toy.base)
    fill(browser, "max-tokens", "16")
    fill(browser, "temperature", "0")
    type_message(browser, "Remember me")
    first = finished(browser, 1)
    browser.refresh()
    wait_for(lambda: last_answer(browser), what="the stored conversation")
    assert last_answer(browser)["text"] == first["text"] and last_answer(browser)["stats"] == first["stats"]
    assert browser.find_element(By.CSS_SELECTOR, "#messages .msg.user .content").text == "Remember me"
    assert browser.find_element("id", "temperature").get_attribute("value") == "0"  # settings kept too
    browser.find_element("id", "new-chat").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#messages .msg") == []
    type_message(browser, "Another topic")
    finished(browser, 1)
    browser.refresh()
    titles = [e.text for e in wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#conversations .open"))]
    assert titles == ["Another topic", "Remember me"]
    browser.find_elements(By.CSS_SELECTOR, "#conversations .open")[1].click()
    assert last_answer(browser)["text"] == first["text"]


# The toy answers with exactly this text (a regex grammar, through the page's extra fields):
# markup and a fenced block that would run script if it were ever inserted as HTML.
HOSTILE = ("Look: <script>window.__pwned=1</script> `<i>x</i>` <img src=x onerror=window.__pwned=2>\n"
           "```html\n<b>bold</b>\n```\nend")


def test_an_answer_with_markup_is_shown_as_text_and_code_as_code(toy, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, toy.base)
    regex = HOSTILE.replace(".", "\\.").replace("\n", "\\n")  # its only regex-special characters
    fill(browser, "extra", json.dumps({"response_format": {"type": "regex", "regex": regex}}))
    fill(browser, "max-tokens", "200")
    type_message(browser, "<img src=y onerror=window.__pwned=3>")
    a = finished(browser, 1)
    assert a["state"] == "done", a
    shown = browser.execute_script(
        "return Array.from(document.querySelectorAll('#messages .msg.assistant .content > *'))"
        ".map(e => [e.tagName, e.textContent, e.firstChild && e.firstChild.dataset ? e.firstChild.dataset.lang : null])")
    prose = "Look: <script>window.__pwned=1</script> <i>x</i> <img src=x onerror=window.__pwned=2>\n"
    assert shown == [["SPAN", prose, None], ["PRE", "<b>bold</b>", "html"], ["SPAN", "end", None]]
    inline = browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant span > code")
    assert [e.get_attribute("textContent") for e in inline] == ["<i>x</i>"]
    assert browser.find_elements(By.CSS_SELECTOR, "#messages script, #messages img, #messages b, #messages i") == []
    assert browser.find_element(By.CSS_SELECTOR, "#messages .msg.user .content").text.startswith("<img src=y")
    assert browser.execute_script("return window.__pwned") is None  # nothing ran
    browser.refresh()  # nor from storage
    wait_for(lambda: last_answer(browser), what="the stored conversation")
    assert browser.find_elements(By.CSS_SELECTOR, "#messages script, #messages img, #messages b, #messages i") == []
    assert browser.execute_script("return window.__pwned") is None


def _serve_has_api_key() -> bool:
    exe = Path(sys.executable).with_name("superfluid")
    out = subprocess.run([str(exe), "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    return "--api-key" in out


def test_with_an_api_key_the_page_asks_for_it_and_sends_it(browser):
    if not _serve_has_api_key():
        pytest.skip("superfluid serve has no --api-key yet")
    s = Server("--api-key", "sekret-key")
    try:
        assert httpx.get(s.base + "/").status_code == 200  # the page itself needs no key
        assert all(httpx.get(f"{s.base}/web/{n}").status_code == 200 for n in web.ASSETS)
        assert httpx.get(s.v1 + "/models").status_code == 401
        browser.get(s.base + "/")
        wait_for(lambda: browser.find_element("id", "auth").is_displayed(), what="the page to ask for the key")
        assert browser.find_element("id", "model").text == "needs an API key"
        browser.find_element("id", "auth-key").send_keys("sekret-key")
        browser.find_element("id", "auth-save").click()
        wait_for(lambda: browser.find_element("id", "model").text == "toy", what="the model with the key")
        fill(browser, "max-tokens", "8")
        type_message(browser, "Hello with a key")
        assert finished(browser, 1)["state"] == "done"
        browser.refresh()  # the key is kept
        wait_for(lambda: browser.find_element("id", "model").text == "toy", what="the model after a reload")
        assert not browser.find_element("id", "auth").is_displayed()
        fill(browser, "api-key", "wrong")
        type_message(browser, "Hello with a wrong key")
        a = finished(browser, 2)
        assert a["state"] == "error" and a["error"].startswith("401")
        assert browser.find_element("id", "auth").is_displayed()
    finally:
        s.cleanup()


# ------------------------------------------------------------------ once on the default model


@pytest.mark.slow
def test_the_default_model_streams_stops_and_is_photographed(browser, tmp_path):
    s = Server(runtime="torch", ready_timeout=300)
    try:
        open_page(browser, s.base)
        fill(browser, "temperature", "0")
        fill(browser, "max-tokens", "120")
        # a few sentences: this model writes ~150 tokens/s here, a one-line answer is gone between two polls
        question = "Tell me about Paris in three sentences."
        type_message(browser, question)
        seen, a = watch_stream(browser, 1)
        assert len({n for n in seen if n > 0}) >= 2, seen
        text, usage = direct(s.base, [{"role": "user", "content": question}], temperature=0, max_tokens=120)
        assert a["state"] == "done" and a["text"] == text and "Paris" in text
        assert int(a["data"]["tokens"]) == usage["completion_tokens"]
        type_message(browser, "Write Python code to reverse a string.")
        b = finished(browser, 2, timeout=120)
        assert int(b["data"]["cached"]) > 0  # the first turn came from the prefix cache
        code = browser.find_elements("css selector", "#messages .msg.assistant pre > code")
        assert code and code[-1].get_attribute("data-lang") == "python" and "def " in code[-1].text, b["text"]
        # a long answer stopped mid-stream frees the lane
        fill(browser, "max-tokens", "400")
        browser.find_element("id", "new-chat").click()
        type_message(browser, "Tell me a long story about a dragon.")
        wait_for(lambda: len((last_answer(browser) or {}).get("text", "")) > 30, timeout=60, what="some text")
        browser.find_element("id", "stop").click()
        assert finished(browser, 1, timeout=10)["state"] == "stopped"
        wait_for(lambda: metric(s.base, "superfluid_running_requests") == 0, timeout=5, what="the lane freed")
        browser.find_elements("css selector", "#conversations .open")[1].click()  # back to the first chat
        browser.set_window_size(1280, 1000)
        browser.execute_script("document.getElementById('messages').scrollTop = 0")
        shot = Path(os.environ.get("SUPERFLUID_WEB_UI_SCREENSHOT") or tmp_path / "web_ui.png")
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        s.cleanup()
