"""The web page of `justfit serve` in a real headless Chromium (Debian's /usr/bin/chromium driven by
Playwright): one real server with --api-key, one page load walked through the key prompt, a streamed
reply, resuming the session, and the memory view before and after a tool phase releases the weights."""

import shutil
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server_support import Served

KEY = "web-page-test-key"
PROMPT = "Say hello in three words."


def chromium_path():
    for p in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if p and Path(p).is_file():
            return p
    return None


@pytest.fixture(scope="module")
def served(default_model_dir, tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("web-home"), str(default_model_dir), "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    exe = chromium_path()
    if exe is None:
        pytest.skip("no chromium executable (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


def test_page_key_chat_resume_and_memory(served, browser):
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1280, "height": 860})
    errors, requests = [], []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.set_default_timeout(30_000)

    # The page and its files load without the key; the page asks for it, refuses a wrong one, takes the right one.
    response = page.goto(served.url + "/")
    csp = response.headers.get("content-security-policy", "")
    assert "default-src 'self'" in csp and "unsafe-inline" not in csp.split("script-src")[-1].split(";")[0], csp
    expect(page.locator("#key-form")).to_be_visible()
    assert not errors, errors
    page.fill("#key-input", "wrong")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-error")).to_contain_text("refused")
    assert errors and all("401" in e for e in errors), errors  # Chromium logs the refused request; nothing else
    errors.clear()
    page.fill("#key-input", KEY)
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#model-name")).not_to_be_empty()

    # A message streams a reply and the turn's stats (cached tokens, TTFT) show under it.
    page.fill("#max_tokens", "8")
    page.fill("#temperature", "0")
    page.fill("#prompt", PROMPT)
    page.click("#send")
    reply = page.locator("#transcript .msg.assistant .text").last
    expect(reply).not_to_be_empty()
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#transcript .msg.assistant .stats").last).to_contain_text("TTFT")
    name = page.locator("#session-title").inner_text().removeprefix("Session ").strip()
    assert name.startswith("web-"), name

    # The session list shows the prompt_cache_key session; a new session empties the transcript and
    # resuming brings it back, also when this browser kept no copy (the server's record is read).
    item = page.locator(f'#session-list li[data-session="{name}"]')
    expect(item).to_be_visible()
    page.click("#new-session")
    expect(page.locator("#transcript .msg")).to_have_count(0)
    item.locator("span").click()
    expect(page.locator("#transcript .msg.user .text").first).to_have_text(PROMPT)
    page.click("#new-session")
    page.evaluate("localStorage.clear()")
    item.locator("span").click()
    expect(page.locator("#transcript")).to_contain_text("Say hello")

    # The memory view shows the session's KV; a tool phase (keep_alive 0 releases) shows up in it.
    page.click("#tab-memory")
    row = page.locator(f'#view-memory tr[data-session="{name}"]')
    expect(row).to_be_visible()
    kv = int(row.get_attribute("data-kv-bytes"))
    assert kv > 0, kv
    card = page.locator("#view-memory section.card").first
    phase = card.locator("[data-phase]")
    expect(phase).not_to_have_attribute("data-phase", "tool")
    expect(card.locator('tr[data-component][data-resident="yes"]').first).to_be_visible()
    model = page.locator("#model-name").inner_text()
    auth = {"authorization": f"Bearer {KEY}"}

    def ollama_load(keep_alive):  # Ollama's load call: no prompt; keep_alive says when to release
        r = httpx.post(served.url + "/api/generate", headers=auth, json={"model": model, "keep_alive": keep_alive},
                       timeout=60)
        assert r.status_code == 200, r.text

    # Idle past keep_alive: the server releases the weights and KV into a tool phase, the model stays loaded.
    ollama_load("1s")
    expect(phase).to_have_attribute("data-phase", "tool", timeout=15_000)
    expect(card.locator('tr[data-component][data-resident="yes"]')).to_have_count(0)
    expect(card.locator('tr[data-component][data-resident="no"]').first).to_be_visible()
    # keep_alive 0 unloads it: the view says so (and keeps running) instead of failing on the gone runtime.
    ollama_load(0)
    expect(phase).to_have_attribute("data-phase", "unloaded", timeout=15_000)
    expect(page.locator("#live")).to_have_text("live")

    origin = urlsplit(served.url)[:2]
    outside = [u for u in requests if urlsplit(u)[:2] != origin]
    assert not outside, outside
    assert not errors, errors
    page.close()
