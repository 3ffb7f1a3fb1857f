"""The playground page (GET /) in a real headless Chromium: ask, watch the answer stream in,
see each document with its recomputed tokens highlighted, then ask a follow-up in the same conversation."""

from __future__ import annotations

import contextlib
import os
import shutil

import httpx
import pytest

from _serve_util import TINY, one_torch_thread, running_server, tiny_serve_engine  # noqa: F401
from blend.serve.config import ServeConfig
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = make_docs(3, words=30, seed=5)
QUESTION = "which lantern?"
FOLLOW_UP = "and who lit it?"


def chromium_path() -> str | None:
    """Debian's chromium ($KVBLEND_CHROMIUM overrides)."""
    for candidate in (os.environ.get("KVBLEND_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


@contextlib.contextmanager
def playground_page(console: list[str] | None = None):
    """A tiny model's server and a headless Chromium page open on its playground (skips without chromium).

    Args:
        console: where to collect, from before the page loads, its console errors, script errors and
            responses of 400 or more (a missing resource such as /favicon.ico is such a console error).

    Yields:
        (the running server, the page).
    """
    exe = chromium_path()
    if exe is None:
        pytest.skip("no chromium executable (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with running_server(tiny_serve_engine(), ServeConfig(model=TINY)) as srv, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            if console is not None:
                page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: console.append(f"script error: {e}"))
                page.on("response", lambda r: console.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.goto(srv.url + "/")
            page.wait_for_load_state("networkidle")
            yield srv, page
        finally:
            browser.close()


def test_playground_streams_an_answer_and_highlights_recomputed_tokens(one_torch_thread):
    console: list[str] = []  # the page loads and answers without a console error (a /favicon.ico 404 was one)
    with playground_page(console) as (srv, page):
        blocked = []  # the page runs under its Content-Security-Policy: nothing of its own may be refused
        page.on("console", lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None)
        page.reload()
        assert page.title() == "kvblend playground"
        page.fill("#question", QUESTION)
        page.click("#add-doc")
        texts = page.locator(".doc-text")
        assert texts.count() == 3
        for i, doc in enumerate(DOCS):
            texts.nth(i).fill(doc)
        page.select_option("#reuse", "blend")
        page.fill("#ratio", "0.2")  # a near tie on the tiny model: the default guard re-blends at 0.3
        page.fill("#max-tokens", "8")
        page.fill("#temperature", "0")
        page.click("#ask")
        page.wait_for_selector("body[data-done='1']", timeout=60_000)
        assert page.inner_text("#error") == ""
        answer = page.text_content("#answer")
        stats = page.inner_text("#stats")
        boxes = page.locator(".docview")
        shown = [[i for i, cls in enumerate(boxes.nth(d).locator(".tok").evaluate_all(
            "els => els.map(e => e.className)")) if "recomputed" in cls] for d in range(boxes.count())]
        texts_shown = [boxes.nth(d).locator(".tok").evaluate_all("els => els.map(e => e.textContent).join('')")
                       for d in range(boxes.count())]
        # a follow-up: the first question and its answer go along as history
        assert page.is_hidden("#conversation") is False
        history_shown = page.inner_text("#history")
        page.fill("#question", FOLLOW_UP)
        page.click("#ask")
        in_flight = page.is_disabled("#new-conversation")  # the answer joins the conversation it was asked in
        page.wait_for_selector("body[data-done='1']", timeout=60_000)
        assert page.inner_text("#error") == ""
        assert in_flight and page.is_enabled("#new-conversation")
        follow_answer = page.text_content("#answer")
        follow_stats = page.inner_text("#stats")
        page.click("#new-conversation")
        assert page.is_hidden("#conversation")
        api = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": TINY, "messages": [{"role": "user", "content": QUESTION}], "documents": DOCS,
            "max_tokens": 8, "temperature": 0, "kvblend": {"reuse": "blend", "ratio": 0.2}}).json()
        follow = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": TINY, "documents": DOCS, "max_tokens": 8, "temperature": 0,
            "kvblend": {"reuse": "blend", "ratio": 0.2},
            "messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer.strip() or "-"},
                         {"role": "user", "content": FOLLOW_UP}]}).json()
    assert answer == api["choices"][0]["message"]["content"]  # the page shows the API's answer
    assert QUESTION in history_shown and answer.strip() in history_shown
    assert follow_answer == follow["choices"][0]["message"]["content"]  # the follow-up carried the history
    assert f"prompt {follow['usage']['prompt_tokens']} tokens" in follow_stats
    assert "TTFT" in stats and "recomputed" in stats
    guard = api["kvblend"]["report"]["guard"]
    assert guard and f"near-tie guard: {guard}" in stats  # the page says when the guard blended again
    assert f"(spent {api['kvblend']['report']['spent']:.2f} over both passes)" in stats  # and what it spent
    docs = [s for s in api["kvblend"]["report"]["segments"] if s["kind"] == "document"]
    assert shown == [s["recomputed_offsets"] for s in docs]  # exactly the selected rows are highlighted
    assert sum(map(len, shown)) > 0
    assert texts_shown == [d.strip() + "\n\n" for d in DOCS]  # every token of every document is shown
    assert blocked == []
    assert console == []


