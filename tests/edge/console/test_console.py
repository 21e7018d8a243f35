"""The web console in process: the page, its static files, the event stream, the activity hook.

The page is rendered by the quart test client from a runtime built from a
config (no node connected: the page must still name every provider); the
event stream is read both through the test client and as the generator
itself under ``autojump_clock``; the activity hook is checked through a real
edge and node.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import re
import tomllib
from pathlib import Path

import msgspec
import pytest
import trio

from iopd.config.load import parse_edge_config
from iopd.edge import console
from iopd.edge.admin import AdminLimits, AdminServer
from iopd.edge.console.events import MAX_STREAMS, StreamSlots, StreamTiming, status_events
from iopd.edge.console.view import console_view
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from tests.support.admin import two_node_yaml
from tests.support.console_harness import console_app, serving_app
from tests.support.gateway import http_request, running_gateway, wait_until

PROVIDERS = ["echo-1", "echo-off", "echo-2"]
NODES = ["node-a", "node-b"]
PACKAGE = Path(console.__file__).parent


def runtime() -> EdgeRuntime:
    return EdgeRuntime.create(parse_edge_config(two_node_yaml(), env={}))


def status_events_of(text: str) -> list[dict[str, object]]:
    """The JSON documents of the ``status`` events in an SSE text."""
    found = re.findall(r"^event: status\ndata: (.*)$", text, flags=re.M)
    return [json.loads(doc) for doc in found]


# ------------------------------------------------------------------ the page


async def test_the_page_names_every_provider_and_node_without_any_script() -> None:
    app = console_app(runtime())
    resp = await app.test_client().get("/")
    assert resp.status_code == 200
    assert resp.content_type.startswith("text/html")
    page = await resp.get_data(as_text=True)
    for pid in PROVIDERS:
        assert f'<tr data-provider="{pid}">' in page
    for pid in ("echo-1", "echo-2"):
        assert f'data-provider-id="{pid}"' in page  # its buttons
    # Disabled in the config: no runtime control can turn it on, so no button.
    assert 'data-provider-id="echo-off"' not in page
    assert "disabled in the config" in page
    for nid in NODES:
        assert f'<tr data-node="{nid}">' in page
    assert "edge-admin" in page
    # Nothing connected yet: what the server renders says so.
    # Each provider, each node, and the echo group's two providers.
    assert page.count(">disconnected</span>") == len(PROVIDERS) + len(NODES) + 2
    assert ">disabled</span>" in page  # echo-off, disabled in the config
    assert "0 / 3" in page  # echo-1: in flight / capacity


def _buttons(page: str, pid: str) -> list[str]:
    return re.findall(rf'data-action="(\w+)" data-provider-id="{pid}"', page)


async def test_the_buttons_are_the_controls_that_change_the_state() -> None:
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml()) as gw:  # controls need the nodes
            rt = gw.runtime
            client = console_app(rt).test_client()
            page = await (await client.get("/")).get_data(as_text=True)
            assert _buttons(page, "echo-1") == ["drain", "disable"]  # active: no Enable
            assert page.count('data-action="node-drain"') == 2
            rt.controls.set_state("echo-1", b'{"state": "draining"}')  # nothing in flight
            rt.controls.set_state("echo-2", b'{"state": "disabled"}')
            page = await (await client.get("/")).get_data(as_text=True)
            assert _buttons(page, "echo-1") == ["enable", "disable"]  # drained: no Drain
            assert _buttons(page, "echo-2") == ["enable"]
            # No node has an active provider left: "Drain node" would change nothing.
            assert 'data-action="node-drain"' not in page
            view = console_view(rt)
            assert {p["id"]: (p["state"], p["actions"]) for p in view["providers"]} == {
                "echo-1": ("drained", ["enable", "disable"]),
                "echo-off": ("disabled", []),
                "echo-2": ("disabled", ["enable"]),
            }


async def test_the_model_groups_table_lists_providers_routing_and_queue() -> None:
    text = two_node_yaml().replace(
        "    providers: {echo-1: echo, echo-2: echo}\n",
        "    providers: {echo-1: echo, echo-2: echo}\n"
        "    fallbacks: [spare]\n"
        "    fallback_on_queue_timeout: true\n"
        "  - id: spare\n"
        "    routing: least_load\n"
        "    providers: {echo-2: echo}\n",
    )
    rt = EdgeRuntime.create(parse_edge_config(text, env={}))
    groups = {g["id"]: g for g in console_view(rt)["groups"]}
    assert list(groups) == ["echo", "spare"]
    echo = groups["echo"]
    assert [(p["provider"], p["served"], p["health"]) for p in echo["providers"]] == [
        ("echo-1", "echo", "disconnected"),
        ("echo-2", "echo", "disconnected"),
    ]
    assert echo["routing"] == "fallback when full, unhealthy or queue timeout: spare"
    assert (echo["source"], echo["queued"]) == ("models", 0)
    assert groups["spare"]["routing"] == "no fallback"
    assert (echo["policy"], groups["spare"]["policy"]) == ("prefix", "least_load")
    page = await (await console_app(rt).test_client().get("/")).get_data(as_text=True)
    assert '<tr data-group="echo">' in page
    assert "echo-2 → echo" in page
    assert "fallback when full, unhealthy or queue timeout: spare" in page
    assert re.findall(r'data-field="policy">(\w+)<', page) == ["prefix", "least_load"]


async def test_each_provider_shows_its_prefix_index_size_and_hit_rate() -> None:
    rt = runtime()
    index = rt.pool.scheduler.router.index
    index.record("echo-1", (1, 2, 3))
    index.match((1, 2, 3), ["echo-1", "echo-2"])  # echo-1 holds the head: a hit
    index.match((9,), ["echo-1"])  # a miss
    rows = {p["id"]: p for p in console_view(rt)["providers"]}
    assert (rows["echo-1"]["index_blocks"], rows["echo-1"]["hit_rate"]) == (3, 0.5)
    # Nothing recorded and never looked up: no rate (not a rate of 0).
    assert (rows["echo-2"]["index_blocks"], rows["echo-2"]["hit_rate"]) == (0, None)
    page = await (await console_app(rt).test_client().get("/")).get_data(as_text=True)
    cells = dict(
        re.findall(
            r'<tr data-provider="([\w-]+)">.*?data-field="index-blocks">(\d+)</td>',
            page,
            flags=re.S,
        )
    )
    assert cells == {"echo-1": "3", "echo-off": "0", "echo-2": "0"}
    rates = re.findall(r'data-field="hit-rate">([^<]*)<', page)
    assert rates == ["50%", "-", "-"]


async def test_recent_errors_are_escaped_on_the_page() -> None:
    rt = runtime()
    rt.activity.note(
        "alice", "echo", ok=False, status=400, code="bad", message="<img src=x onerror=1>"
    )
    page = await (await console_app(rt).test_client().get("/")).get_data(as_text=True)
    assert "&lt;img src=x onerror=1&gt;" in page
    assert "<img" not in page


async def test_the_static_files_ship_in_the_package_and_are_served() -> None:
    client = console_app(runtime()).test_client()
    page = await (await client.get("/")).get_data(as_text=True)
    urls = re.findall(r'(?:href|src)="([^"]+)"', page)
    assert sorted(u.rsplit("/", 1)[-1] for u in urls) == ["console.css", "console.js"]
    for url in urls:
        assert url.startswith("/")  # served by the edge, never another origin
        resp = await client.get(url)
        assert resp.status_code == 200, url
        body = await resp.get_data()
        assert body == (PACKAGE / "static" / url.rsplit("/", 1)[-1]).read_bytes()
    assert (await client.get(urls[0])).content_type.split(";")[0] in ("text/css", "text/javascript")


def test_nothing_the_console_ships_refers_to_another_host() -> None:
    shipped = [*PACKAGE.glob("templates/**/*.html"), *PACKAGE.glob("static/*")]
    assert len(shipped) == 3
    for path in shipped:
        text = path.read_text(encoding="utf-8")
        assert "://" not in text, path
        assert not re.search(r"""(?:src|href)=["']//|url\(|@import""", text), path


