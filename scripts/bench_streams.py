#!/usr/bin/env python3
"""Streaming at scale: N concurrent streams, direct vs two raw relays vs edge + node.

A mock OpenAI-compatible provider streams every request as ``--chunks``
SSE chunks (default 100), one every ``--interval`` seconds (default 20 ms,
i.e. 50 tokens/s per stream); chunk ``k`` carries the text ``c<k>``.  A load
generator (its own process, so its CPU is never counted) keeps ``N`` streams
open at once, closed loop (a stream that ends is replaced at once), for
``--seconds`` per measurement, against three targets in the same run:

* ``direct``: the provider itself;
* ``relay2``: two raw trio byte relays chained in front of it (the floor of
  two Python hops: no parsing, no logging);
* ``gateway``: ``python -m iopd edge`` + ``python -m iopd node`` with the
  provider as a ``type: openai`` passthrough provider.

For each target and N it prints the delivered chunk rate as a fraction of
the ideal (N x 1/interval chunks per second), the inter-chunk gap p50/p99,
time to first chunk p50, CPU µs per chunk of each measured process
(``/proc/<pid>/stat``), RSS per open stream of the edge and node, and the
check of every finished stream: all chunks, in order, then ``[DONE]``
(``lost`` counts streams that failed that check or broke).

On a machine with two or more cores the processes are pinned (the rig of
docs/performance.md): edge + node, and the two raw relays, on one core (``--cores``' first),
the mock provider and the load generator on the other, so the gateway's two
daemons compete for one core the way the two relays do.  The provider and
the load generator must then cost far less per chunk than any target, or
their shared core is what gets measured: the provider writes every chunk
due from one writer task that wakes at most once a millisecond, and the
generator is one ``epoll`` loop with no event-loop library; together about
10-30 µs of their core per chunk, so *direct* holds 99.8 % of the ideal
rate at N = 1,000 on a two-core machine.  The closing
summary prints, per N, the ratios the streaming targets of docs/performance.md use: gateway/direct
delivered rate (and the largest N that holds 0.97 with nothing lost), edge +
node CPU per chunk over the two relays', the first-chunk overhead over
direct, and RSS per open stream of edge + node.

    .venv/bin/python scripts/bench_streams.py                 # the sweep, N = 50 ... 1,000
    .venv/bin/python scripts/bench_streams.py --quick         # N = 50,200,400, 4 s each
    .venv/bin/python scripts/bench_streams.py --streams 200 --seconds 10 --targets relay2,gateway
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import select
import socket
import sys
import tempfile
import time
from pathlib import Path

import bench_gateway as bg
import trio

# ------------------------------------------------------------ mock provider


def _chunk(k: int) -> bytes:
    payload = json.dumps(
        {
            "id": "chatcmpl-streams",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "bench-model",
            "choices": [{"index": 0, "delta": {"content": f"c{k}"}, "finish_reason": None}],
        },
        separators=(",", ":"),
    ).encode()
    return bg._chunked(b"data: " + payload + b"\n\n")


_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_DONE = bg._chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"
_MODELS = bg._MODELS_RESPONSE


#: The provider's writer wakes at most this often: every chunk due by then
#: is written in that wake-up (a stream's chunks stay ``interval`` apart,
#: each at most one tick late), so its cost per chunk is one ``write(2)``.
TICK_S = 0.001


class _Feed:
    """One response being streamed: its socket, the next chunk, bytes not
    yet taken by the socket (written first, in order, at the next tick)."""

    def __init__(self, fd: int, start: float) -> None:
        self.fd = fd
        self.start = start
        self.k = 1  # chunk 0 left with the head
        self.pending = b""
        self.ended = False
        self.done = trio.Event()  # every byte of the response written

    def write(self, data: bytes) -> None:
        data = self.pending + data if self.pending else data
        try:
            sent = os.write(self.fd, data)
        except BlockingIOError:
            sent = 0
        except OSError:  # the caller went away: its handler sees the socket close
            self.pending, self.ended = b"", True
            self.done.set()
            return
        self.pending = data[sent:]
        if self.ended and not self.pending:
            self.done.set()


async def _serve_streaming_provider(chunks: int, interval: float) -> None:
    """The mock provider.  Chunks are written by one writer task that wakes
    at most every ``TICK_S`` (not one timer per stream): the provider shares
    a core with the load generator, so the cheaper it is per chunk, the more
    streams the rig can offer before it, not the target, is the limit."""
    bodies = [_chunk(k) for k in range(chunks)]
    due: list[tuple[float, int, _Feed]] = []
    stalled: list[_Feed] = []
    seq = itertools.count()
    work = trio.Event()

    async def writer() -> None:
        nonlocal work
        while True:
            if not due and not stalled:
                await work.wait()
                work = trio.Event()
            now = trio.current_time()
            for feed in stalled:  # sockets that were full at the last tick
                feed.write(b"")
            stalled[:] = [f for f in stalled if f.pending and not f.done.is_set()]
            while due and due[0][0] <= now:
                _, _, feed = heapq.heappop(due)
                if feed.done.is_set():
                    continue
                if feed.k < len(bodies):
                    body, feed.k = bodies[feed.k], feed.k + 1
                    heapq.heappush(due, (feed.start + feed.k * interval, next(seq), feed))
                else:
                    body, feed.ended = _DONE, True
                had_pending = bool(feed.pending)
                feed.write(body)
                if feed.pending and not had_pending:
                    stalled.append(feed)
            if due or stalled:
                await trio.sleep_until(max(now + TICK_S, due[0][0] if due else 0.0))

    async def handle(stream: trio.SocketStream) -> None:
        buf = bytearray()
        try:
            while (request := await bg.read_request(stream, buf)) is not None:
                head, _body = request
                if head.startswith(b"get "):
                    await stream.send_all(_MODELS)
                    continue
                await stream.send_all(_HEAD + bodies[0])
                feed = _Feed(stream.socket.fileno(), trio.current_time())
                heapq.heappush(due, (feed.start + interval, next(seq), feed))
                work.set()
                await feed.done.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer)
        await trio.serve_listeners(handle, listeners)


# ------------------------------------------------------------ load generator


def _request(model: str) -> bytes:
    body = json.dumps(
        {"model": model, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    ).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {bg.TOKEN}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class Tally:
    def __init__(self) -> None:
        self.chunks = 0
        self.gaps: list[float] = []
        self.ttfc: list[float] = []
        self.complete = 0
        self.lost = 0
        self.measuring = False


class _Stream:
    """One keep-alive connection of the load generator and the stream on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.expected = 0
        self.started = 0.0
        self.last: float | None = None

    def begin(self, request: bytes, now: float) -> None:
        self.buf, self.expected, self.last, self.started = b"", 0, None, now
        self.sock.sendall(request)  # a few hundred bytes: the socket takes them at once

    def feed(self, data: bytes, now: float, chunks: int, tally: Tally) -> bool | None:
        """Check the bytes that arrived: True when the stream ended whole, None
        while it goes on; raises ``ValueError`` for a chunk out of order."""
        buf = self.buf + data
        while True:
            i = buf.find(b'"content":"c')
            if i < 0:
                break
            j = buf.find(b'"', i + 12)
            if j < 0:
                break
            k = int(buf[i + 12 : j])
            buf = buf[j:]
            if k != self.expected:
                raise ValueError(f"chunk {k} where {self.expected} was due")
            self.expected += 1
            if tally.measuring:
                tally.chunks += 1
                if self.last is None:
                    tally.ttfc.append(now - self.started)
                else:
                    tally.gaps.append(now - self.last)
            self.last = now
        self.buf = buf
        done_at = buf.find(b"data: [DONE]")
        if done_at >= 0 and buf.find(b"0\r\n\r\n", done_at) >= 0:
            if self.expected != chunks:
                raise ValueError(f"[DONE] after {self.expected} of {chunks} chunks")
            return True
        return None


