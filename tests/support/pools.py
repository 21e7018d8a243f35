"""A provider pool for tests of its trio layer and of what sits on it (controls): a made pool, a held lease."""

from __future__ import annotations

import trio
import trio.testing

from iopd.edge.pool import GroupPolicy, Lease, PoolSnapshot, ProviderPool, ProviderSlot


def make_pool(
    capacity: int = 1,
    *,
    max_queue: int = 10,
    queue_timeout: float = 30.0,
    group_timeout: float | None = None,
    observed: list[tuple[str, float, str]] | None = None,
) -> ProviderPool:
    snapshot = PoolSnapshot(
        providers={
            "a": ProviderSlot("a", "n1", "echo", capacity, 0, 0, True),
            "b": ProviderSlot("b", "n2", "openai", capacity, 0, 1, True),
        },
        groups={
            "m": GroupPolicy("m", (("a", "echo-1"), ("b", "gpt")), group_timeout),
            "only-a": GroupPolicy("only-a", (("a", "echo-1"),)),
        },
        max_queue=max_queue,
        queue_timeout=queue_timeout,
    )
    pool = ProviderPool(
        snapshot,
        on_wait_done=(lambda g, w, o: observed.append((g, w, o))) if observed is not None else None,
    )
    pool.set_node_connected("n1", True)
    pool.set_node_connected("n2", True)
    return pool


def in_flight(pool: ProviderPool, pid: str) -> int:
    return pool.provider_loads()[pid].in_flight


async def hold(
    pool: ProviderPool,
    group: str,
    release: trio.Event,
    got: list[Lease],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    task_status.started()
    async with pool.lease(group) as lease:
        got.append(lease)
        await release.wait()
