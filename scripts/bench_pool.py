#!/usr/bin/env python3
"""Benchmark of the pool scheduler's decisions (pure synchronous code, one core).

    .venv/bin/python scripts/bench_pool.py [--quick]

Shapes measured (100 providers on 20 nodes, 10 model groups of 10 providers,
groups overlap so capacity is shared):

1. admission + release pairs per second with half the slots busy;
2. a release while 10,000 requests wait (the release admits one waiter);
3. re-examination on a node disconnect/reconnect, and on a config refresh
   (every group), while 10,000 wait and nothing fits;

next to direct baselines: a dict increment + decrement (the least any slot
accounting can cost), ``min()`` over one group's candidates (the least a
load-based choice can cost) and a naive scan of the 10,000 waiters in enqueue
order (what re-examination costs without the per-key index).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from iopd.edge.pool.scheduler import (
    Grant,
    GroupPolicy,
    PoolSnapshot,
    ProviderSlot,
    Scheduler,
    Waiter,
)

N_NODES = 20
N_PROVIDERS = 100
N_GROUPS = 10
GROUP_SIZE = 10
CAPACITY = 4
QUEUED = 10_000


def build_snapshot(max_queue: int) -> PoolSnapshot:
    rng = random.Random(7)
    providers = {
        f"p{i}": ProviderSlot(
            provider_id=f"p{i}",
            node_id=f"n{i % N_NODES}",
            type=("openai", "ollama", "cli", "echo")[i % 4],
            capacity=CAPACITY,
            long_context_capacity=1 if i % 5 == 0 else 0,
            priority=i % 3,
        )
        for i in range(N_PROVIDERS)
    }
    pids = list(providers)
    groups = {
        f"g{g}": GroupPolicy(
            f"g{g}", tuple((pid, f"{pid}-served") for pid in rng.sample(pids, GROUP_SIZE))
        )
        for g in range(N_GROUPS)
    }
    return PoolSnapshot(providers, groups, max_queue=max_queue, queue_timeout=30.0)


def connected_scheduler(max_queue: int) -> Scheduler:
    s = Scheduler(build_snapshot(max_queue))
    for n in range(N_NODES):
        s.set_node_connected(f"n{n}", True)
    return s


def per_op_us(fn: Callable[[], None], n: int) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / n * 1e6


def bench_admit_release(n: int) -> float:
    s = connected_scheduler(0)
    groups = [f"g{g}" for g in range(N_GROUPS)]
    # Background load: roughly half of every group's slots busy.
    for g in groups:
        for _ in range(GROUP_SIZE * CAPACITY // 4):
            try:
                s.request(g)
            except Exception:
                break

    def loop() -> None:
        request, release = s.request, s.release
        for i in range(n):
            out = request(groups[i % N_GROUPS])
            assert isinstance(out, Grant)
            release(out)

    return per_op_us(loop, n)


def saturated_with_waiters(queued: int) -> tuple[Scheduler, list[Grant]]:
    s = connected_scheduler(queued + 10)
    held: list[Grant] = []
    groups = [f"g{g}" for g in range(N_GROUPS)]
    for g in groups:
        while True:
            out = s.request(g)
            if not isinstance(out, Grant):
                s.cancel(out)
                break
            held.append(out)
    for i in range(queued):
        out = s.request(groups[i % N_GROUPS], long=i % 7 == 0)
        assert isinstance(out, Waiter)
    return s, held


def bench_release_with_queue(n: int) -> float:
    s, held = saturated_with_waiters(QUEUED)
    rng = random.Random(1)
    groups = [f"g{g}" for g in range(N_GROUPS)]
    total = 0.0
    admissions = 0
    for i in range(n):
        grant = held.pop(rng.randrange(len(held)))
        t0 = time.perf_counter()
        admitted = s.release(grant)
        total += time.perf_counter() - t0
        admissions += len(admitted)
        for w in admitted:
            assert w.grant is not None
            held.append(w.grant)
        if not admitted:
            # This provider served no waiting group any more: take the slot back.
            out = s.request(grant.group_id)
            if isinstance(out, Grant):
                held.append(out)
            else:
                s.cancel(out)
        # Keep the queue at its size.
        while s.queue_depth < QUEUED:
            refill = s.request(groups[i % N_GROUPS])
            assert isinstance(refill, Waiter)
    assert admissions >= n * 0.9, "the release benchmark should mostly admit a waiter"
    return total / n * 1e6


def bench_full_pass_nothing_fits(n: int) -> float:
    s, _ = saturated_with_waiters(QUEUED)

    def loop() -> None:
        for _ in range(n // 2):
            s.set_node_connected("n0", False)
            s.set_node_connected("n0", True)

    assert s.queue_depth == QUEUED
    return per_op_us(loop, n)


def bench_refresh_nothing_fits(n: int) -> float:
    s, _ = saturated_with_waiters(QUEUED)
    snapshot = s.snapshot

    def loop() -> None:
        for _ in range(n):
            s.apply_snapshot(snapshot)

    assert s.queue_depth == QUEUED
    return per_op_us(loop, n)


def baseline_dict(n: int) -> float:
    counts = {f"p{i}": 0 for i in range(N_PROVIDERS)}
    keys = list(counts)

    def loop() -> None:
        for i in range(n):
            k = keys[i % N_PROVIDERS]
            counts[k] += 1
            counts[k] -= 1

    return per_op_us(loop, n)


def baseline_min(n: int) -> float:
    rng = random.Random(3)
    cands = [(rng.randrange(CAPACITY) / CAPACITY, rng.randrange(3), i) for i in range(GROUP_SIZE)]

    def loop() -> None:
        for _ in range(n):
            min(cands)

    return per_op_us(loop, n)


def baseline_naive_scan(n: int) -> float:
    """Walk 10,000 waiters in order asking 'does a candidate have a free slot?'."""
    s, _ = saturated_with_waiters(QUEUED)
    snap = s.snapshot
    waiters = s.pending_waiters()
    members = {gid: [pid for pid, _ in g.providers] for gid, g in snap.groups.items()}

    def loop() -> None:
        for _ in range(n):
            for w in waiters:
                for pid in members[w.group_id]:
                    if s.in_flight(pid)[0] < snap.providers[pid].capacity:
                        break

    return per_op_us(loop, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    args = ap.parse_args()
    k = 10 if args.quick else 1

    admit = bench_admit_release(200_000 // k)
    release_q = bench_release_with_queue(20_000 // k)
    full_pass = bench_full_pass_nothing_fits(2_000 // k)
    refresh = bench_refresh_nothing_fits(1_000 // k)
    b_dict = baseline_dict(1_000_000 // k)
    b_min = baseline_min(1_000_000 // k)
    b_scan = baseline_naive_scan(max(1, 20 // k))

    print(
        f"pool: {N_PROVIDERS} providers, {N_NODES} nodes, {N_GROUPS} groups x {GROUP_SIZE}, "
        f"capacity {CAPACITY}"
    )
    print(f"admission + release pair        {admit:8.2f} us   ({1e6 / admit:,.0f} pairs/s)")
    print(f"release, {QUEUED:,} waiting        {release_q:8.2f} us")
    print(f"reconnect pass, {QUEUED:,} waiting {full_pass:8.2f} us   (nothing fits)")
    print(f"refresh pass, {QUEUED:,} waiting   {refresh:8.2f} us   (all groups; nothing fits)")
    print("baselines")
    print(
        f"  dict +1/-1                    {b_dict:8.3f} us   admission+release = {admit / b_dict:,.0f}x"
    )
    print(
        f"  min() over {GROUP_SIZE} candidates      {b_min:8.3f} us   admission+release = {admit / b_min:,.0f}x"
    )
    print(
        f"  naive scan of {QUEUED:,} waiters {b_scan:8.0f} us   release = 1/{b_scan / release_q:,.0f}"
    )


if __name__ == "__main__":
    main()