def _load(args: argparse.Namespace) -> None:
    """N closed-loop streams from one ``epoll`` loop (no event-loop library):
    the generator shares a core with the provider, so it must cost far less
    per chunk than any target does, or it, not the target, is measured."""
    request = _request(args.model)
    tally = Tally()
    poller = select.epoll()
    streams: dict[int, _Stream] = {}
    t0 = time.monotonic()
    warm = t0 + args.warmup
    stop = warm + args.seconds
    last_start = stop + 5  # streams in flight at the end finish (and are checked)
    for _ in range(args.n):
        try:
            sock = socket.create_connection(("127.0.0.1", args.port))
        except OSError:
            tally.lost += 1
            continue
        sock.setblocking(False)
        streams[sock.fileno()] = _Stream(sock)
        poller.register(sock.fileno(), select.EPOLLIN)
    # The first requests are spread over one stream's length (within the
    # warm-up), so the streams' chunks are spread over each interval as
    # independent callers' would be, not written in one burst per interval.
    spread = min(args.chunks * args.interval, 0.8 * args.warmup)
    starts = [
        (time.monotonic() + spread * i / max(len(streams), 1), stream)
        for i, stream in enumerate(streams.values())
    ]
    starts.reverse()  # popped from the end: earliest first
    phase = 0  # 0 warming up, 1 measuring, 2 winding down
    guard = last_start + args.chunks * args.interval * 4 + 30
    while streams:
        now = time.monotonic()
        while starts and starts[-1][0] <= now:
            starts.pop()[1].begin(request, now)
        if phase == 0 and now >= warm:
            phase, tally.measuring = 1, True
            print("BEGIN", flush=True)
        if phase == 1 and now >= stop:
            phase, tally.measuring = 2, False
            print("END", flush=True)
        if now > guard:
            raise SystemExit(f"{len(streams)} streams did not end")
        next_mark = warm if phase == 0 else stop if phase == 1 else now + 0.1
        if starts:
            next_mark = min(next_mark, starts[-1][0])
        for fd, _event in poller.poll(max(0.0, min(0.1, next_mark - now))):
            stream = streams[fd]
            now = time.monotonic()
            try:
                data = os.read(fd, 65536)
                ended = stream.feed(data, now, args.chunks, tally) if data else False
            except (OSError, ValueError):
                ended = False
            if ended is None:
                continue
            if ended and now < last_start:
                tally.complete += 1
                stream.begin(request, now)
                continue
            if ended:
                tally.complete += 1
            else:  # broken, cut short or out of order
                tally.lost += 1
            poller.unregister(fd)
            stream.sock.close()
            del streams[fd]
    if phase < 2:
        print("END", flush=True)
    chunks, gaps, ttfc = tally.chunks, sorted(tally.gaps), sorted(tally.ttfc)
    print(
        "RESULT "
        + json.dumps(
            {
                "chunks": chunks,
                "rate": chunks / args.seconds,
                "gap_p50_ms": bg._pct(gaps, 0.5) * 1e3 if gaps else float("nan"),
                "gap_p99_ms": bg._pct(gaps, 0.99) * 1e3 if gaps else float("nan"),
                "ttfc_p50_ms": bg._pct(ttfc, 0.5) * 1e3 if ttfc else float("nan"),
                "complete": tally.complete,
                "lost": tally.lost,
            }
        ),
        flush=True,
    )


