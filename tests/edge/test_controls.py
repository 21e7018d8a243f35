"""``RuntimeControls``: bodies validated, changes applied, logged, counted.

The domain object is driven directly with the bytes a route would hand it;
the HTTP wiring is in ``tests/edge/admin/test_controls.py``, the pool's side in
``tests/edge/pool/test_controls.py``.
"""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from iopd import errors
from iopd.edge.metering.metrics import GatewayMetrics
from iopd.edge.pool import Lease, ProviderPool
from iopd.edge.runtime.runtime_controls import RECENT_EVENTS, RuntimeControls
from tests.support.pools import hold, make_pool
from wire.messages import ControlUpdate, ProviderControlSpec


class NodeWire:
    """Stands in for ``NodeHub.send_controls``: records each update, or refuses
    with 409 like a hub whose node is away."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, ControlUpdate]] = []
        self.away: set[str] = set()

    def __call__(self, node_id: str, update: ControlUpdate) -> None:
        if node_id in self.away:
            raise errors.NodeDisconnected(f"node {node_id} is not connected")
        self.sent.append((node_id, update))


def controls_of(
    pool: ProviderPool, wire: NodeWire | None = None
) -> tuple[RuntimeControls, GatewayMetrics]:
    metrics = GatewayMetrics("edge-c")
    controls = RuntimeControls(
        pool, metrics, lambda: {"n1", "n2", "n3"}, send=wire or NodeWire(), clock=lambda: 1000.0
    )
    return controls, metrics


def actions(metrics: GatewayMetrics) -> dict[str, float]:
    return {
        s.labels["action"]: s.value
        for fam in metrics.registry.collect()
        if fam.name == "iop_admin_actions"
        for s in fam.samples
        if s.name == "iop_admin_actions_total"
    }


async def test_state_override_and_reset_answer_the_effective_view() -> None:
    pool = make_pool(capacity=2)  # a: n1, priority 0; b: n2, priority 1
    c, metrics = controls_of(pool)
    view = c.set_state("a", b'{"state": "draining"}')
    assert view == {
        "id": "a",
        "node_id": "n1",
        "state": "drained",  # nothing in flight
        "capacity": 2,
        "priority": 0,
        "override": {"capacity": None, "priority": None},
        "in_flight": 0,
    }
    view = c.set_override("a", b'{"capacity": 5}')
    assert (view["state"], view["capacity"], view["override"]) == (
        "drained",
        5,
        {"capacity": 5, "priority": None},
    )
    view = c.set_override("a", b'{"priority": 3}')  # capacity missing: kept
    assert view["override"] == {"capacity": 5, "priority": 3} and view["priority"] == 3
    view = c.set_override("a", b'{"capacity": null}')  # null clears; priority kept
    assert view["override"] == {"capacity": None, "priority": 3} and view["capacity"] == 2
    assert c.set_override("a", b"{}")["override"] == {"capacity": None, "priority": 3}
    view = c.reset("a")
    assert view["state"] == "active" and view["override"] == {"capacity": None, "priority": None}
    assert pool.snapshot == pool.configured
    assert actions(metrics) == {"drain": 1, "override": 4, "reset": 1}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"state": "paused"}', "state"),
        (b'{"state": 1}', "state"),
        (b'{"state": null}', "state"),
        (b"{}", None),
        (b'{"state": "active", "extra": 1}', None),
        (b"", None),
        (b"[]", None),
        (b"not json", None),
        (b"\xff\xfe", None),
    ],
)
async def test_a_bad_state_body_is_a_400_naming_the_field(body: bytes, param: str | None) -> None:
    c, metrics = controls_of(make_pool())
    with pytest.raises(errors.InvalidRequest) as info:
        c.set_state("a", body)
    assert info.value.status == 400
    assert info.value.param == param
    assert "state" in info.value.message
    assert c.view("a")["state"] == "active" and actions(metrics) == {}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"capacity": -1}', "capacity"),
        (b'{"capacity": 1.5}', "capacity"),
        (b'{"capacity": "3"}', "capacity"),
        (b'{"capacity": true}', "capacity"),
        (b'{"priority": -2}', "priority"),
        (b'{"priority": 99999999999999999999999}', "priority"),
        (b'{"capacity": 2147483648}', "capacity"),
        (b'{"weight": 1}', None),
        (b"", None),
    ],
)
async def test_a_bad_override_is_a_400_and_changes_nothing(body: bytes, param: str | None) -> None:
    c, _ = controls_of(make_pool())
    c.set_override("a", b'{"capacity": 4}')
    with pytest.raises(errors.InvalidRequest) as info:
        c.set_override("a", body)
    assert info.value.param == param
    assert c.view("a")["override"] == {"capacity": 4, "priority": None}


async def test_unknown_provider_or_node_is_a_404() -> None:
    c, metrics = controls_of(make_pool())
    long_id = "x" * 5000
    for call in (
        lambda: c.set_state(long_id, b'{"state": "disabled"}'),
        lambda: c.set_override("nope", b'{"capacity": 1}'),
        lambda: c.reset("nope"),
    ):
        with pytest.raises(errors.ResourceNotFound) as info:
            call()
        assert info.value.status == 404 and info.value.param == "provider_id"
        assert len(info.value.message) < 200  # the path's id is cut, never echoed whole
    with pytest.raises(errors.ResourceNotFound) as info:
        c.drain_node("nope")
    assert info.value.param == "node_id"
    assert actions(metrics) == {}


async def test_node_drain_drains_every_provider_of_the_node_and_keeps_overrides() -> None:
    pool = make_pool()
    c, metrics = controls_of(pool)
    c.set_override("a", b'{"capacity": 7}')
    answer = c.drain_node("n1", b"{}")
    assert answer["id"] == "n1"
    assert [(p["id"], p["state"], p["capacity"]) for p in answer["providers"]] == [
        ("a", "drained", 7)
    ]
    assert c.view("b")["state"] == "active"
    assert c.drain_node("n3") == {"id": "n3", "providers": []}  # a node without providers
    with pytest.raises(errors.InvalidRequest):
        c.drain_node("n1", b'{"now": true}')
    assert actions(metrics) == {"override": 1, "node_drain": 2}


async def test_draining_reports_drained_when_the_last_lease_is_back(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = make_pool(capacity=2)
    c, _ = controls_of(pool)
    release = trio.Event()
    got: list[Lease] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, pool, "only-a", release, got)
        await trio.testing.wait_all_tasks_blocked()
        view = c.set_state("a", b'{"state": "draining"}')
        assert (view["state"], view["in_flight"]) == ("draining", 1)
        release.set()
    assert c.view("a")["state"] == "drained"
    assert c.set_state("a", b'{"state": "active"}')["state"] == "active"


async def test_each_change_is_one_log_line_and_one_recent_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c, _ = controls_of(make_pool())
    with caplog.at_level(logging.INFO, logger="iopd.edge.controls"):
        c.set_state("a", b'{"state": "disabled"}')
        c.set_override("b", b'{"capacity": 0, "priority": 2}')
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "event=admin_action action=disable node=n1 provider=a state=active->disabled "
        "capacity=none->none priority=none->none",
        "event=admin_action action=override node=n2 provider=b state=active->active "
        "capacity=none->0 priority=none->2",
    ]
    events = c.recent_events()
    assert events[0] == {
        "at": 1000.0,
        "action": "disable",
        "node_id": "n1",
        "provider_id": "a",
        "old": {"state": "active", "capacity": None, "priority": None},
        "new": {"state": "disabled", "capacity": None, "priority": None},
    }
    assert events[1]["new"] == {"state": "active", "capacity": 0, "priority": 2}


async def test_recent_events_are_bounded() -> None:
    c, metrics = controls_of(make_pool())
    for i in range(RECENT_EVENTS + 7):
        c.set_override("a", f'{{"capacity": {i}}}'.encode())
    events = c.recent_events()
    assert len(events) == RECENT_EVENTS
    assert events[0]["new"]["capacity"] == 7 and events[-1]["new"]["capacity"] == RECENT_EVENTS + 6
    assert actions(metrics) == {"override": RECENT_EVENTS + 7}


async def test_each_change_goes_to_the_providers_node_before_the_pool() -> None:
    """The node holds the controls: every change is sent to it, as
    the whole resulting control of each provider, one message per action."""
    wire = NodeWire()
    c, _ = controls_of(make_pool(), wire)
    c.set_state("a", b'{"state": "disabled"}')
    c.set_override("a", b'{"capacity": 4}')
    c.reset("b")
    c.drain_node("n1")
    spec = ProviderControlSpec
    assert wire.sent == [
        ("n1", ControlUpdate(controls=[spec(provider_id="a", state="disabled")])),
        ("n1", ControlUpdate(controls=[spec(provider_id="a", state="disabled", capacity=4)])),
        ("n2", ControlUpdate(controls=[spec(provider_id="b")])),
        ("n1", ControlUpdate(controls=[spec(provider_id="a", state="draining", capacity=4)])),
    ]


async def test_a_node_away_is_a_409_and_changes_nothing() -> None:
    wire = NodeWire()
    wire.away.add("n1")
    c, metrics = controls_of(make_pool(), wire)
    for call in (
        lambda: c.set_state("a", b'{"state": "disabled"}'),
        lambda: c.set_override("a", b'{"capacity": 1}'),
        lambda: c.reset("a"),
        lambda: c.drain_node("n1"),
    ):
        with pytest.raises(errors.NodeDisconnected) as info:
            call()
        assert (info.value.status, info.value.code) == (409, "node_disconnected")
    assert c.view("a")["state"] == "active" and c.recent_events() == []
    assert actions(metrics) == {}
    with pytest.raises(errors.InvalidRequest):  # a bad body is still a 400 first
        c.set_state("a", b'{"state": "off"}')
