"""The web console in a real browser: headless Chromium against a running edge and node.

Debian's ``chromium`` is driven by Playwright's Python client
(``executable_path``: no browser is ever downloaded).  Without chromium or
playwright the tests skip, unless ``CI`` is set (then they fail).  The edge
and its node run in the test's trio run; the browser runs in a worker thread
(Playwright's sync API) and asks the trio side to start or release a request
with ``trio.from_thread``.  The console is reached through
``tests.support.console_harness.serving_console``.

A screenshot of each run is kept: ``console-*.png`` in the test's tmp
directory and, when ``IOPD_ARTIFACTS`` names a directory, copied there.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support.configs import TWO_ECHOES, echo_entry, gateway_yaml, http_provider, node_entry
from tests.support.console_harness import console_app, serving_app, serving_console
from tests.support.gateway import Gateway, http_request, running_gateway
from tests.support.mock_providers import MockOpenAIServer, MockReply, RecordedRequest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
#: How long the browser waits for the page to show a change (ms); a guard, never a measure.
UI_TIMEOUT_MS = 20_000
PROVIDERS = ["echo-1", "slow-1", "echo-2"]


def browser_or_skip() -> Any:
    """Playwright's sync API, or skip (fail under ``CI``) when it or chromium is missing."""
    missing = None
    if not Path(CHROMIUM).exists():
        missing = f"{CHROMIUM} is not installed (Debian package chromium)"
    try:
        from playwright import sync_api
    except ImportError:
        missing = missing or "the playwright package is not installed (the test extra)"
        sync_api = None
    if missing:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return sync_api


class GatedOpenAI(MockOpenAIServer):
    """A provider that holds every chat completion until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = trio.Event()
        self._held: list[MockReply] = []

    def _reply_for(self, req: RecordedRequest) -> MockReply:
        reply = super()._reply_for(req)
        if req.path == "/v1/chat/completions":
            self._held.append(reply)
        return reply

    async def _write_reply(self, conn: Any, stream: trio.abc.Stream, reply: MockReply) -> None:
        if any(held is reply for held in self._held):
            await self.release.wait()
        await super()._write_reply(conn, stream, reply)


def console_yaml(slow_base_url: str) -> str:
    node_a = echo_entry(category=None, capacity=3) + http_provider(
        "slow-1", "openai", slow_base_url, models="[mock-model]", capacity=2
    )
    return gateway_yaml(
        edge_id="edge-console",
        models=TWO_ECHOES + "  - id: slow\n    providers: {slow-1: mock-model}",
        nodes=node_entry("node-a", node_a, alias="rack-1")
        + node_entry("node-b", echo_entry("echo-2", category=None, capacity=2)),
    )


def take_screenshot(page: Any, path: Path, *, full_page: bool = True) -> None:
    """Screenshot ``page`` to ``path``, copied to ``$IOPD_ARTIFACTS`` when it is set."""
    page.screenshot(path=str(path), full_page=full_page)
    target = os.environ.get("IOPD_ARTIFACTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, Path(target) / path.name)


def open_browser(sync_api: Any) -> tuple[Any, Any]:
    """(playwright, browser): Debian's chromium, headless."""
    pw = sync_api.sync_playwright().start()
    browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
    return pw, browser


async def in_browser(sync_api: Any, drive: Callable[[Any, Any], None]) -> None:
    """Run ``drive(browser, expect)`` in a worker thread, the browser closed after it."""

    def run() -> None:
        pw, browser = open_browser(sync_api)
        try:
            drive(browser, sync_api.expect)
        finally:
            browser.close()
            pw.stop()

    await trio.to_thread.run_sync(run)


def open_live_page(browser: Any, url: str, expect: Any, console: list[str] | None = None) -> Any:
    """A desktop-sized page on the console, in a context of its own, once its stream is live.

    ``console`` collects what the page logs (a blocked script or style is logged there).
    """
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    if console is not None:
        page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
    page.goto(url + "/")
    expect(page.locator("#live")).to_have_text("live", timeout=UI_TIMEOUT_MS)
    return page


def expect_buttons(expect: Any, page: Any, provider: str, labels: list[str]) -> None:
    """The provider's row offers exactly these buttons, in this order."""
    buttons = page.locator(f'tr[data-provider="{provider}"] button[data-action]')
    expect(buttons).to_have_text(labels, timeout=UI_TIMEOUT_MS)


def in_flight_cell(page: Any, provider: str) -> Any:
    return page.locator(f'tr[data-provider="{provider}"] [data-field="in-flight"]')


