"""The console's activity recorder: per-minute usage in a ring, bounded keys, recent errors.

An injected clock drives the minutes: each test states the time of each note.
"""

from __future__ import annotations

import pytest

from iopd.edge.metering.activity import MAX_MESSAGE, OTHER, RATE_MINUTES, ActivityRecorder


class Clock:
    def __init__(self, t: float = 1_000_000 * 60.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def minutes(self, n: float) -> None:
        self.t += 60.0 * n


def recorder(clock: Clock, **kw: int) -> ActivityRecorder:
    return ActivityRecorder(clock=clock, **kw)


def test_usage_sums_per_principal_and_model_busiest_first() -> None:
    clock = Clock()
    rec = recorder(clock)
    rec.note("alice", "gpt", tokens=100)
    rec.note("alice", "gpt", tokens=50)
    rec.note("bob", "gpt", tokens=400)
    rec.note("alice", "llama", tokens=0, ok=False, status=503, code="queue_full")
    rows = rec.usage()
    assert [(r["principal"], r["model"], r["requests"], r["tokens"]) for r in rows] == [
        ("bob", "gpt", 1, 400),
        ("alice", "gpt", 2, 150),
        ("alice", "llama", 1, 0),
    ]
    assert rows[1]["requests_per_min"] == round(2 / RATE_MINUTES, 2)
    assert rows[1]["tokens_per_min"] == 150 / RATE_MINUTES
    assert rows[2]["errors"] == 1


def test_rates_cover_the_last_minutes_and_totals_the_window() -> None:
    clock = Clock()
    rec = recorder(clock, minutes=15)
    rec.note("alice", "gpt", tokens=500)  # minute 0
    clock.minutes(RATE_MINUTES)  # minute 5: minute 0 is out of the rate, still in the window
    rec.note("alice", "gpt", tokens=100)
    (row,) = rec.usage()
    assert row["tokens_per_min"] == 100 / RATE_MINUTES
    assert row["tokens"] == 600
    assert row["requests"] == 2


def test_a_minute_leaves_the_window_and_its_bucket_is_reused() -> None:
    clock = Clock()
    rec = recorder(clock, minutes=5)
    rec.note("alice", "gpt", tokens=1)
    clock.minutes(4)
    assert rec.usage()[0]["tokens"] == 1  # still inside the 5 minutes
    clock.minutes(1)
    assert rec.usage() == []  # its minute is gone
    rec.note("bob", "gpt", tokens=7)  # the same ring slot, emptied first
    assert [(r["principal"], r["tokens"]) for r in rec.usage()] == [("bob", 7)]


def test_a_long_idle_gap_forgets_everything() -> None:
    clock = Clock()
    rec = recorder(clock, minutes=5)
    rec.note("alice", "gpt", tokens=1)
    clock.minutes(60 * 24)
    assert rec.usage() == []


def test_a_clock_stepping_back_counts_in_the_latest_minute() -> None:
    clock = Clock()
    rec = recorder(clock, minutes=5)
    rec.note("alice", "gpt", tokens=1)
    clock.minutes(-30)  # an NTP step back: no bucket of the past is reopened
    rec.note("alice", "gpt", tokens=2)
    assert rec.usage()[0]["tokens"] == 3


def test_keys_past_the_cap_are_counted_together() -> None:
    clock = Clock()
    rec = recorder(clock, max_keys=2)
    for name in ("a", "b", "c", "d"):
        rec.note(name, "gpt", tokens=10)
    rec.note("a", "gpt", tokens=1)  # a known key still counts as itself
    rows = {(r["principal"], r["model"]): r for r in rec.usage()}
    assert set(rows) == {("a", "gpt"), ("b", "gpt"), (OTHER, OTHER)}
    assert rows[(OTHER, OTHER)]["requests"] == 2
    assert rows[("a", "gpt")]["tokens"] == 11


def test_errors_newest_first_bounded_scrubbed_and_cut() -> None:
    clock = Clock()
    rec = ActivityRecorder(clock=clock, max_errors=3, scrub=lambda s: s.replace("sk-1", "[redacted]"))
    for i in range(5):
        clock.t += 1
        rec.note("alice", "gpt", ok=False, status=502, code=f"e{i}", message="key sk-1 " + "x" * 500)
    rec.note("alice", "gpt", ok=True)  # a success is not an error
    errors = rec.recent_errors()
    assert [e["code"] for e in errors] == ["e4", "e3", "e2"]
    assert errors[0]["message"].startswith("key [redacted] ")
    assert len(errors[0]["message"]) == MAX_MESSAGE
    assert errors[0]["status"] == 502
    assert errors[0]["time"] == clock.t


def test_changes_counts_every_note() -> None:
    rec = recorder(Clock())
    assert rec.changes == 0
    rec.note("a", "m")
    rec.note("a", "m", ok=False)
    assert rec.changes == 2


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        ActivityRecorder(minutes=RATE_MINUTES - 1)
    with pytest.raises(ValueError):
        ActivityRecorder(max_keys=0)