# ------------------------------------------------------------ orchestration


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _pin(pid: int, core: int | None) -> None:
    """Run ``pid`` (and the threads it starts later) on ``core`` only."""
    if core is not None:
        os.sched_setaffinity(pid, {core})


def _measure(
    procs: bg.Processes,
    port: int,
    model: str,
    n: int,
    watched: dict[str, int],
    args: argparse.Namespace,
) -> dict[str, float]:
    argv = [sys.executable, __file__, "--role", "load", "--port", str(port), "--model", model]
    argv += ["--n", str(n), "--seconds", str(args.seconds), "--chunks", str(args.chunks)]
    argv += ["--warmup", str(args.warmup)]
    rss0 = {name: _rss_kib(pid) for name, pid in watched.items()}
    proc = procs.start(argv)
    _pin(proc.pid, args.load_core)
    assert proc.stdout is not None
    cpu0: dict[str, float] = {}
    cpu: dict[str, float] = {}
    rss: dict[str, int] = {}
    result: dict[str, float] = {}
    for raw in proc.stdout:
        line = raw.decode().strip()
        if line == "BEGIN":
            cpu0 = {name: bg.cpu_seconds(pid) for name, pid in watched.items()}
        elif line == "END":
            cpu = {name: bg.cpu_seconds(pid) - cpu0[name] for name, pid in watched.items()}
            rss = {name: _rss_kib(pid) for name, pid in watched.items()}
        elif line.startswith("RESULT "):
            result = json.loads(line[7:])
    if proc.wait(timeout=args.seconds + args.warmup + 60) != 0 or not result:
        raise SystemExit(f"load generator failed ({model}, N={n})")
    chunks = max(result["chunks"], 1)
    for name in watched:
        result[f"cpu_{name}_us"] = cpu[name] / chunks * 1e6
        result[f"rss_{name}_kb"] = (rss[name] - rss0[name]) / n
    result["ideal"] = n / args.interval
    return result


