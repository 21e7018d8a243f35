"""``scripts/hop_timeline.py`` follows each request along its path through
the traced writes and reads (``bench_gateway.py --hops``): checked here on
hand-made traces, where every hop and step is known."""

from __future__ import annotations

import pytest

from tests.support.paths import load_script

hop_timeline = load_script("hop_timeline")

TARGETS = {
    "direct": ["provider"],
    "relay2": ["provider", "relay_a", "relay_b"],
    "gateway": ["edge", "node", "provider"],
}


def _trace(*chains: tuple[float, list[tuple[str, float, float]]]) -> dict:
    """Events of requests sent at ``start``, each visiting (process, hop, step)
    in turn; the last entry is the load generator's read (its step unused)."""
    events: dict[str, tuple[list[float], list[float]]] = {}
    for start, visits in chains:
        events.setdefault("load", ([], []))[0].append(start)
        t = start
        for proc, hop, step in visits:
            writes, reads = events.setdefault(proc, ([], []))
            t += hop
            reads.append(t)
            if proc != "load":
                t += step
                writes.append(t)
    for writes, reads in events.values():
        writes.sort()
        reads.sort()
    return events


def test_each_target_is_followed_hop_by_hop() -> None:
    events = _trace(
        (1000.0, [("provider", 10, 5), ("load", 20, 0)]),
        (
            2000.0,
            [
                ("relay_a", 11, 2),
                ("relay_b", 12, 3),
                ("provider", 13, 4),
                ("relay_b", 14, 5),
                ("relay_a", 15, 6),
                ("load", 16, 0),
            ],
        ),
        (
            3000.0,
            [
                ("edge", 30, 600),
                ("node", 31, 150),
                ("provider", 32, 80),
                ("node", 33, 200),
                ("edge", 34, 140),
                ("load", 35, 0),
            ],
        ),
    )
    followed = hop_timeline.follow(events, TARGETS)
    assert followed["direct"] == [[10, 5, 20]]
    assert followed["relay2"] == [[11, 2, 12, 3, 13, 4, 14, 5, 15, 6, 16]]
    assert followed["gateway"] == [[30, 600, 31, 150, 32, 80, 33, 200, 34, 140, 35]]


def test_a_request_overtaken_by_the_next_send_is_left_out() -> None:
    # The second request is sent before the first one's answer: the first
    # cannot be told apart from it and is dropped; the second is whole.
    events = _trace(
        (1000.0, [("provider", 10, 5), ("load", 500, 0)]),
        (1100.0, [("provider", 10, 5), ("load", 20, 0)]),
    )
    assert hop_timeline.follow(events, {"direct": ["provider"]}) == {"direct": [[10, 5, 20]]}


def test_an_unfinished_request_is_left_out() -> None:
    events = _trace((1000.0, [("edge", 30, 600), ("node", 31, 150)]))
    assert hop_timeline.follow(events, TARGETS)["gateway"] == []


def test_the_report_prints_totals_over_direct(capsys: pytest.CaptureFixture[str]) -> None:
    followed = {
        "direct": [[10.0, 5.0, 20.0]],
        "gateway": [[30.0, 600.0, 31.0, 150.0, 32.0, 80.0, 33.0, 200.0, 34.0, 140.0, 35.0]],
    }
    hop_timeline.report(followed, {"direct": ["provider"], "gateway": TARGETS["gateway"]})
    out = capsys.readouterr().out
    assert "edge>node 31 | node 150" in out
    assert "gateway over direct: hops +165, steps +1165 µs" in out


def test_perf_script_lines_become_reads_and_writes() -> None:
    script = """\
   101 53370.000100:  syscalls:sys_enter_sendto: fd: 0x00000013, buff: 0x7f, len: 0x00000149
   102 53370.000250:     syscalls:sys_exit_read: 0x149
   101 53370.000300: syscalls:sys_exit_recvfrom: 0xfffffffffffffff5
   102 53370.000400:    syscalls:sys_enter_write: fd: 0x0000000c, buf: 0x7f, count: 0x00000138
   102 53370.000500:     syscalls:sys_exit_read: 0x0
   999 53370.000600:     syscalls:sys_exit_read: 0x10
"""
    events = hop_timeline.parse(script, {"load": 101, "edge": 102})
    # The failed recvfrom (-EAGAIN) and the read at EOF are no reads; pid 999 is not traced.
    assert events == {"load": ([53370000100.0], []), "edge": ([53370000400.0], [53370000250.0])}
