"""What a node holds for all its edges (``iopd.node.edges.shared_state``), pure.

The config revision in force (the highest wins; at the same revision only
the edge in force may change it) and the runtime controls (last write wins,
only the node's providers, forgotten with a provider the config drops).
"""

from __future__ import annotations

from iopd.node.edges.shared_state import ConfigInForce, NodeControls
from wire.messages import (
    ControlUpdate,
    NodeConfig,
    ProviderControlSpec,
    ProviderSpec,
    SlotLoad,
    node_config_digest,
)


def push(revision: int, capacity: int = 1) -> NodeConfig:
    spec = ProviderSpec(id="p", type="echo", capacity=capacity)
    return NodeConfig(stream_id=1, version=1, providers=[spec], revision=revision)


def test_the_first_push_and_every_higher_revision_are_applied() -> None:
    state = ConfigInForce()
    assert state.admits("edge-a", push(3))
    assert state.applied("edge-a", push(3)) is True
    assert state.admits("edge-b", push(4, capacity=2))
    assert not state.admits("edge-b", push(2))  # lower: never
    assert state.state().revision == 3


def test_at_the_same_revision_only_the_edge_in_force_changes_the_config() -> None:
    state = ConfigInForce()
    state.applied("edge-a", push(0))
    assert not state.admits("edge-b", push(0, capacity=5))  # another edge: mismatch
    assert state.admits("edge-a", push(0, capacity=5))  # its own refresh, as with one edge
    assert state.applied("edge-a", push(0)) is False  # nothing changed
    state.applied("edge-a", push(0, capacity=5))
    assert state.state().digest == node_config_digest(push(0, capacity=5).providers)


def test_the_digest_is_the_same_for_an_int_where_a_float_is_declared() -> None:
    as_built = ProviderSpec(id="p", type="echo", read_timeout=300)  # int on the edge
    as_decoded = ProviderSpec(id="p", type="echo", read_timeout=300.0)
    assert node_config_digest([as_built]) == node_config_digest([as_decoded])
    assert node_config_digest([as_built]) != node_config_digest(
        [ProviderSpec(id="p", type="echo", read_timeout=301.0)]
    )


def test_controls_last_write_wins_and_only_for_the_nodes_providers() -> None:
    controls = NodeControls()
    spec = ProviderControlSpec
    refused = controls.apply(
        ControlUpdate(controls=[spec(provider_id="a", state="draining"), spec(provider_id="zz")]),
        {"a", "b"},
    )
    assert refused == ["zz"]
    controls.apply(ControlUpdate(controls=[spec(provider_id="b", capacity=0)]), {"a", "b"})
    controls.apply(ControlUpdate(controls=[spec(provider_id="a", state="disabled")]), {"a", "b"})
    assert controls.state().controls == [
        spec(provider_id="a", state="disabled"),
        spec(provider_id="b", capacity=0),
    ]
    controls.apply(ControlUpdate(controls=[spec(provider_id="b")]), {"a", "b"})  # reset
    controls.retain({"b"})  # a refresh removed a
    assert controls.state().controls == []


def test_the_node_admits_under_the_operators_controls() -> None:
    """Admission counts against the capacity in force: an override replaces the
    configured one, and a draining or disabled provider admits nothing new."""
    from types import SimpleNamespace

    from iopd.node.edges.admission import SlotTable
    from iopd.node.edges.sessions import _limits_of
    from iopd.node.edges.shared_state import SharedState

    shared = SharedState()
    changed: list[int] = []
    shared.controls_changed = lambda: changed.append(1)
    spec = ProviderSpec(id="p", type="echo", capacity=2, long_context_capacity=1)
    registry = {"p": SimpleNamespace(spec=spec)}
    executor = SimpleNamespace(registry=registry, shared=shared)
    limits = _limits_of(executor)  # type: ignore[arg-type]
    assert limits("p") == (2, 1)
    assert limits("other") is None

    def control(**fields: object) -> None:
        update = ControlUpdate(controls=[ProviderControlSpec(provider_id="p", **fields)])  # type: ignore[arg-type]
        shared.set_controls(update, ["p"], "edge-a")

    control(capacity=5)
    assert limits("p") == (5, 1) and changed == [1]
    control(state="draining", capacity=5)
    assert limits("p") == (0, 0)
    control(state="disabled")
    assert limits("p") == (0, 0)
    # A slot table over these limits refuses a new stream while disabled.
    table = SlotTable(limits)
    table.add_edge("edge-a")
    assert isinstance(table.admit("edge-a", "p", False, 0.0), SlotLoad)
    control()  # back to active, no override
    assert limits("p") == (2, 1)
