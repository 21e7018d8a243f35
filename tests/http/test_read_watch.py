"""The provider client's ``ReadWatch``: every wait timed out exactly at its
``read_timeout``, never earlier, and nothing left behind."""

from __future__ import annotations

import trio
import trio.lowlevel
import trio.testing

from iopd.http.read_watch import ReadWatch


async def test_a_wait_expires_at_its_timeout_not_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    watch = ReadWatch()
    expired: list[float] = []
    with trio.fail_after(100):
        t0 = trio.current_time()
        watch.begin("a", 10.0, lambda: expired.append(trio.current_time()))
        await trio.sleep(9.999)
        assert expired == [] and watch.waiting == 1
        await trio.sleep(0.002)
        assert expired == [t0 + 10.0]
        assert watch.waiting == 0


async def test_waits_that_end_in_time_never_expire(
    autojump_clock: trio.testing.MockClock,
) -> None:
    watch = ReadWatch()
    expired: list[str] = []
    with trio.fail_after(1000):
        for _ in range(50):  # one piece every 8 s, each wait under 10 s
            watch.begin("s", 10.0, lambda: expired.append("s"))
            await trio.sleep(8.0)
            watch.end("s")
        await trio.sleep(30.0)
        assert expired == []
        assert watch.waiting == 0


async def test_an_earlier_expiry_moves_the_wake_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    watch = ReadWatch()
    expired: list[tuple[str, float]] = []
    with trio.fail_after(1000):
        t0 = trio.current_time()
        watch.begin("long", 100.0, lambda: expired.append(("long", trio.current_time())))
        await trio.sleep(1.0)  # the watch now sleeps until t0 + 100
        watch.begin("short", 2.0, lambda: expired.append(("short", trio.current_time())))
        await trio.sleep(200.0)
        assert expired == [("short", t0 + 3.0), ("long", t0 + 100.0)]


async def test_the_task_ends_when_nothing_waits_and_comes_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    watch = ReadWatch()
    expired: list[str] = []

    def watch_tasks() -> int:
        root = trio.lowlevel.current_root_task()
        assert root is not None
        names = [t.name for nursery in root.child_nurseries for t in nursery.child_tasks]
        return names.count("iopd.http.read_watch")

    with trio.fail_after(1000):
        watch.begin("a", 5.0, lambda: expired.append("a"))
        await trio.lowlevel.checkpoint()
        assert watch_tasks() == 1
        watch.end("a")
        await trio.sleep(6.0)  # the task wakes at the stale expiry, finds nothing, ends
        assert watch_tasks() == 0 and expired == []
        watch.begin("b", 5.0, lambda: expired.append("b"))
        await trio.lowlevel.checkpoint()
        assert watch_tasks() == 1
        await trio.sleep(6.0)
        assert expired == ["b"] and watch_tasks() == 0