#: The slow calls' prompt: a few blocks of the prefix index.
PROMPT = "wait for it " * 200


async def slow_call(gw: Gateway, results: list[int]) -> None:
    """One chat completion to the gated provider; its HTTP status into ``results``."""
    resp = await http_request(
        gw.host_port,
        "POST",
        "/v1/chat/completions",
        # Long enough for whole blocks of the prefix index (a short prompt records none).
        body={"model": "slow", "messages": [{"role": "user", "content": PROMPT}]},
    )
    results.append(resp.status)


@dataclasses.dataclass
class GatedConsole:
    """A running gateway whose ``slow`` model waits on ``mock``, and its console at ``url``."""

    mock: GatedOpenAI
    gw: Gateway
    url: str
    nursery: trio.Nursery
    #: The HTTP status of each slow call, once it has ended.
    results: list[int] = dataclasses.field(default_factory=list)

    def start_slow_call(self) -> None:
        """From the browser's thread: one chat completion to the gated provider, left waiting."""
        trio.from_thread.run_sync(self.nursery.start_soon, slow_call, self.gw, self.results)

    def release_slow_calls(self) -> None:
        """From the browser's thread: let the gated provider answer."""
        trio.from_thread.run_sync(self.mock.release.set)


@asynccontextmanager
async def gated_console() -> AsyncIterator[GatedConsole]:
    """The gated mock, an edge and node using it, and the console, all stopped on exit."""
    mock = GatedOpenAI()
    async with trio.open_nursery() as nursery:
        await nursery.start(mock.serve)
        async with running_gateway(console_yaml(mock.base_url)) as gw:
            async with serving_console(gw) as url:
                yield GatedConsole(mock, gw, url, nursery)
        nursery.cancel_scope.cancel()


async def test_the_console_shows_every_provider_and_a_request_in_flight_live(
    tmp_path: Path,
) -> None:
    sync_api = browser_or_skip()
    logged: list[str] = []
    with trio.fail_after(90):
        async with gated_console() as console:

            def drive(browser: Any, expect: Any) -> None:
                # Without any script: the server's page names every provider.
                static = browser.new_context(java_script_enabled=False)
                page = static.new_page()
                page.goto(console.url + "/")
                for pid in PROVIDERS:
                    expect(page.locator(f'tr[data-provider="{pid}"] .pid')).to_have_text(pid)
                static.close()

                page = open_live_page(browser, console.url, expect, logged)
                expect(in_flight_cell(page, "slow-1")).to_have_text("0 / 2")
                # The model groups, as `iopd status` lists them.
                slow = page.locator('#groups tr[data-group="slow"]')
                expect(slow.locator('[data-field="providers"]')).to_contain_text(
                    "slow-1 → mock-model"
                )
                expect(slow.locator('[data-field="routing"]')).to_have_text("no fallback")
                expect(slow.locator('[data-field="policy"]')).to_have_text("prefix")
                slow_row = page.locator('tr[data-provider="slow-1"]')
                expect(slow_row.locator('[data-field="index-blocks"]')).to_have_text("0")
                expect(slow_row.locator('[data-field="hit-rate"]')).to_have_text("-")
                expect(page.locator('#groups tr[data-group="echo"] .gp')).to_have_count(2)
                # The stylesheet applied under the admin CSP (no inline style to block).
                header = page.locator("header.top")
                assert header.evaluate("e => getComputedStyle(e).display") == "flex"

                console.start_slow_call()
                expect(in_flight_cell(page, "slow-1")).to_have_text("1 / 2", timeout=UI_TIMEOUT_MS)
                # Its grant recorded the prompt in slow-1's prefix index, shown live.
                expect(slow_row.locator('[data-field="index-blocks"]')).to_have_text(
                    re.compile(r"^[1-9][0-9]*$")
                )
                take_screenshot(page, tmp_path / "console-in-flight.png")

                console.release_slow_calls()
                expect(in_flight_cell(page, "slow-1")).to_have_text("0 / 2", timeout=UI_TIMEOUT_MS)
                usage = page.locator("#usage tr", has_text="slow")
                expect(usage).to_have_count(1, timeout=UI_TIMEOUT_MS)

                page.set_viewport_size({"width": 390, "height": 844})  # a phone
                take_screenshot(page, tmp_path / "console-phone.png")
                page.context.close()

            await in_browser(sync_api, drive)
    assert console.results == [200]
    assert (tmp_path / "console-in-flight.png").stat().st_size > 0
    assert not [line for line in logged if "Content Security Policy" in line], logged


