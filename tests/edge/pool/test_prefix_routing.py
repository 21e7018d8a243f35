"""The cache-aware choice as pure scheduler tests: the match threshold, the load
guard, a busy best match (wait or prefill elsewhere), session placement, the
index's invalidation, and every count back to zero."""

from __future__ import annotations

import dataclasses

from iopd.edge.pool.routing import (
    RouteAsk,
    RoutingMode,
    RoutingPolicy,
    rendezvous_order,
    session_digest,
)
from iopd.edge.pool.scheduler import (
    Grant,
    GroupPolicy,
    PoolSnapshot,
    ProviderSlot,
    Scheduler,
    Waiter,
    WaiterState,
)

BLOCK = 64
POLICY = RoutingPolicy(
    block_bytes=BLOCK,
    min_match=0.5,
    max_load_gap=1.0,
    max_load_gap_ratio=0.5,
    wait_min_tokens=32,
    prefill_tokens_per_second=100.0,
)


def make(
    n: int = 3,
    *,
    capacity: int = 1,
    routing: RoutingMode = "prefix",
    policy: RoutingPolicy = POLICY,
) -> Scheduler:
    pids = [chr(ord("a") + i) for i in range(n)]
    snap = PoolSnapshot(
        providers={p: ProviderSlot(p, f"n{p}", "echo", capacity) for p in pids},
        groups={"m": GroupPolicy("m", tuple((p, "t") for p in pids), routing=routing)},
        routing=policy,
    )
    s = Scheduler(snap)
    for p in pids:
        s.set_node_connected(f"n{p}", True, now=0.0)
    return s


def prompt(session: int, turns: int) -> bytes:
    """A conversation: a shared head, then ``turns`` blocks of its own."""
    return b"S" * BLOCK * 2 + b"".join(
        bytes([65 + session]) * BLOCK + bytes([t]) for t in range(turns)
    )


def take(s: Scheduler, data: bytes, session: str | None = None, now: float = 0.0) -> Grant | Waiter:
    return s.request("m", ask=RouteAsk(data, session), now=now)


def grant(s: Scheduler, data: bytes, session: str | None = None, now: float = 0.0) -> Grant:
    out = take(s, data, session, now)
    assert isinstance(out, Grant), out
    return out


def test_a_turn_goes_where_its_previous_turn_went() -> None:
    s = make(capacity=4)
    first = grant(s, prompt(1, 3))
    s.release(first, now=1.0)
    busy = grant(s, b"x" * BLOCK * 4)  # someone else, on the least-loaded provider
    second = grant(s, prompt(1, 4))
    assert second.provider_id == first.provider_id
    assert second.route == "prefix" and second.matched >= 0.5
    assert busy.route == "load"


def test_below_the_threshold_the_least_loaded_provider_serves() -> None:
    s = make(capacity=4)
    first = grant(s, prompt(1, 1))  # 3 blocks
    other = grant(s, b"z" * BLOCK * 10)
    assert other.provider_id != first.provider_id
    # 3 of 10 blocks held: under min_match, so load decides (not first's provider, it has one)
    g = grant(s, prompt(1, 1)[: 3 * BLOCK] + b"q" * BLOCK * 7)
    assert g.route == "load" and g.provider_id not in (first.provider_id, other.provider_id)


def test_least_load_groups_ignore_the_index() -> None:
    s = make(capacity=4, routing="least_load")
    first = grant(s, prompt(1, 3))
    s.release(first, now=1.0)
    grant(s, b"x" * BLOCK * 4)
    again = grant(s, prompt(1, 4))
    assert again.route == "load"
    assert s._index.router.index.total_blocks == 0  # nothing recorded


