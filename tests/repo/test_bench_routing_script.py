"""``scripts/bench_routing.py``'s own bookkeeping, on hand-made turns and log
lines: which replica served each turn (the edge's request log) and how the
sessions spread and moved."""

from __future__ import annotations

from pathlib import Path

from tests.support.paths import load_script

bench_routing = load_script("bench_routing")
Turn = bench_routing.Turn


def _turn(session: int, replica: str) -> Turn:
    return Turn(0.1, 0.2, 90, 10, session=session, replica=replica)


def test_placement_counts_first_turns_and_moves() -> None:
    turns = [
        _turn(0, "r0"), _turn(1, "r1"), _turn(0, "r0"), _turn(2, "r0"),
        _turn(1, "r2"), _turn(0, "r1"), _turn(1, "r2"), _turn(2, "r0"),
    ]  # fmt: skip
    assert bench_routing._placement(turns) == {"first_turns": "2/1", "moves": 2}


def test_placement_is_left_out_when_a_turn_has_no_replica() -> None:
    assert bench_routing._placement([_turn(0, "r0"), _turn(0, "")]) == {}


def test_served_by_reads_the_edge_request_log(tmp_path: Path) -> None:
    log = tmp_path / "edge.log"
    log.write_text(
        "ts=1 level=info logger=iopd.edge.request event=request request_id=req-1 principal=open "
        "group=bench provider=r2 endpoint=chat_completions status=ok\n"
        "ts=2 level=info logger=iopd.edge event=edge_started edge=e openai=127.0.0.1:9\n"
        "ts=3 level=info logger=iopd.edge.request event=request request_id=req-2 principal=open "
        "group=bench provider=r0 endpoint=chat_completions status=ok\n"
    )
    assert bench_routing._served_by(log) == {"req-1": "r2", "req-2": "r0"}


def test_summary_carries_the_placement() -> None:
    result = bench_routing.Result(wall=2.0, turns=[_turn(0, "r0"), _turn(0, "r1")])
    summary = result.summary()
    assert summary["cached_fraction"] == 0.9
    assert (summary["first_turns"], summary["moves"]) == ("1", 1)
