#!/usr/bin/env python3
"""Benchmark iopd.http.server against a raw trio TCP server answering the same bytes.

With ``--frameworks`` the same run also measures quart-trio on hypercorn's
trio worker, a plain ASGI app on the same worker, and the same quart-trio
app on iopd's admin server (``iopd/edge/admin/serve.py``: hypercorn's worker
classes behind iopd's accept loop, with the pitfall fixes), and probes each server for the two connection
pitfalls a public listener cannot have: a ``Connection: close`` request must
end with the server closing the socket, and an idle keep-alive connection
must be closed after the server's idle timeout (5 s for every server here).
This is the measurement behind "why no web framework on the public
listener" in docs/ARCHITECTURE.md and docs/performance.md.

Each server runs in its own subprocess; this process drives it with a tiny
keep-alive HTTP/1.1 load generator on trio (``--concurrency`` connections,
bounded by ``--requests`` and ``--duration``), POSTing a ~300-byte JSON body.
The server's CPU time is read from ``/proc/<pid>/stat`` (utime + stime) before
and after the measured run, so the figure is CPU per request of the server
process alone.  The "direct" baseline parses just enough HTTP to find the end
of the request and writes a canned response: it is the floor any HTTP layer on
trio can reach on this machine.

    .venv/bin/python scripts/bench_http.py [--requests 20000] [--concurrency 32] [--frameworks]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

import trio
from bench_gateway import read_request

REQUEST_BODY = (
    b'{"model":"qwen3.6:35b","messages":[{"role":"system","content":"You are a helpful '
    b'assistant."},{"role":"user","content":"Write one sentence about the sea, please, and '
    b'keep it short."}],"stream":false,"temperature":0.7,"max_tokens":64,"metadata":'
    b'{"team":"bench","workspace":"/srv/bench"},"user":"bench-user-0001"}'
)
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/json\r\nAuthorization: Bearer bench-token\r\n"
    b"Content-Length: " + str(len(REQUEST_BODY)).encode() + b"\r\n\r\n" + REQUEST_BODY
)
RESPONSE_BODY = b'{"id":"chatcmpl-1","object":"chat.completion","choices":[],"usage":null}'
DIRECT_RESPONSE = (
    b"HTTP/1.1 200 \r\nserver: direct\r\ncontent-type: application/json\r\n"
    b"content-length: " + str(len(RESPONSE_BODY)).encode() + b"\r\n\r\n" + RESPONSE_BODY
)


# ------------------------------------------------------------------ servers


async def _serve_iopd() -> None:
    from iopd.edge.openai.outgoing.error_envelope import render_error
    from iopd.http.server import HttpLimits, Request, Responder, serve_http

    async def handler(request: Request, responder: Responder) -> None:
        await responder.send(200, [("content-type", "application/json")], RESPONSE_BODY)

    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(
            lambda task_status: serve_http(
                handler,
                "127.0.0.1",
                0,
                limits=HttpLimits(idle_timeout=IDLE_TIMEOUT),
                render_error=render_error,
                task_status=task_status,
            )
        )
        print(port, flush=True)


async def _serve_direct() -> None:
    async def handle(stream: trio.SocketStream) -> None:
        buf = bytearray()
        try:
            while await read_request(stream, buf) is not None:
                await stream.send_all(DIRECT_RESPONSE)
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(stream)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(handle, listeners)


#: Idle keep-alive timeout given to every server in the pitfall probe.
IDLE_TIMEOUT = 5.0


async def _serve_quart() -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve
    from quart import Response
    from quart_trio import QuartTrio

    app = QuartTrio("bench")

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        return Response(RESPONSE_BODY, content_type="application/json")

    await _serve_hypercorn(app, serve, Config)


async def _serve_admin() -> None:
    """The same quart-trio app on iopd's admin server (iopd/edge/admin/serve.py)."""
    from quart import Response
    from quart_trio import QuartTrio

    from iopd.edge.admin.serve import AdminLimits, AdminServer

    app = QuartTrio("bench")

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        return Response(RESPONSE_BODY, content_type="application/json")

    server = AdminServer(app, limits=AdminLimits(keep_alive_timeout=IDLE_TIMEOUT))
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(server.serve, "127.0.0.1", 0)
        print(port, flush=True)


async def _serve_asgi() -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        while (await receive()).get("more_body"):
            pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(RESPONSE_BODY)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": RESPONSE_BODY})

    await _serve_hypercorn(app, serve, Config)


async def _serve_hypercorn(app: object, serve: object, config_cls: type) -> None:
    config = config_cls()
    config.bind = ["127.0.0.1:0"]
    config.keep_alive_timeout = IDLE_TIMEOUT
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(app, config, task_status=task_status))  # type: ignore[operator]
        print(binds[0].rsplit(":", 1)[1], flush=True)


# ------------------------------------------------------------------ client


@dataclass
class Tally:
    done: int = 0
    errors: int = 0