def test_the_load_guard_stops_a_hot_prompt_piling_onto_one_provider() -> None:
    s = make(capacity=2)
    held = [grant(s, prompt(1, 3))]
    home = held[0].provider_id
    held.append(grant(s, prompt(1, 3)))  # pressure 0.5 vs 0: within the gap of 1
    assert held[-1].provider_id == home
    # Full now: the next one goes elsewhere rather than wait (the others are idle: it
    # would prefill 5 blocks elsewhere = 80 tokens >= 32, patience 0.8 s, so it waits...)
    out = take(s, prompt(1, 3), now=0.0)
    assert isinstance(out, Waiter)
    # ...but past its patience it prefills elsewhere
    assert s.next_outlier_change() is not None
    resolved = s.outliers_due(now=5.0)
    assert resolved == [out] and out.grant is not None
    assert out.grant.provider_id != home and out.grant.route == "fallback"


def test_a_busy_best_match_with_little_to_save_is_not_waited_for() -> None:
    s = make(capacity=1, policy=dataclasses.replace(POLICY, wait_min_tokens=10_000))
    a = grant(s, prompt(1, 3))
    g = grant(s, prompt(1, 4))
    assert g.provider_id != a.provider_id and g.route == "fallback"


def test_a_waiter_takes_its_own_provider_when_it_frees() -> None:
    s = make(n=2, capacity=1)
    a = grant(s, prompt(1, 3))
    b = grant(s, prompt(2, 3))
    s.release(a, now=1.0)
    s.release(b, now=1.0)
    # Both providers busy with other sessions' new turns...
    a2 = grant(s, prompt(1, 4), now=2.0)
    b2 = grant(s, prompt(2, 4), now=2.0)
    assert (a2.provider_id, b2.provider_id) == (a.provider_id, b.provider_id)
    # ...session 1 waits first, then session 2: when 2's provider frees, 2 takes it
    w1 = take(s, prompt(1, 5), now=3.0)
    w2 = take(s, prompt(2, 5), now=3.0)
    assert isinstance(w1, Waiter) and isinstance(w2, Waiter)
    resolved = s.release(b2, now=3.1)
    assert resolved == [w2] and w2.grant is not None and w2.grant.provider_id == b.provider_id
    assert w1.state is WaiterState.PENDING
    resolved = s.release(a2, now=3.2)
    assert resolved == [w1] and w1.grant is not None and w1.grant.provider_id == a.provider_id
    for g in (w1.grant, w2.grant):
        s.release(g, now=4.0)
    router = s._index.router
    assert router.homed == {} and s.queue_depth == 0 and not s.active_grants


def test_cancelled_and_failed_waiters_give_their_home_back() -> None:
    s = make(n=2, capacity=1)
    a = grant(s, prompt(1, 3))
    grant(s, prompt(2, 3))
    w = take(s, prompt(1, 4))
    assert isinstance(w, Waiter) and s._index.router.homed == {a.provider_id: 1}
    s.cancel(w)
    assert s._index.router.homed == {}
    w = take(s, prompt(1, 4))
    s.fail_all_waiters()
    assert s._index.router.homed == {}


def test_the_index_forgets_a_provider_whose_node_reconnects_or_that_goes_down() -> None:
    s = make(capacity=4)
    g = grant(s, prompt(1, 3))
    index = s._index.router.index
    assert index.blocks(g.provider_id) == 5
    s.set_node_connected(g.node_id, False, now=1.0)
    assert index.blocks(g.provider_id) == 0
    s.set_node_connected(g.node_id, True, now=1.0)
    g2 = grant(s, prompt(1, 3))
    s.set_provider_health(g2.provider_id, "unhealthy", now=2.0)
    assert index.blocks(g2.provider_id) == 0


def test_the_index_forgets_a_disabled_or_reconfigured_provider_and_keeps_the_others() -> None:
    s = make(capacity=4)
    g = grant(s, prompt(1, 3))
    h = grant(s, prompt(2, 3))
    assert g.provider_id != h.provider_id
    index = s._index.router.index
    snap = s.snapshot
    slot = snap.providers[g.provider_id]
    providers = dict(snap.providers)
    providers[g.provider_id] = dataclasses.replace(slot, enabled=False)  # drain / disable
    s.apply_snapshot(dataclasses.replace(snap, providers=providers), now=1.0)
    assert index.blocks(g.provider_id) == 0 and index.blocks(h.provider_id) == 5
    s.apply_snapshot(dataclasses.replace(snap, routing=dataclasses.replace(POLICY, index_blocks=2)))
    assert index.blocks(h.provider_id) == 2  # a lower bound evicts, live


