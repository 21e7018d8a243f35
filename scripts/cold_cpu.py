#!/usr/bin/env python3
"""How much longer the same Python work takes after the process slept.

The gateway's cold path (one request every 50 ms) costs the edge about
three times the CPU of the same request sent back to back
(``count_path.py --split _handle_connection --gap 0`` vs ``--gap 0.05``).
This script shows the machine side of that with no gateway at all: a fixed
piece of pure-Python work (JSON decode, a SHA-256, a dict and a list walk
over ``--footprint`` KB of objects: the shape of a request path) timed
back to back, then after sleeping ``--gaps`` seconds before each run; it
prints each gap's median on-CPU and wall µs and the ratio to back to back.
No other process is involved, so the slowdown is what a wake-up from idle
costs this machine (cold caches, a host that ran something else meanwhile),
not scheduling between the gateway's daemons.

    .venv/bin/python scripts/cold_cpu.py
    .venv/bin/python scripts/cold_cpu.py --footprint 2048 --runs 200
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time


def _workload(footprint_kb: int) -> tuple[list[bytes], list[dict[str, object]]]:
    bodies = [
        json.dumps(
            {"model": f"m{i}", "messages": [{"role": "user", "content": "hi " * 40}], "n": i}
        ).encode()
        for i in range(16)
    ]
    # ~footprint_kb of small objects touched once per run, like the code and
    # data a request path walks through.
    objects = [{"k": i, "v": str(i) * 8, "l": [i, i + 1]} for i in range(footprint_kb * 4)]
    return bodies, objects


def _run(bodies: list[bytes], objects: list[dict[str, object]]) -> int:
    total = 0
    for body in bodies:
        doc = json.loads(body)
        total += len(hashlib.sha256(body).digest()) + len(doc["messages"])
    for obj in objects:
        total += obj["k"]  # type: ignore[operator]
    return total


def measure(
    gap: float, runs: int, bodies: list[bytes], objects: list[dict[str, object]]
) -> tuple[float, float]:
    """Median (on-CPU µs, wall µs) of ``runs`` runs, each after ``gap`` s asleep."""
    cpu, wall = [], []
    for _ in range(runs):
        if gap:
            time.sleep(gap)
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        _run(bodies, objects)
        cpu.append((time.thread_time_ns() - c0) / 1000)
        wall.append((time.perf_counter_ns() - w0) / 1000)
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--gaps", default="0.001,0.005,0.02,0.05", help="seconds asleep before each run"
    )
    parser.add_argument("--runs", type=int, default=150, help="runs per gap")
    parser.add_argument("--footprint", type=int, default=512, help="KB of objects walked per run")
    args = parser.parse_args()
    bodies, objects = _workload(args.footprint)
    measure(0, args.runs, bodies, objects)  # warm-up
    base_cpu, base_wall = measure(0, args.runs, bodies, objects)
    print(f"back to back: CPU {base_cpu:7.0f} µs  wall {base_wall:7.0f} µs")
    for gap in (float(g) for g in args.gaps.split(",")):
        cpu, wall = measure(gap, args.runs, bodies, objects)
        print(
            f"after {gap * 1e3:5.1f} ms asleep: CPU {cpu:7.0f} µs  wall {wall:7.0f} µs"
            f"  (x{cpu / base_cpu:.2f} CPU)"
        )
    cpu, wall = measure(0, args.runs, bodies, objects)
    print(f"back to back again: CPU {cpu:7.0f} µs  wall {wall:7.0f} µs")


if __name__ == "__main__":
    main()