def test_the_playground_page_cannot_be_framed_and_runs_only_its_own_script(one_torch_thread):
    """No security header: another site framed the page invisibly and a click through it asked with the key the
    user had typed (clickjacking)."""
    from blend.serve.app import PLAYGROUND, playground_headers

    with running_server(tiny_serve_engine(), ServeConfig(model=TINY)) as srv:
        r = httpx.get(srv.url + "/")
    csp = r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY" and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff" and "default-src 'none'" in csp
    assert "'unsafe-inline'" not in csp.split("script-src")[1].split(";")[0]  # its script by hash only
    assert playground_headers(PLAYGROUND.read_text())["Content-Security-Policy"] == csp
    assert "onsubmit=" not in r.text and "onclick=" not in r.text  # inline handlers would be refused


NON_ASCII_DOCS = ["Le phare de Cap Wren est tenu par Orla Brenner, à Tōkyō (東京) depuis 1998. 🗼",
                  "Der Fährmann fährt zweimal täglich zur Möweninsel; im Winter nur samstags."]


def test_playground_shows_errors_and_non_ascii_documents_as_written(one_torch_thread):
    """An error response is shown (not a hang), and a document whose characters span several tokens
    is shown as written, each character once, not as U+FFFD per token."""
    with playground_page() as (_, page):
        texts = page.locator(".doc-text")
        for i, doc in enumerate(NON_ASCII_DOCS):
            texts.nth(i).fill(doc)
        page.fill("#question", "Qui tient le phare ?")
        page.click("#docs-label")  # a heading's text is not the button beside it (a wrapping label made it one)
        assert texts.count() == len(NON_ASCII_DOCS)
        page.fill("#max-tokens", "0")  # a 400 naming max_tokens
        page.click("#ask")
        page.wait_for_selector("body[data-done='1']", timeout=60_000)
        error = page.inner_text("#error")
        page.fill("#max-tokens", "4")
        page.click("#ask")
        page.wait_for_selector("body[data-done='1']", timeout=60_000)
        second_error = page.inner_text("#error")
        boxes = page.locator(".docview")
        texts_shown = [boxes.nth(d).locator(".tok").evaluate_all("els => els.map(e => e.textContent).join('')")
                       for d in range(boxes.count())]
    assert error.startswith("400") and "max_tokens" in error
    assert second_error == ""
    assert texts_shown == [d.strip() + "\n\n" for d in NON_ASCII_DOCS]
    assert all("\ufffd" not in t for t in texts_shown)


def test_the_playground_asks_with_reuse_exact_or_none_after_its_ratio_or_selector_changed(one_torch_thread):
    """The page sent its ratio and selector whatever the Reuse menu said; since the server refuses blend settings
    under reuse "exact" or "none" (a 400 'ratio is a blend option'), picking exact or none after touching the ratio
    or the selector answered nothing but that error. Only a blend sends them (and the page greys them out)."""
    with playground_page() as (_, page):
        page.fill("#max-tokens", "4")
        page.fill("#ratio", "0.3")
        page.select_option("#selector", "v")
        answers = {}
        for reuse in ("exact", "none", "blend"):
            page.select_option("#reuse", reuse)
            page.click("#ask")
            page.wait_for_selector("body[data-done='1']", timeout=60_000)
            answers[reuse] = (page.inner_text("#error"), page.inner_text("#stats"),
                              page.is_disabled("#ratio"), page.is_disabled("#selector"))
    assert answers["exact"][0] == "" and answers["none"][0] == "" and answers["blend"][0] == ""
    assert " · exact · " in answers["exact"][1] and " · none · " in answers["none"][1]
    assert "blend@0.3:v" in answers["blend"][1]  # a blend still sends both
    assert answers["exact"][2:] == answers["none"][2:] == (True, True) and answers["blend"][2:] == (False, False)
