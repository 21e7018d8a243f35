"""A flood of unauthenticated connections on ``edge.node_listen``, with real processes.

An ``iopd edge`` and an ``iopd node`` subprocess (heartbeats every 0.5 s, a
link lost after 3 s of silence); once the node is connected, the test opens

* 100 connections that each send a 16 MiB - 1 length prefix and 2 MiB of its
  body (never a ``Hello``), one per loopback source address, then
* 10,000 connections that send nothing, from 100 loopback source addresses
  (127.0.0.0/8 is all loopback, so both caps, per address and in total, are
  hit),

and keeps them all open for longer than ``edge.handshake_timeout`` while a
chat probe loop runs on the OpenAI port.  Every probe must be answered 200,
the node's link must be the session it had before (one ``node_connected`` on
the edge, one ``edge_connected`` on the node, nothing lost, the same
``connected_since`` in ``/status``), and the edge's resident memory and
descriptors must stay bounded: its peak RSS at most ``RSS_GROWTH_BOUND``
above its RSS before the flood (without the handshake's frame cap the edge
buffers the 200 MiB the oversized frames send), its descriptors at most
``edge.node_listen_max_pending`` + ``FD_MARGIN`` above the count before.

Bounded loops, loopback only, every wait under ``GUARD``.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
import trio.lowlevel

from tests.support.daemons import (
    CALLER_TOKEN,
    Daemon,
    chat_body,
    edge_and_node,
    edge_yaml,
    http_request,
)

GUARD = 55.0
IDLE = 10_000
OVERSIZED = 100
#: Bytes of its body each oversized frame sends (if the edge keeps reading).
OVERSIZED_SENT = 2 * 1024 * 1024
SOURCES = 100  # loopback source addresses of the idle flood
MAX_PENDING = 256  # the default edge.node_listen_max_pending
HANDSHAKE_TIMEOUT = 2.0
#: How long the flood is held open: past the handshake deadline, so the
#: admitted ones are closed by it, and several heartbeat timeouts long.
HOLD = 2 * HANDSHAKE_TIMEOUT + 2.0
#: Generous: the oversized prefixes are refused after one read (64 KiB each at
#: most), the idle connections hold a task and a channel each, 256 at most.
RSS_GROWTH_BOUND_MIB = 100
FD_MARGIN = 64
NEEDED_FDS = IDLE + OVERSIZED + 1000

#: The edge keys the flood test adds to the daemons' edge section.
FLOOD_SETTINGS = {
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 3,
    "handshake_timeout": HANDSHAKE_TIMEOUT,
}


def _proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def rss_kib(pid: int) -> int:
    return _proc_status(pid, "VmRSS")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextmanager
def enough_descriptors() -> Iterator[None]:
    """Raise this process's soft RLIMIT_NOFILE to what the flood needs (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = hard if hard != resource.RLIM_INFINITY else NEEDED_FDS
    if ceiling < NEEDED_FDS:
        pytest.skip(f"needs {NEEDED_FDS} file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, NEEDED_FDS), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_nonblocking(port: int, source: str, first: bytes = b"") -> socket.socket:
    """A connection to the edge's wire port from ``source`` (connect not awaited)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.bind((source, 0))
    err = sock.connect_ex(("127.0.0.1", port))
    if err not in (0, errno.EINPROGRESS):
        sock.close()
        raise OSError(err, os.strerror(err))
    return sock


@dataclass
class Probes:
    ok: int = 0
    errors: list[str] = field(default_factory=list)


async def probe_loop(openai: tuple[str, int], probes: Probes, stop: trio.Event) -> None:
    """Chat requests one after another until ``stop``; every answer that is not a 200 is kept."""
    n = 0
    while not stop.is_set():
        n += 1
        try:
            with trio.fail_after(10):
                resp = await http_request(
                    openai,
                    "POST",
                    "/v1/chat/completions",
                    chat_body(f"probe {n}"),
                    token=CALLER_TOKEN,
                )
        except (OSError, trio.TooSlowError) as exc:
            probes.errors.append(f"probe {n}: {type(exc).__name__}")
            continue
        if resp.status == 200 and json.loads(resp.body)["choices"][0]["message"]["content"]:
            probes.ok += 1
        else:
            probes.errors.append(f"probe {n}: {resp.status} {resp.body[:200]!r}")
        await trio.sleep(0.02)


@dataclass
class Peak:
    rss_kib: int = 0
    fds: int = 0

    def sample(self, pid: int) -> None:
        self.rss_kib = max(self.rss_kib, rss_kib(pid))
        self.fds = max(self.fds, fd_count(pid))


async def sample_loop(pid: int, peak: Peak, stop: trio.Event) -> None:
    while not stop.is_set():
        peak.sample(pid)
        await trio.sleep(0.05)


async def flood(port: int, socks: list[socket.socket]) -> None:
    """The oversized frames first (each from its own address), then the idle connections."""
    oversized = [open_nonblocking(port, f"127.0.2.{i + 1}") for i in range(OVERSIZED)]
    socks.extend(oversized)
    await send_oversized(oversized)
    for i in range(IDLE):
        socks.append(open_nonblocking(port, f"127.0.1.{i % SOURCES + 1}"))
        if i % 500 == 499:
            await trio.lowlevel.checkpoint()  # let the probe and sample loops run


async def send_oversized(socks: list[socket.socket]) -> None:
    """Each of ``socks`` sends a 16 MiB - 1 length prefix and ``OVERSIZED_SENT``
    bytes of its body, until done or until the edge closes it."""
    data = memoryview((16 * 1024 * 1024 - 1).to_bytes(4, "big") + b"\x00" * OVERSIZED_SENT)
    offsets = dict.fromkeys(socks, 0)
    with trio.fail_after(20):
        while offsets:
            for sock, off in list(offsets.items()):
                try:
                    off += sock.send(data[off : off + 65536])
                except BlockingIOError:  # not connected yet, or its buffer is full
                    continue
                except OSError:  # reset: the edge refused it
                    off = len(data)
                if off >= len(data):
                    del offsets[sock]
                else:
                    offsets[sock] = off
            await trio.sleep(0.005)


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def node_row(admin: tuple[str, int]) -> dict[str, object]:
    resp = await http_request(admin, "GET", "/status")
    assert resp.status == 200
    rows = [n for n in json.loads(resp.body)["nodes"] if n["id"] == "ops-node"]
    assert len(rows) == 1
    row = rows[0]
    assert isinstance(row, dict)
    return row


def link_events(edge: Daemon, node: Daemon) -> dict[str, int]:
    return {
        "node_connected": len(edge.events("node_connected")),
        "node_disconnected": len(edge.events("node_disconnected")),
        "edge_connected": len(node.events("edge_connected")),
        "edge_link_lost": len(node.events("edge_link_lost")),
        "edge_reconnect": len(node.events("edge_reconnect")),
    }


async def test_a_flood_of_unauthenticated_connections_leaves_the_node_and_callers_served(
    tmp_path: Path,
) -> None:
    edge_cfg = tmp_path / "edge.yaml"
    edge_cfg.write_text(edge_yaml(delay_ms=1, capacity=8, edge=FLOOD_SETTINGS))
    socks: list[socket.socket] = []
    with enough_descriptors(), trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            async with edge_and_node(nursery, tmp_path, edge_cfg, log_format="keyvalue") as c:
                edge, node, wire, openai, admin = c.edge, c.node, c.wire, c.openai, c.admin
                await edge.wait_event("node_connected")
                await node.wait_event("edge_connected")
                before = await node_row(admin)
                assert before["connected"] is True
                pid = edge.proc.pid
                # A few requests first: the edge's memory as it serves.
                warm = Probes()
                for n in range(20):
                    resp = await http_request(
                        openai,
                        "POST",
                        "/v1/chat/completions",
                        chat_body(f"warm {n}"),
                        token=CALLER_TOKEN,
                    )
                    assert resp.status == 200, resp.body
                    warm.ok += 1
                rss_before, fds_before = rss_kib(pid), fd_count(pid)
                probes, peak, stop = Probes(), Peak(), trio.Event()
                try:
                    async with trio.open_nursery() as inner:
                        inner.start_soon(probe_loop, openai, probes, stop)
                        inner.start_soon(sample_loop, pid, peak, stop)
                        await flood(wire[1], socks)
                        await trio.sleep(HOLD)
                        stop.set()
                finally:
                    for sock in socks:
                        sock.close()
                metrics = (await http_request(admin, "GET", "/metrics")).body.decode()
                after = await node_row(admin)
                events = link_events(edge, node)

    assert probes.errors == [], probes.errors[:10]
    assert probes.ok >= 10, probes
    # The same session all along: nothing lost, nothing reconnected.
    assert events == {
        "node_connected": 1,
        "node_disconnected": 0,
        "edge_connected": 1,
        "edge_link_lost": 0,
        "edge_reconnect": 0,
    }, events
    assert after["connected"] is True
    assert after["connected_since"] == before["connected_since"]
    # The caps did the work: oversized prefixes refused on their first read,
    # idle connections past the caps refused at accept.
    assert metric(metrics, "iop_wire_protocol_errors_total", reason="frame_too_large") == OVERSIZED
    assert metric(metrics, "iop_wire_protocol_errors_total", reason="pending_limit") > IDLE / 2
    assert metric(metrics, "iop_wire_protocol_errors_total", reason="handshake") > 0
    assert edge.events("wire_connection_refused")
    growth_mib = (peak.rss_kib - rss_before) / 1024
    assert growth_mib <= RSS_GROWTH_BOUND_MIB, (rss_before, peak.rss_kib)
    assert peak.fds <= fds_before + MAX_PENDING + FD_MARGIN, (fds_before, peak.fds)