async def _client(port: int, tally: Tally, budget: list[int], deadline: float) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    buf = bytearray()
    try:
        while budget[0] > 0 and trio.current_time() < deadline:
            budget[0] -= 1
            await stream.send_all(REQUEST)
            end = -1
            while (end := buf.find(b"\r\n\r\n")) < 0:
                data = await stream.receive_some(65536)
                if not data:
                    raise ConnectionError("server closed")
                buf += data
            head = bytes(buf[:end]).lower()
            if not head.startswith(b"http/1.1 200"):
                tally.errors += 1
            i = head.find(b"content-length:")
            eol = head.find(b"\r\n", i)
            length = int(head[i + 15 : eol if eol >= 0 else None])
            total = end + 4 + length
            while len(buf) < total:
                data = await stream.receive_some(65536)
                if not data:
                    raise ConnectionError("server closed")
                buf += data
            del buf[:total]
            tally.done += 1
    finally:
        await trio.aclose_forcefully(stream)


async def _drive(
    port: int, requests: int, concurrency: int, duration: float
) -> tuple[int, int, float]:
    tally = Tally()
    budget = [requests]
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(_client, port, tally, budget, start + duration)
    return tally.done, tally.errors, trio.current_time() - start


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); utime/stime are fields 14/15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _closes_within(port: int, request: bytes, wait: float) -> float | None:
    """Send ``request`` (if any), read until the server closes; seconds it took, or None."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    start = trio.current_time()
    try:
        if request:
            await stream.send_all(request)
        with trio.move_on_after(wait):
            while await stream.receive_some(65536):
                pass
            return trio.current_time() - start
        return None
    except trio.BrokenResourceError:
        return trio.current_time() - start
    finally:
        await trio.aclose_forcefully(stream)


async def _probe(port: int) -> dict[str, float | None]:
    close_request = REQUEST.replace(b"Host: 127.0.0.1\r\n", b"Host: 127.0.0.1\r\nConnection: close\r\n")
    results: dict[str, float | None] = {}
    async with trio.open_nursery() as nursery:

        async def run(name: str, request: bytes, wait: float) -> None:
            results[name] = await _closes_within(port, request, wait)

        nursery.start_soon(run, "close", close_request, 3.0)
        nursery.start_soon(run, "idle", b"", IDLE_TIMEOUT * 3)
    return results


def _bench(kind: str, args: argparse.Namespace) -> dict[str, float]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        probe = trio.run(_probe, port) if args.frameworks else {}
        trio.run(_drive, port, args.warmup, args.concurrency, args.duration)
        cpu0 = _cpu_seconds(proc.pid)
        done, errors, elapsed = trio.run(
            _drive, port, args.requests, args.concurrency, args.duration
        )
        cpu = _cpu_seconds(proc.pid) - cpu0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return {
        "requests": done,
        "errors": errors,
        "rps": done / elapsed,
        "cpu_us": cpu / max(done, 1) * 1e6,
        **{f"probe_{k}": -1.0 if v is None else v for k, v in probe.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--serve", choices=["iopd", "direct", "quart", "asgi", "admin"], help=argparse.SUPPRESS
    )
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=30.0, help="max seconds per run")
    parser.add_argument(
        "--frameworks",
        action="store_true",
        help="also measure quart-trio and plain ASGI on hypercorn (trio), and probe closes",
    )
    args = parser.parse_args()
    servers = {
        "iopd": _serve_iopd,
        "direct": _serve_direct,
        "quart": _serve_quart,
        "asgi": _serve_asgi,
        "admin": _serve_admin,
    }
    if args.serve:
        trio.run(servers[args.serve])
        return
    kinds = ["direct", "iopd"] + (["asgi", "quart", "admin"] if args.frameworks else [])
    results = {kind: _bench(kind, args) for kind in kinds}
    print(f"{'server':<8} {'requests':>9} {'errors':>6} {'req/s':>9} {'CPU us/req':>11} {'vs iopd':>8}")
    base = results["iopd"]["cpu_us"]
    for kind, r in results.items():
        print(
            f"{kind:<8} {r['requests']:>9.0f} {r['errors']:>6.0f} {r['rps']:>9.0f} "
            f"{r['cpu_us']:>11.1f} {r['cpu_us'] / base:>7.2f}x"
        )
    ratio = results["iopd"]["cpu_us"] / results["direct"]["cpu_us"]
    print(f"iopd/direct CPU per request: {ratio:.2f}x")
    if args.frameworks:
        print(f"\nconnection probes (idle timeout {IDLE_TIMEOUT:g} s for every server):")
        for kind, r in results.items():
            close, idle = r.get("probe_close", -1.0), r.get("probe_idle", -1.0)
            close_s = f"closed after {close:.3f} s" if close >= 0 else "NOT closed within 3 s"
            idle_s = f"closed after {idle:.2f} s" if idle >= 0 else f"NOT closed within {IDLE_TIMEOUT * 3:g} s"
            print(f"  {kind:<8} Connection: close -> {close_s}; idle keep-alive -> {idle_s}")


if __name__ == "__main__":
    main()