def test_the_template_and_static_files_are_package_data() -> None:
    """``pip install .`` ships every file the console serves."""
    pyproject = tomllib.loads((PACKAGE.parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["iopd.edge.console"]
    for path in [*PACKAGE.glob("templates/**/*"), *PACKAGE.glob("static/*")]:
        if path.is_file():
            rel = path.relative_to(PACKAGE).as_posix()
            assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), rel


# ------------------------------------------------------------------ /events


async def open_events(url: str) -> trio.SocketStream:
    """A raw ``GET /events`` on hypercorn, read until its first status event."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(f"GET /events HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    seen = b""
    while b"event: status" not in seen:
        seen += await stream.receive_some(65536)
    assert seen.startswith(b"HTTP/1.1 200")
    assert b"text/event-stream" in seen
    return stream


async def test_a_stream_gives_its_slot_back_when_the_client_goes_away() -> None:
    rt = runtime()
    slots = StreamSlots(limit=2)
    with trio.fail_after(10):
        async with serving_app(console_app(rt, slots=slots)) as url:
            stream = await open_events(url)
            assert slots.open == 1
            await stream.aclose()
            await wait_until(lambda: slots.open == 0)


async def test_a_stream_ends_when_the_edge_drains() -> None:
    rt = runtime()
    slots = StreamSlots()
    with trio.fail_after(10):
        async with serving_app(console_app(rt, slots=slots)) as url:
            stream = await open_events(url)
            rt.stopping.set()
            rest = b""
            while not rest.endswith(b"0\r\n\r\n"):  # the chunked body's end
                data = await stream.receive_some(65536)
                assert data, "the server closed without ending the body"
                rest += data
            assert slots.open == 0
            await stream.aclose()


async def test_events_start_with_a_status_event_of_the_console_document() -> None:
    rt = runtime()
    client = console_app(rt).test_client()
    text = ""
    with trio.fail_after(10), trio.CancelScope() as reading:
        async with client.request("/events") as conn:
            await conn.send_complete()
            while "event: status" not in text or not text.endswith("\n\n"):
                text += (await conn.receive()).decode()
            # Leave as a client that goes away would (the test client's own
            # disconnect then waits for a body end that an endless stream never sends).
            reading.cancel()
    assert text.startswith("retry: ")
    (doc,) = status_events_of(text)
    assert [p["id"] for p in doc["providers"]] == PROVIDERS  # type: ignore[index]
    assert doc == msgspec.json.decode(msgspec.json.encode(console_view(rt)))


async def read_until(events: object, count: int) -> list[bytes]:
    """The first ``count`` chunks of an event stream."""
    out = []
    async for chunk in events:  # type: ignore[attr-defined]
        out.append(chunk)
        if len(out) == count:
            break
    return out


async def test_a_change_is_pushed_and_an_unchanged_stream_sends_heartbeats(
    autojump_clock: trio.abc.Clock,
) -> None:
    rt = runtime()
    slots = StreamSlots(limit=1)
    stream = status_events(rt, slots, StreamTiming(tick=0.5, heartbeat=10.0, max_age=3600.0))
    hello, first = await read_until(stream, 2)
    assert hello == b"retry: 2000\n\n"
    assert slots.open == 1
    start = trio.current_time()
    rt.activity.note("alice", "echo", tokens=9)  # the document changes
    (second,) = await read_until(stream, 1)
    assert trio.current_time() - start <= 0.5  # within one tick
    (doc,) = status_events_of(second.decode())
    assert doc["usage"][0]["tokens"] == 9  # type: ignore[index]
    start = trio.current_time()
    (third,) = await read_until(stream, 1)
    assert third == b": heartbeat\n\n"
    assert trio.current_time() - start >= 10.0
    rt.stopping.set()  # the edge drains: the stream ends
    assert await read_until(stream, 1) == []
    assert slots.open == 0


async def test_a_new_stream_displaces_the_oldest_and_ending_streams_are_bounded(
    autojump_clock: trio.abc.Clock,
) -> None:
    rt = runtime()
    slots = StreamSlots(limit=1)
    first = status_events(rt, slots)
    await read_until(first, 2)  # hello and the document
    second = status_events(rt, slots)
    await read_until(second, 2)  # it got in: the first is displaced
    assert slots.open == 2  # the first has not seen it yet
    refused = [chunk async for chunk in status_events(rt, slots)]  # one ending already
    assert len(refused) == 1 and b"retry: 10000" in refused[0]
    rest = [chunk async for chunk in first]  # its next tick: a long retry hint, then the end
    assert rest == [b": displaced by a newer console stream\nretry: 10000\n\n"]
    assert slots.open == 1
    third = status_events(rt, slots)
    await read_until(third, 2)  # room to end again: the second is displaced in turn
    await second.aclose()
    await third.aclose()  # the clients went away: every slot is free
    assert slots.open == 0


async def test_a_stream_ends_at_its_max_age(autojump_clock: trio.abc.Clock) -> None:
    rt = runtime()
    slots = StreamSlots()
    chunks = [
        c async for c in status_events(rt, slots, StreamTiming(tick=1, heartbeat=5, max_age=12))
    ]
    assert chunks[1].startswith(b"event: status")
    assert chunks[2:] == [b": heartbeat\n\n"] * 2
    assert slots.open == 0


# ------------------------------------------------------------------ activity


@pytest.mark.slow
async def test_finished_requests_are_noted_in_the_activity() -> None:
    with trio.fail_after(20):
        async with running_gateway(two_node_yaml()) as gw:
            for model, content, status in (
                ("echo", "one two three", 200),
                ("no-such-model", "x", 404),
            ):
                messages = [{"role": "user", "content": content}]
                body = {"model": model, "messages": messages}
                reply = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)
                assert reply.status == status, model
            view = console_view(gw.runtime)
    usage = {(u["principal"], u["model"]): u for u in view["usage"]}
    assert usage[("unmapped", "echo")]["requests"] == 1
    assert usage[("unmapped", "echo")]["tokens"] > 0
    assert usage[("unmapped", "unknown")]["errors"] == 1  # never the caller's model string
    (error,) = view["errors"]
    assert (error["status"], error["code"], error["model"]) == (404, "model_not_found", "unknown")
    assert error["message"]


# ------------------------------------------------------- viewers that stop reading


async def stalled_viewer(addr: tuple[str, int]) -> trio.socket.SocketType:
    """A ``GET /events`` from a socket with a tiny receive buffer that never reads."""
    sock = trio.socket.socket()
    sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 2048)
    await sock.connect(addr)
    await sock.send(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{addr[1]}\r\n\r\n".encode())
    return sock


async def first_reply(addr: tuple[str, int]) -> bytes:
    """What a reading viewer gets up to its first event, or the whole refusal."""
    stream = await trio.open_tcp_stream(*addr)
    async with stream:
        await stream.send_all(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{addr[1]}\r\n\r\n".encode())
        seen = b""
        while b"event: status" not in seen and b"retry: 10000" not in seen:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            seen += chunk
        return seen


async def churn(rt: EdgeRuntime) -> None:
    """A new failed request every few ms: the document (~20 KB of errors) keeps changing."""
    for n in range(1_000_000):
        rt.activity.note("alice", "echo", ok=False, status=502, code="x", message=f"{n:0300d}")
        await trio.sleep(0.01)


async def test_viewers_that_stop_reading_never_keep_a_new_viewer_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every slot taken by a tab that reads nothing: a new viewer still gets in.

    On the admin listener (``AdminServer``, the shipped ``AdminLimits``): while
    the document does not change the stalled tabs' writes never stall (only
    heartbeats), so a newcomer displaces the oldest; while it changes fast,
    their writes stall and give up after ``stream_send_timeout``, long before a
    plain response's ``send_timeout``.
    """
    limits = AdminLimits()
    assert limits.stream_send_timeout <= 5 < limits.send_timeout
    rt = runtime()
    slots = StreamSlots()
    app = console_app(rt, StreamTiming(tick=0.02, heartbeat=5.0, max_age=600.0), slots)
    stalled: list[trio.socket.SocketType] = []
    caplog.set_level(logging.WARNING, logger="iopd.edge.admin")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server = AdminServer(app, limits=limits)
            addr = await nursery.start(server.serve, "127.0.0.1", 0)
            for _ in range(MAX_STREAMS):
                stalled.append(await stalled_viewer(addr))
            await wait_until(lambda: slots.open == MAX_STREAMS)
            with trio.fail_after(2):  # an idle document: displacement, not a deadline
                reply = await first_reply(addr)
            assert reply.startswith(b"HTTP/1.1 200") and b"event: status" in reply
            await wait_until(lambda: slots.open == MAX_STREAMS - 1)  # the newcomer left
            nursery.start_soon(churn, rt)  # the document changes: the stalled writes fill up
            timed_out = f"event=admin_send_timeout seconds={limits.stream_send_timeout:g}"
            with trio.fail_after(limits.stream_send_timeout + 5):
                await wait_until(lambda: timed_out in caplog.text, interval=0.05)
            reply = await first_reply(addr)
            assert reply.startswith(b"HTTP/1.1 200") and b"event: status" in reply
            server.shutdown()
            nursery.cancel_scope.cancel()
    for sock in stalled:
        sock.close()