def test_a_sessions_first_turn_follows_its_rendezvous_ranking() -> None:
    s = make(capacity=4)
    pids = sorted(s.snapshot.providers)
    for k in range(12):
        key = f"session-{k}"
        want = rendezvous_order(session_digest("m", key), pids)[0]
        g = grant(s, f"{k}".encode() * BLOCK, session=key)
        assert g.provider_id == want and g.route == "session"
        s.release(g, now=1.0)


def test_a_seen_session_follows_the_prefix_index() -> None:
    s = make(capacity=4)
    first = grant(s, prompt(1, 3), session="s1")
    assert first.route == "session"
    later = grant(s, prompt(1, 4), session="s1")
    assert later.route == "prefix" and later.provider_id == first.provider_id


def test_session_placement_is_the_same_on_two_edges() -> None:
    one, two = make(n=4, capacity=8), make(n=4, capacity=8)
    for k in range(40):
        a = grant(one, b"p" * BLOCK, session=f"k{k}")
        b = grant(two, b"p" * BLOCK, session=f"k{k}")
        assert a.provider_id == b.provider_id
        one.release(a, now=1.0)
        two.release(b, now=1.0)


def test_a_provider_leaving_or_joining_moves_only_its_own_sessions() -> None:
    keys = [f"k{k}" for k in range(200)]
    four = ["a", "b", "c", "d"]
    before = {k: rendezvous_order(session_digest("m", k), four)[0] for k in keys}
    without_c = {k: rendezvous_order(session_digest("m", k), ["a", "b", "d"])[0] for k in keys}
    moved = {k for k in keys if before[k] != without_c[k]}
    assert moved and all(before[k] == "c" for k in moved)
    assert {k for k in keys if before[k] == "c"} == moved
    with_e = {k: rendezvous_order(session_digest("m", k), [*four, "e"])[0] for k in keys}
    joined = {k for k in keys if before[k] != with_e[k]}
    assert joined and all(with_e[k] == "e" for k in joined)


def test_a_session_over_the_load_bound_takes_the_next_in_its_ranking() -> None:
    tight = dataclasses.replace(POLICY, max_load_gap=0.0, max_load_gap_ratio=0.0)
    s = make(capacity=1, policy=tight)
    pids = sorted(s.snapshot.providers)
    order = rendezvous_order(session_digest("m", "hot"), pids)
    rival = next(
        k
        for k in (f"other-{i}" for i in range(999))
        if rendezvous_order(session_digest("m", k), pids)[0] == order[0]
    )
    assert grant(s, b"o" * BLOCK, session=rival).provider_id == order[0]
    g = grant(s, b"q" * BLOCK, session="hot")
    assert g.provider_id == order[1] and g.route == "session"


def test_decisions_and_matched_fractions_are_counted() -> None:
    s = make(capacity=4)
    grant(s, prompt(1, 3))
    grant(s, prompt(1, 4))
    router = s._index.router
    assert router.decisions == {("m", "load"): 1, ("m", "prefix"): 1}
    hist = router.matched["m"]
    assert sum(hist[:-1]) == 2 and 0.5 < hist[-1] <= 1.0


def test_a_waiter_looks_its_chain_up_once_per_change_of_the_index() -> None:
    s = make(n=2, capacity=1)
    a = grant(s, prompt(1, 3))
    b = grant(s, prompt(2, 3))
    w = take(s, prompt(1, 4))
    assert isinstance(w, Waiter)
    index = s._index.router.index
    before = index.stats(a.provider_id).lookups
    for t in range(4):  # re-examinations (b's health moves) that change nothing in the index
        s.set_provider_health(b.provider_id, "healthy" if t % 2 else "unknown", now=float(t))
    assert index.stats(a.provider_id).lookups == before
    resolved = s.release(a, now=10.0)
    assert resolved == [w] and w.grant is not None and w.grant.provider_id == a.provider_id
