"""Where a request's added time goes, hop by hop: ``bench_gateway.py --hops``.

For the measured window of the ``mixed`` phase, ``perf record`` traces four
system-call tracepoints in every process of the run (the load generator,
the provider, the two raw relays, the edge and the node): entering
``write``/``sendto`` and leaving ``read``/``recvfrom`` with bytes.  Nothing
in the daemons is changed or instrumented; the monotonic clock of the
trace is shared by all processes.

Each request is then followed from the load generator's send along its
path (``load -> edge -> node -> provider -> node -> edge -> load`` for the
gateway, the same through ``relay_a``/``relay_b`` for the relays, ``load ->
provider -> load`` direct):

* a **hop** runs from one process entering its write to the next process
  leaving its read of those bytes: the kernel's loopback, the wake-up of a
  sleeping process (or a core), and that process's event loop up to its read;
* a **step** runs from a process leaving its read to it entering its next
  write: its own work on the request.

A request whose path cannot be followed to the load generator's read
before its next send is left out; the report says how many were used.  A
background write inside a step (a heartbeat frame) would cut that step
short: rare enough that the p50s do not see it.  Tracing adds a little to
each traced call, alike for every target.
"""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
from bisect import bisect_right
from collections import defaultdict
from pathlib import Path

WRITES = ("syscalls:sys_enter_write", "syscalls:sys_enter_sendto")
READS = ("syscalls:sys_exit_read", "syscalls:sys_exit_recvfrom")
#: Where each process sits on a path from the caller (the load generator) inward.
_DEPTH = {"edge": 1, "relay_a": 1, "node": 2, "relay_b": 2, "provider": 3}


class HopTrace:
    """``perf record`` of the read/write tracepoints of ``pids`` into ``path``."""

    def __init__(self, pids: dict[str, int], path: Path) -> None:
        if shutil.which("perf") is None:
            raise SystemExit("--hops needs perf (the Debian package linux-perf)")
        self.pids = pids
        self.path = path
        events = ",".join(WRITES + READS)
        self._proc = subprocess.Popen(
            [
                "perf",
                "record",
                "-q",
                "-o",
                str(path),
                "-e",
                events,
                "-p",
                ",".join(str(pid) for pid in pids.values()),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def stop(self) -> None:
        """End the recording (perf writes its file on SIGINT)."""
        self._proc.send_signal(signal.SIGINT)
        _, err = self._proc.communicate(timeout=60)
        if not self.path.exists():
            raise SystemExit(f"perf record failed: {err.decode(errors='replace')[-500:]}")

    def events(self) -> dict[str, tuple[list[float], list[float]]]:
        """Per process name: the times (µs) of its writes and of its reads with bytes."""
        out = subprocess.run(
            ["perf", "script", "-i", str(self.path), "-F", "pid,time,event,trace"],
            capture_output=True,
            check=True,
        ).stdout.decode(errors="replace")
        return parse(out, self.pids)


def parse(script: str, pids: dict[str, int]) -> dict[str, tuple[list[float], list[float]]]:
    """``perf script -F pid,time,event,trace`` output, per process name: the
    times (µs) of its writes and of its reads that returned bytes."""
    names = {pid: name for name, pid in pids.items()}
    found: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for line in script.splitlines():
        # "  1234 53370.283749: syscalls:sys_exit_read: 0x589"
        fields = line.split()
        if len(fields) < 3 or not fields[0].isdigit():
            continue
        name = names.get(int(fields[0]))
        if name is None:
            continue
        at = float(fields[1].rstrip(":")) * 1e6
        event = fields[2].rstrip(":")
        if event in WRITES:
            found[name][0].append(at)
        elif event in READS and len(fields) > 3 and _returned(fields[3]) > 0:
            found[name][1].append(at)
    return found


def _returned(value: str) -> int:
    """A syscall's return value as perf prints it: an error (``-EAGAIN``) is
    the unsigned 64-bit hex of the negative number (0xfffffffffffffff5)."""
    ret = int(value, 0)
    return ret - (1 << 64) if ret >= 1 << 63 else ret


def _path(inner: list[str]) -> list[str]:
    """``load``, the processes inward to the provider, and back out."""
    order = sorted(inner, key=_DEPTH.__getitem__)
    return ["load", *order, *reversed(order[:-1]), "load"]


def _after(times: list[float], t: float) -> float | None:
    i = bisect_right(times, t)
    return times[i] if i < len(times) else None


def follow(
    events: dict[str, tuple[list[float], list[float]]], targets: dict[str, list[str]]
) -> dict[str, list[list[float]]]:
    """For each target (its processes besides ``load``): each followed
    request's hops and steps in path order, in µs (hop, step, hop, ..., hop)."""
    load_writes = events.get("load", ([], []))[0]
    paths = {name: _path(inner) for name, inner in targets.items()}
    by_first = {path[1]: (name, path) for name, path in paths.items()}
    followed: dict[str, list[list[float]]] = {name: [] for name in targets}
    for k, sent in enumerate(load_writes):
        next_send = load_writes[k + 1] if k + 1 < len(load_writes) else float("inf")
        first = min(
            (
                (t, proc)
                for proc in by_first
                if (t := _after(events.get(proc, ([], []))[1], sent)) is not None
            ),
            default=None,
        )
        if first is None:
            continue
        name, path = by_first[first[1]]
        spans: list[float] = []
        cursor = sent
        for proc in path[1:]:
            writes, reads = events.get(proc, ([], []))
            got = _after(reads, cursor)
            if got is None:
                break
            spans.append(got - cursor)  # the hop into ``proc``
            cursor = got
            if proc == "load":
                break
            wrote = _after(writes, cursor)
            if wrote is None:
                break
            spans.append(wrote - cursor)  # ``proc``'s step
            cursor = wrote
        if len(spans) == 2 * len(path) - 3 and cursor < next_send:
            followed[name].append(spans)
    return followed


def report(followed: dict[str, list[list[float]]], targets: dict[str, list[str]]) -> None:
    """Print each target's p50 per hop and step, and its hops and steps in total."""
    print("\nwhere the time goes (mixed; p50 µs; hop = a write to the next process's read,")
    print("step = a process's read to its next write)")
    totals: dict[str, tuple[float, float]] = {}
    for name, inner in targets.items():
        rows = followed[name]
        path = _path(inner)
        if not rows:
            print(f"  {name:<8} no request could be followed")
            continue
        parts = []
        for i, span in enumerate(zip(*rows, strict=True)):
            label = f"{path[i // 2]}>{path[i // 2 + 1]}" if i % 2 == 0 else path[i // 2 + 1]
            parts.append(f"{label} {statistics.median(span):.0f}")
        hops = statistics.median(sum(r[0::2]) for r in rows)
        steps = statistics.median(sum(r[1::2]) for r in rows)
        totals[name] = (hops, steps)
        print(f"  {name:<8} ({len(rows)} requests) " + " | ".join(parts))
        print(f"  {'':<8} hops {hops:.0f}, steps {steps:.0f}, together {hops + steps:.0f}")
    if "direct" in totals:
        base_hops, base_steps = totals["direct"]
        for name, (hops, steps) in totals.items():
            if name != "direct":
                print(
                    f"  {name} over direct: hops +{hops - base_hops:.0f},"
                    f" steps +{steps - base_steps:.0f} µs"
                )