def _summary(
    sizes: list[int], rows: list[tuple[int, str, dict[str, float]]], args: argparse.Namespace
) -> None:
    """The ratios the streaming targets of docs/performance.md use, per N,
    and the largest N holding 0.97."""
    where = (
        f"edge+node and relays on core {args.gateway_core}, provider+load on core {args.load_core}"
        if args.gateway_core is not None
        else "not pinned"
    )
    print(f"\nratios ({where}; load average {os.getloadavg()[0]:.2f} at the end)")
    holding: list[int] = []
    for n in sizes:
        by = {name: r for m, name, r in rows if m == n}
        gw, direct, relays = by.get("gateway"), by.get("direct"), by.get("relay2")
        if gw is None:
            continue
        parts = []
        gw_cpu = gw["cpu_edge_us"] + gw["cpu_node_us"]
        if direct is not None:
            ratio = gw["rate"] / max(direct["rate"], 1e-9)
            parts.append(f"gateway/direct rate {ratio:.3f}")
            if ratio >= 0.97 and gw["lost"] == 0:
                holding.append(n)
            parts.append(f"first chunk +{gw['ttfc_p50_ms'] - direct['ttfc_p50_ms']:.2f} ms")
        if relays is not None:
            relay_cpu = relays["cpu_relay1_us"] + relays["cpu_relay2_us"]
            parts.append(
                f"relay2/direct rate {relays['rate'] / max(direct['rate'], 1e-9):.3f}"
                if direct is not None
                else ""
            )
            parts.append(
                f"CPU/chunk edge+node {gw_cpu:.0f} µs vs relays {relay_cpu:.0f} µs "
                f"= {gw_cpu / max(relay_cpu, 1e-9):.2f}x"
            )
        else:
            parts.append(f"CPU/chunk edge+node {gw_cpu:.0f} µs")
        parts.append(f"RSS/stream edge+node {gw['rss_edge_kb'] + gw['rss_node_kb']:.1f} KB")
        parts.append(f"lost {int(gw['lost'])}")
        print(f"  N={n}: " + "; ".join(p for p in parts if p))
    if "direct" in args.targets:
        best = max(holding) if holding else None
        print(f"largest N with gateway/direct >= 0.97 and nothing lost: {best}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["provider", "relay", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="bench-model", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=50, help=argparse.SUPPRESS)
    parser.add_argument(
        "--streams", default="50,100,150,200,300,400,600,800,1000", help="comma list of N"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per N")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    parser.add_argument("--chunks", type=int, default=100, help="chunks per stream")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between chunks")
    parser.add_argument("--targets", default="direct,relay2,gateway")
    parser.add_argument(
        "--cores",
        default="0,1",
        help="core for edge+node and the relays, core for provider+load ('' = no pinning)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a short run: N = 50,200,400, 4 s each after 2 s"
    )
    args = parser.parse_args()
    if args.quick:
        args.streams, args.seconds, args.warmup = "50,200,400", 4.0, 2.0
    cores = [int(c) for c in args.cores.split(",") if c]
    pin = len(cores) == 2 and len(os.sched_getaffinity(0)) >= 2
    args.gateway_core, args.load_core = (cores[0], cores[1]) if pin else (None, None)
    if args.role == "provider":
        trio.run(_serve_streaming_provider, args.chunks, args.interval)
        return
    if args.role == "relay":
        trio.run(bg._serve_relay, args.upstream_port)
        return
    if args.role == "load":
        _load(args)
        return

    sizes = [int(x) for x in args.streams.split(",") if x]
    targets = [t for t in args.targets.split(",") if t]
    with bg.processes() as procs, tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        me = [sys.executable, __file__]
        provider = procs.start(
            me
            + ["--role", "provider", "--chunks", str(args.chunks), "--interval", str(args.interval)]
        )
        _pin(provider.pid, args.load_core)
        assert provider.stdout is not None
        provider_port = int(provider.stdout.readline())
        relay1 = procs.start(me + ["--role", "relay", "--upstream-port", str(provider_port)])
        _pin(relay1.pid, args.gateway_core)
        assert relay1.stdout is not None
        relay1_port = int(relay1.stdout.readline())
        relay2 = procs.start(me + ["--role", "relay", "--upstream-port", str(relay1_port)])
        _pin(relay2.pid, args.gateway_core)
        assert relay2.stdout is not None
        relay2_port = int(relay2.stdout.readline())

        edge_cfg = tmpdir / "edge.yaml"
        edge_cfg.write_text(
            bg.EDGE_YAML.format(
                log_level="warning",
                caller_hash=bg._sha256(bg.TOKEN),
                node_hash=bg._sha256(bg.NODE_TOKEN),
                provider_port=provider_port,
                limits="",  # no per-principal limits: the streaming path alone
            )
            .replace("capacity: 256", "capacity: 4096")
            .replace("max_queue: 1024", "max_queue: 4096")
        )
        edge_log = tmpdir / "edge.log"
        edge = procs.start(
            [
                sys.executable,
                "-m",
                "iopd",
                "edge",
                "--config",
                str(edge_cfg),
                "--log-level",
                "info",
            ],
            edge_log,
        )
        _pin(edge.pid, args.gateway_core)
        started = bg._wait_log(edge_log, r"event=edge_started .*wire=\S+:(\d+).* openai=\S+:(\d+)")
        wire_port, edge_port = int(started.group(1)), int(started.group(2))
        node_cfg = tmpdir / "node.yaml"
        node_cfg.write_text(
            bg.NODE_YAML.format(wire_port=wire_port, node_token=bg.NODE_TOKEN, log_level="warning")
        )
        node_log = tmpdir / "node.log"
        node = procs.start(
            [
                sys.executable,
                "-m",
                "iopd",
                "node",
                "--config",
                str(node_cfg),
                "--log-level",
                "info",
            ],
            node_log,
        )
        _pin(node.pid, args.gateway_core)
        bg._wait_log(edge_log, r"event=node_connected")
        time.sleep(0.5)

        plan = {
            "direct": (provider_port, "bench-model", {"provider": provider.pid}),
            "relay2": (relay2_port, "bench-model", {"relay2": relay2.pid, "relay1": relay1.pid}),
            "gateway": (edge_port, "bench", {"edge": edge.pid, "node": node.pid}),
        }
        rows = []
        for n in sizes:
            for name in targets:
                port, model, watched = plan[name]
                r = _measure(procs, port, model, n, watched, args)
                rows.append((n, name, r))
                cpu = " ".join(f"{k[4:-3]} {v:.0f}" for k, v in r.items() if k.startswith("cpu_"))
                rss = " ".join(f"{k[4:-3]} {v:.1f}" for k, v in r.items() if k.startswith("rss_"))
                print(
                    f"N={n:<5} {name:<8} delivered {r['rate'] / r['ideal']:6.1%} of ideal "
                    f"({r['rate']:,.0f} chunks/s); gap p50 {r['gap_p50_ms']:.1f} ms, "
                    f"p99 {r['gap_p99_ms']:.1f} ms; first chunk p50 {r['ttfc_p50_ms']:.1f} ms; "
                    f"CPU µs/chunk: {cpu}; RSS KB/stream: {rss}; "
                    f"streams complete {r['complete']}, lost {r['lost']}",
                    flush=True,
                )
        _summary(sizes, rows, args)


if __name__ == "__main__":
    main()