async def test_a_drain_clicked_in_the_browser_lets_the_request_finish(tmp_path: Path) -> None:
    sync_api = browser_or_skip()
    with trio.fail_after(90):
        async with gated_console() as console:

            def drive(browser: Any, expect: Any) -> None:
                page = open_live_page(browser, console.url, expect)
                console.start_slow_call()
                expect(in_flight_cell(page, "slow-1")).to_have_text("1 / 2", timeout=UI_TIMEOUT_MS)
                state = page.locator('tr[data-provider="slow-1"] [data-field="state"]')
                dialog = page.locator("dialog#confirm")
                # Active: Drain and Disable, no Enable.
                expect_buttons(expect, page, "slow-1", ["Drain", "Disable"])
                # A drain asks first; Cancel changes nothing.
                page.click('button[data-action="drain"][data-provider-id="slow-1"]')
                expect(dialog).to_be_visible()
                expect(page.locator("#confirm-title")).to_have_text("Drain provider slow-1?")
                take_screenshot(page, tmp_path / "console-confirm.png", full_page=False)
                page.click("#confirm-cancel")
                expect(dialog).to_be_hidden()
                expect(state).to_have_text("active")
                page.click('button[data-action="drain"][data-provider-id="slow-1"]')
                page.click("#confirm-ok")
                expect(state).to_have_text("draining", timeout=UI_TIMEOUT_MS)
                expect_buttons(expect, page, "slow-1", ["Enable", "Disable"])
                take_screenshot(page, tmp_path / "console-draining.png")

                console.release_slow_calls()
                expect(state).to_have_text("drained", timeout=UI_TIMEOUT_MS)
                expect(in_flight_cell(page, "slow-1")).to_have_text("0 / 2")
                expect_buttons(expect, page, "slow-1", ["Enable", "Disable"])  # no Drain
                expect(page.locator("#notice.notice-error")).to_have_count(0)
                # Enable needs no confirmation: back to active, and Drain again.
                page.click('button[data-action="enable"][data-provider-id="slow-1"]')
                expect(state).to_have_text("active", timeout=UI_TIMEOUT_MS)
                expect_buttons(expect, page, "slow-1", ["Drain", "Disable"])

            await in_browser(sync_api, drive)
    assert console.results == [200]  # the caller saw no error


async def test_a_refused_control_shows_the_error_envelope(tmp_path: Path) -> None:
    """The buttons post JSON to the controls' routes and show an error's message.

    The routes are stubbed here (the runtime controls answer them on the
    admin listener): what the browser sent is recorded, and the answer is an
    OpenAI error envelope that the page must show.
    """
    from quart import Blueprint, request

    sync_api = browser_or_skip()
    posted: list[tuple[str, str, Any]] = []
    stub = Blueprint("controls_stub", __name__)

    @stub.post("/providers/<pid>/state")
    async def provider_state(pid: str) -> Any:
        posted.append((request.path, request.content_type or "", await request.get_json()))
        error = {"message": f"provider {pid} refuses", "type": "invalid_request_error"}
        return {"error": {**error, "param": None, "code": "state_refused"}}, 409

    @stub.post("/nodes/<nid>/drain")
    async def node_drain(nid: str) -> Any:
        posted.append((request.path, request.content_type or "", await request.get_json()))
        return {"node": nid, "providers": []}

    with trio.fail_after(90):
        async with running_gateway(console_yaml("http://127.0.0.1:9")) as gw:
            app = console_app(gw.runtime)
            app.register_blueprint(stub)
            async with serving_app(app) as url:

                def drive(browser: Any, expect: Any) -> None:
                    page = browser.new_page()
                    page.set_default_timeout(UI_TIMEOUT_MS)
                    page.goto(url + "/")
                    page.click('button[data-action="disable"][data-provider-id="echo-2"]')
                    notice = page.locator("#notice.notice-error")
                    expect(notice).to_contain_text(
                        "HTTP 409 state_refused: provider echo-2 refuses"
                    )
                    page.click('button[data-action="node-drain"][data-node-id="node-b"]')
                    expect(page.locator("#confirm-title")).to_have_text(
                        "Drain every provider of node node-b?"
                    )
                    page.click("#confirm-ok")
                    expect(page.locator("#notice.notice-ok")).to_contain_text("node node-b: done")
                    take_screenshot(page, tmp_path / "console-error.png", full_page=False)

                await in_browser(sync_api, drive)
    assert posted == [
        ("/providers/echo-2/state", "application/json", {"state": "disabled"}),
        ("/nodes/node-b/drain", "application/json", {}),
    ]
