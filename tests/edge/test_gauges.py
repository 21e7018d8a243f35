"""The scrape-time gauges: read from the status source at each collect, never stale."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from iopd.edge.metering.gauges import (
    HEALTH_GAUGE,
    GatewayStatus,
    ProviderGaugeRow,
    StatusCollector,
)


def _registry(collector: StatusCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_nothing_is_collected_before_the_source_is_set() -> None:
    collector = StatusCollector("e1", lambda ref: True)
    assert list(collector.collect()) == []
    # Registering does not call the source either (it may not be set yet).
    assert _registry(collector).get_sample_value("iop_queue_depth", {"edge_id": "e1"}) is None


def test_each_scrape_reads_the_source_again() -> None:
    collector = StatusCollector("e1", lambda ref: True)
    registry = _registry(collector)
    depth = [3]
    collector.source = lambda: GatewayStatus(queue_depth=depth[0], max_queue=10, connected_nodes=2)
    assert registry.get_sample_value("iop_queue_depth", {"edge_id": "e1"}) == 3.0
    depth[0] = 0
    assert registry.get_sample_value("iop_queue_depth", {"edge_id": "e1"}) == 0.0
    assert registry.get_sample_value("iop_queue_max", {"edge_id": "e1"}) == 10.0
    assert registry.get_sample_value("iop_connected_nodes", {"edge_id": "e1"}) == 2.0


def test_provider_rows_and_their_health() -> None:
    collector = StatusCollector("e1", lambda ref: True)
    registry = _registry(collector)
    rows = (
        ProviderGaugeRow("n1", "p1", in_flight=3, capacity=4, health="healthy"),
        ProviderGaugeRow("n1", "p2", in_flight=0, capacity=0, health="ejected", enabled=False),
        ProviderGaugeRow("n2", "p3", in_flight=1, capacity=2, health="disconnected"),
    )
    collector.source = lambda: GatewayStatus(providers=rows)

    def value(name: str, node: str, provider: str) -> float | None:
        labels = {"edge_id": "e1", "node_id": node, "provider_id": provider}
        return registry.get_sample_value(name, labels)

    assert value("iop_provider_load_ratio", "n1", "p1") == 0.75
    assert value("iop_provider_load_ratio", "n1", "p2") == 0.0  # capacity 0: no division
    assert value("iop_provider_health", "n1", "p1") == HEALTH_GAUGE["healthy"] == 2
    assert value("iop_provider_health", "n1", "p2") == -2
    assert value("iop_provider_health", "n2", "p3") == -1
    assert value("iop_provider_enabled", "n1", "p2") == 0.0
    assert value("iop_provider_capacity", "n2", "p3") == 2.0


def test_only_configured_principals_become_labels() -> None:
    collector = StatusCollector("e1", lambda ref: ref in {"team-a"})
    registry = _registry(collector)
    collector.source = lambda: GatewayStatus(
        principals_in_flight={"team-a": 2, "<caller's string>": 5}
    )
    gauge = "iop_principal_in_flight"
    assert registry.get_sample_value(gauge, {"edge_id": "e1", "principal_ref": "team-a"}) == 2.0
    samples = [s for m in registry.collect() if m.name == gauge for s in m.samples]
    assert [s.labels["principal_ref"] for s in samples] == ["team-a"]


def test_a_failing_source_fails_no_scrape(caplog: pytest.LogCaptureFixture) -> None:
    collector = StatusCollector("e1", lambda ref: True)
    registry = _registry(collector)

    def broken() -> GatewayStatus:
        raise RuntimeError("pool exploded")

    collector.source = broken
    with caplog.at_level(logging.ERROR, logger="iopd.edge.metrics"):
        assert registry.get_sample_value("iop_queue_depth", {"edge_id": "e1"}) is None
    assert "callback=status_source" in caplog.text
