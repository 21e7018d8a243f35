#!/usr/bin/env python3
"""Counts per request and per chunk through edge + node that do not depend on load.

Wall-clock figures on a shared two-core machine move with the neighbours'
load; what a request *does* does not.  This script starts the mock provider
of ``scripts/bench_gateway.py``, ``python -m iopd edge`` and ``python -m
iopd node`` (each under a trio ``Instrument`` that counts task steps by
task, run-loop rounds and the rounds that waited for I/O), sends requests
one at a time (or over ``--concurrency`` connections), and prints per unit (a request, or a chunk):

* task steps of each daemon (a step = one task resumed by the scheduler:
  the task switches), and which tasks took them (``--tasks``);
* run-loop rounds, and the rounds that had to wait for I/O (``waits``: the
  wake-ups of the process);
* on-CPU µs of each daemon (``/proc/<pid>/task/*/schedstat``; this one
  moves with load and cache temperature);
* with ``--strace``, the system calls of each daemon by name (``strace -c
  -f`` attached for the measured phase only);
* with ``--calltree DIR``, every Python call (and builtin) of each daemon's
  first ``--calltree-steps`` task steps of the measured phase, in order and
  indented by depth, one step after another (``DIR/<phase>-<daemon>.calltree.txt``),
  and how many call events each of those steps made: what one request does,
  step by step, to read rather than to time.

Phases (``--phases``):

* ``plain``: non-streaming chat completions (the cold path when
  ``--gap`` leaves the daemons idle between requests);
* ``stream``: streamed completions of 16 chunks the provider sends in two
  writes (bench_gateway's ``stream`` phase);
* ``paced``: streams of ``--chunks`` chunks, one every ``--interval``
  seconds (so each chunk crosses an idle path alone); counted per chunk.

To compare two trees run it once per tree, e.g. ``PYTHONPATH=<other tree>
.venv/bin/python scripts/count_path.py``: the daemons import ``iopd`` from
``PYTHONPATH``.

    .venv/bin/python scripts/count_path.py
    .venv/bin/python scripts/count_path.py --phases plain --requests 300 --strace --tasks
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import bench_gateway as bg
import trio

#: Not SIGUSR2: that is the edge's hand-over to a successor (a restart).
DUMP_SIGNAL = signal.SIGRTMIN + 1
CALLTREE_SIGNAL = signal.SIGUSR1
LATENCIES: list[float] = []

# ------------------------------------------------------------ the daemons' side


class StepCounter(trio.abc.Instrument):
    """Task steps by task name, their wall µs (a step's length, which
    includes any preemption of a loaded machine) and on-CPU µs (the
    thread's CPU clock), run-loop rounds, rounds that waited for I/O; with
    ``split``, each step's wall and CPU ns of the tasks whose name holds it
    (the last 4,000); with ``calls``, Python function calls and returns
    (``sys.setprofile``: a count that does not move with load)."""

    def __init__(self, split: str = "", calls: bool = False, cprofile: bool = False) -> None:
        self.steps: Counter[str] = Counter()
        self.step_ns: Counter[str] = Counter()
        self.step_cpu_ns: Counter[str] = Counter()
        self._step_start = 0
        self._step_cpu = 0
        self.split = split
        self.series: list[tuple[int, int]] = []
        self.rounds = 0
        self.waits = 0
        self.calls = 0
        self.calls_on = calls
        if calls:
            sys.setprofile(self._profile)
        self._tree: list[str] | None = None  # the call tree being written (``--calltree``)
        self._tree_left = 0  # task steps it still takes
        self._tree_path = ""
        self._depth = 0
        self.cprofile: cProfile.Profile | None = None
        if cprofile:
            self.cprofile = cProfile.Profile()
            self.cprofile.enable()

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1

    # -- the call tree (``--calltree``): armed by a signal, written after N steps

    def arm_calltree(self, path: str, steps: int) -> None:
        self._tree_path, self._tree_left = path, steps
        self._tree = None

    def _tree_hook(self, frame: Any, event: str, arg: Any) -> None:
        tree = self._tree
        if tree is None:
            return
        if event == "call":
            code = frame.f_code
            where = "/".join(code.co_filename.split("/")[-2:])
            tree.append(f"{'  ' * self._depth}{code.co_qualname}  {where}:{code.co_firstlineno}")
            self._depth += 1
        elif event == "c_call":
            tree.append(f"{'  ' * self._depth}C {getattr(arg, '__qualname__', arg)}")
            self._depth += 1
        elif self._depth:  # return, c_return, c_exception (the trace starts mid-stack)
            self._depth -= 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._tree_left:
            if self._tree is None:
                self._tree = []
                sys.setprofile(self._tree_hook)
            self._depth = 0
            self._tree.append(f"=== step {task.name}")
        self.steps[task.name] += 1
        self._step_start = time.perf_counter_ns()
        self._step_cpu = time.thread_time_ns()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._tree_left and self._tree is not None:
            self._tree_left -= 1
            if not self._tree_left:
                sys.setprofile(None)
                Path(self._tree_path).write_text("\n".join(self._tree) + "\n")
                self._tree = None
        wall = time.perf_counter_ns() - self._step_start
        cpu = time.thread_time_ns() - self._step_cpu
        self.step_ns[task.name] += wall
        self.step_cpu_ns[task.name] += cpu
        if self.split and self.split in task.name:
            self.series.append((wall, cpu))
            del self.series[:-4000]

    def before_io_wait(self, timeout: float) -> None:
        self.rounds += 1
        if timeout > 0:
            self.waits += 1

    def dump(self, path: str) -> None:
        if self.cprofile is not None:
            self.cprofile.disable()
        elif self.calls_on:
            sys.setprofile(None)  # the dump itself is not the daemon's work
        doc = {
            "steps": dict(self.steps),
            "step_ns": dict(self.step_ns),
            "step_cpu_ns": dict(self.step_cpu_ns),
            "series": self.series,
            "rounds": self.rounds,
            "waits": self.waits,
            "calls": self.calls,
        }
        if self.cprofile is not None:
            # Each dump ends one profile and starts the next: the one
            # written after a phase holds that phase alone.
            self.cprofile.dump_stats(path + ".prof")
            self.cprofile = cProfile.Profile()
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
        if self.cprofile is not None:
            self.cprofile.enable()
        elif self.calls_on:
            sys.setprofile(self._profile)


def _run_daemon(
    argv: list[str], dump_path: str, split: str, calls: bool, cprofile: bool, tree_steps: int
) -> None:
    """``python -m iopd <argv>`` with a ``StepCounter`` in its trio run."""
    counter = StepCounter(split, calls, cprofile)
    signal.signal(DUMP_SIGNAL, lambda *_: counter.dump(dump_path))
    signal.signal(
        CALLTREE_SIGNAL, lambda *_: counter.arm_calltree(dump_path + ".calltree", tree_steps)
    )
    real_run = trio.run

    def run(*args: Any, **kwargs: Any) -> Any:
        kwargs["instruments"] = [*kwargs.get("instruments", ()), counter]
        return real_run(*args, **kwargs)

    trio.run = run  # type: ignore[assignment]
    from iopd.cli import main

    sys.exit(main(argv))


class PacedProvider(bg.MockProvider):
    """bench_gateway's provider; ``"model":"slow"`` streams ``chunks`` chunks,
    one every ``interval`` seconds, then ends the response."""

    def __init__(self, chunks: int, interval: float) -> None:
        super().__init__()
        self.chunks = chunks
        self.interval = interval

    async def handle(self, stream: trio.SocketStream) -> None:
        buf = bytearray()
        try:
            while (request := await bg.read_request(stream, buf)) is not None:
                head, body = request
                if b'"model":"slow"' in body:
                    await self._paced(stream)
                elif head.startswith(b"get /v1/models"):
                    await stream.send_all(bg._MODELS_RESPONSE)
                elif b'"stream":true' in body:
                    await stream.send_all(bg._SSE_HEAD + bg._SSE_FIRST)
                    await stream.send_all(bg._SSE_REST)
                else:
                    await stream.send_all(bg._COMPLETION_RESPONSE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _paced(self, stream: trio.SocketStream) -> None:
        await stream.send_all(bg._SSE_HEAD)
        for i in range(self.chunks):
            await trio.sleep(self.interval)
            await stream.send_all(bg._chunked(bg._sse_chunk(i, " paced")))
        await trio.sleep(self.interval)
        await stream.send_all(bg._chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")


async def _serve_provider(chunks: int, interval: float) -> None:
    provider = PacedProvider(chunks, interval)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(provider.handle, listeners)


# ------------------------------------------------------------ the orchestrator


class Daemon:
    def __init__(self, name: str, proc: subprocess.Popen[bytes], dump_path: Path) -> None:
        self.name = name
        self.proc = proc
        self.dump_path = dump_path

    def counts(self) -> dict[str, Any]:
        """Ask the daemon for its counters and wait for the file."""
        before = self.dump_path.stat().st_mtime_ns if self.dump_path.exists() else 0
        os.kill(self.proc.pid, DUMP_SIGNAL)
        deadline = time.monotonic() + bg.GUARD_S
        while time.monotonic() < deadline:
            if self.dump_path.exists() and self.dump_path.stat().st_mtime_ns != before:
                doc: dict[str, Any] = json.loads(self.dump_path.read_text())
                doc["cpu_s"] = bg.run_seconds(self.proc.pid)
                return doc
            time.sleep(0.01)
        raise SystemExit(f"{self.name} did not dump its counters")


async def _requests(port: int, body: bytes, count: int, gap: float, concurrency: int) -> None:
    """``count`` requests over ``concurrency`` connections, each one at a time."""
    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            share = count // concurrency + (1 if i < count % concurrency else 0)
            if share:
                nursery.start_soon(_one_client, port, body, share, gap)


async def _one_client(port: int, body: bytes, count: int, gap: float) -> None:
    client = await bg.Client.open("127.0.0.1", port, bg.TOKEN)
    try:
        for _ in range(count):
            start = time.perf_counter()
            with trio.fail_after(bg.GUARD_S):
                status = await client.request(body)
            LATENCIES.append(time.perf_counter() - start)
            if status != 200:
                raise SystemExit(f"request failed with status {status}")
            if gap:
                await trio.sleep(gap)
    finally:
        await client.aclose()


def _strace_start(pid: int, out: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["strace", "-c", "-f", "-o", str(out), "-p", str(pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)  # attached
    return proc


def _strace_stop(proc: subprocess.Popen[bytes], out: Path) -> dict[str, int]:
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=bg.GUARD_S)
    calls: dict[str, int] = {}
    for line in out.read_text().splitlines():
        parts = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            calls[parts[-1]] = int(parts[3])
    return calls


def _phase(
    name: str,
    daemons: list[Daemon],
    drive: Any,
    units: int,
    args: argparse.Namespace,
    tmp: Path,
) -> None:
    trio.run(drive, args.warmup)  # warm-up, not counted
    tracers = {d.name: _strace_start(d.proc.pid, tmp / f"{d.name}.strace") for d in daemons}
    if not args.strace:
        for t in tracers.values():
            t.kill()
            t.wait()
        tracers = {}
    before = {d.name: d.counts() for d in daemons}
    if args.calltree:
        for d in daemons:  # traced from each one's next task step
            os.kill(d.proc.pid, CALLTREE_SIGNAL)
    LATENCIES.clear()
    trio.run(drive, args.requests)
    # (The client's own wall clock: moves with load, unlike the counts.)
    print(f"{name}: latency p50 {statistics.median(LATENCIES) * 1e3:.3f} ms", flush=True)
    after = {d.name: d.counts() for d in daemons}
    syscalls = {n: _strace_stop(t, tmp / f"{n}.strace") for n, t in tracers.items()}
    unit = "chunk" if name == "paced" else "request"
    print(f"{name}: {units} {unit}s", flush=True)
    for d in daemons:
        b, a = before[d.name], after[d.name]
        steps = Counter(a["steps"])
        steps.subtract(b["steps"])
        total = sum(steps.values())
        line = (
            f"  {d.name:<5} task steps/{unit} {total / units:6.2f}  "
            f"rounds {(a['rounds'] - b['rounds']) / units:6.2f}  "
            f"waits {(a['waits'] - b['waits']) / units:5.2f}  "
            f"CPU {(a['cpu_s'] - b['cpu_s']) * 1e6 / units:6.0f} µs"
        )
        if d.name in syscalls:
            calls = syscalls[d.name]
            line += f"  syscalls {sum(calls.values()) / units:5.1f}: " + ", ".join(
                f"{k} {v / units:.2f}"
                for k, v in sorted(calls.items(), key=lambda kv: -kv[1])
                if v / units >= 0.05
            )
        print(line, flush=True)
        if args.calls:
            print(f"      Python calls/{unit} {(a['calls'] - b['calls']) / units:7.0f}")
        if args.cprofile:
            _print_profile(d.dump_path.with_name(d.dump_path.name + ".prof"), units, args.cprofile)
        if args.split and a.get("series"):
            # One request at a time on one connection: its steps alternate.
            tail = a["series"][-2 * units :]
            for parity in (0, 1):
                xs = tail[parity::2]
                print(
                    f"      every other step of {args.split} ({parity}::2): wall p50 "
                    f"{statistics.median(x[0] for x in xs) / 1000:.0f} µs, CPU p50 "
                    f"{statistics.median(x[1] for x in xs) / 1000:.0f} µs"
                )
        if args.calltree:
            _print_calltree(d, Path(args.calltree), name)
        if args.tasks:
            step_ns = Counter(a["step_ns"])
            step_ns.subtract(b["step_ns"])
            step_cpu = Counter(a["step_cpu_ns"])
            step_cpu.subtract(b["step_cpu_ns"])
            for task, n in steps.most_common():
                if n / units >= 0.05:
                    us = step_ns[task] / 1000 / units
                    cpu = step_cpu[task] / 1000 / units
                    print(f"      {n / units:6.2f}  {us:6.0f} µs wall {cpu:6.0f} µs CPU  {task}")


def _print_calltree(d: Daemon, out_dir: Path, phase: str) -> None:
    """Copy the daemon's call tree to ``out_dir``; print its steps' call events."""
    source = d.dump_path.with_name(d.dump_path.name + ".calltree")
    if not source.exists():
        print(f"      call tree: {d.name} ran fewer task steps than asked")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{phase}-{d.name}.calltree.txt"
    text = source.read_text()
    target.write_text(text)
    source.unlink()  # a later phase writes its own
    # Per step: its call events, and how many came before its first write
    # (``write_now``: the write that hands the request or the reply on).
    steps: list[list[Any]] = []
    for line in text.splitlines():
        if line.startswith("=== step "):
            steps.append([line[len("=== step ") :], 0, None])
        elif steps:
            step = steps[-1]
            step[1] += 1
            if step[2] is None and line.lstrip().startswith("write_now "):
                step[2] = step[1] - 1
    print(f"      call tree ({target}): call events per step (before its first write), in order")
    for name, n, first_write in steps:
        before = f"({first_write})" if first_write is not None else ""
        print(f"        {n:6d} {before:>7}  {name}")


def _print_profile(path: Path, units: int, top: int) -> None:
    """A phase's profile per unit: calls and own µs (cProfile's clock, so
    inflated by the profiler itself; the shares are what to read)."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])
    total = sum(v[2] for v in stats.values())
    print(f"      profile: {total * 1e6 / units:.0f} µs own time per unit (profiled)")
    for (file, line, func), (_cc, nc, tt, ct, _callers) in rows[:top]:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        print(
            f"      {nc / units:6.2f} calls {tt * 1e6 / units:6.1f} µs own {ct * 1e6 / units:7.1f} cum"
            f"  {func}  {where}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--role", choices=["provider", "daemon"], help=argparse.SUPPRESS)
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    parser.add_argument("--phases", default="plain,stream,paced")
    parser.add_argument("--requests", type=int, default=200, help="requests (streams) per phase")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--gap", type=float, default=0.02, help="seconds between requests")
    parser.add_argument("--chunks", type=int, default=20, help="chunks per paced stream")
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between chunks")
    parser.add_argument("--concurrency", type=int, default=1, help="connections at once")
    parser.add_argument("--strace", action="store_true", help="count system calls too")
    parser.add_argument("--tasks", action="store_true", help="steps per task")
    parser.add_argument(
        "--split",
        default="",
        help="task name part (e.g. _handle_connection): p50 wall/CPU of its odd and even steps",
    )
    parser.add_argument("--calls", action="store_true", help="count Python calls per unit")
    parser.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="N",
        help="profile each daemon (cProfile) over the phase; print its N functions of most own time",
    )
    parser.add_argument(
        "--calltree",
        default="",
        metavar="DIR",
        help="write each daemon's Python calls, in order, over its first task steps of a phase",
    )
    parser.add_argument(
        "--calltree-steps", type=int, default=12, help="task steps in the call tree"
    )
    parser.add_argument(
        "--pin",
        default="",
        help="pin processes to cores, e.g. 'edge=0,node=1,provider=1,client=1' (default: not pinned)",
    )
    args, rest = parser.parse_known_args()
    if args.role == "provider":
        trio.run(_serve_provider, args.chunks, args.interval)
        return
    if sum(map(bool, (args.calls, args.cprofile, args.calltree))) > 1:
        parser.error("--calls, --cprofile and --calltree use the profile hook: one at a time")
    if args.role == "daemon":
        _run_daemon(
            rest, args.dump, args.split, args.calls, args.cprofile, args.calltree_steps
        )
        return

    me = [sys.executable, __file__]
    with tempfile.TemporaryDirectory(prefix="iopd-count-") as tmp_dir, bg.processes() as procs:
        tmp = Path(tmp_dir)
        provider = procs.start(
            me + ["--role", "provider", "--chunks", str(args.chunks)]
            + ["--interval", str(args.interval)]
        )
        assert provider.stdout is not None
        provider_port = int(provider.stdout.readline())
        daemon_flags = ["--split", args.split] + (["--calls"] if args.calls else [])
        daemon_flags += ["--cprofile", str(args.cprofile)]
        daemon_flags += ["--calltree-steps", str(args.calltree_steps)]
        edge_cfg = tmp / "edge.yaml"
        edge_cfg.write_text(
            bg.EDGE_YAML.format(
                caller_hash=bg._sha256(bg.TOKEN),
                node_hash=bg._sha256(bg.NODE_TOKEN),
                provider_port=provider_port,
                log_level="info",
                limits="",  # no per-principal limits: the request path alone
            )
        )
        edge_proc = procs.start(
            me + ["--role", "daemon", "--dump", str(tmp / "edge.json")]
            + daemon_flags
            + ["edge", "--config", str(edge_cfg)],
            tmp / "edge.log",
        )
        m = bg._wait_log(tmp / "edge.log", r"event=edge_started .*wire=\S*:(\d+) .*openai=\S*:(\d+)")
        wire_port, edge_port = int(m.group(1)), int(m.group(2))
        node_cfg = tmp / "node.yaml"
        node_cfg.write_text(
            bg.NODE_YAML.format(wire_port=wire_port, node_token=bg.NODE_TOKEN, log_level="info")
        )
        node_proc = procs.start(
            me + ["--role", "daemon", "--dump", str(tmp / "node.json")]
            + daemon_flags
            + ["node", "--config", str(node_cfg)],
            tmp / "node.log",
        )
        bg._wait_log(tmp / "edge.log", r"event=node_connected")
        time.sleep(1.0)  # the first health probe
        daemons = [Daemon("edge", edge_proc, tmp / "edge.json"), Daemon("node", node_proc, tmp / "node.json")]
        pins = dict(item.split("=") for item in args.pin.split(",") if item)
        for name, proc in (("edge", edge_proc), ("node", node_proc), ("provider", provider)):
            if name in pins:
                os.sched_setaffinity(proc.pid, {int(pins[name])})
        if "client" in pins:
            os.sched_setaffinity(0, {int(pins["client"])})
        plain = bg._chat_body("bench", stream=False)
        streamed = bg._chat_body("bench", stream=True)
        paced = bg._chat_body("slow", stream=True)
        c = args.concurrency
        drives = {
            "plain": (lambda n: _requests(edge_port, plain, n, args.gap, c), args.requests),
            "stream": (lambda n: _requests(edge_port, streamed, n, args.gap, c), args.requests),
            "paced": (
                lambda n: _requests(edge_port, paced, max(1, n // args.chunks), args.gap, c),
                max(1, args.requests // args.chunks) * args.chunks,
            ),
        }
        for name in args.phases.split(","):
            drive, units = drives[name]
            _phase(name, daemons, drive, units, args, tmp)


if __name__ == "__main__":
    main()
