"""The cache-aware routing as ``/status`` and the metrics show it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from iopd.edge.metering.gauges import GatewayStatus, StatusCollector
from iopd.edge.pool import GroupPolicy, PoolSnapshot, ProviderPool, ProviderSlot
from iopd.edge.pool.routing import RouteAsk, RoutingPolicy
from iopd.edge.runtime.routing_status import routing_row, routing_view


def _pool() -> ProviderPool:
    snap = PoolSnapshot(
        providers={p: ProviderSlot(p, "n1", "echo", 4) for p in ("a", "b")},
        groups={"m": GroupPolicy("m", (("a", "t"), ("b", "t")))},
        routing=RoutingPolicy(block_bytes=64, index_blocks=100),
    )
    pool = ProviderPool(snap)
    pool.scheduler.set_node_connected("n1", True, now=0.0)
    return pool


def test_status_shows_each_providers_index_and_the_decisions() -> None:
    pool = _pool()
    s = pool.scheduler
    first = s.request("m", ask=RouteAsk(b"x" * 64 * 3), now=0.0)
    second = s.request("m", ask=RouteAsk(b"x" * 64 * 4), now=0.0)
    assert first.provider_id == second.provider_id  # type: ignore[union-attr]
    row = routing_row(pool)
    held = first.provider_id  # type: ignore[union-attr]
    assert row["providers"][held]["index_blocks"] == 4
    assert row["providers"][held]["hits"] == 1 and row["providers"][held]["hit_rate"] == 1.0
    assert row["index_blocks"] == 4 and row["index_blocks_per_provider"] == 100
    assert row["decisions"] == {"m": {"load": 1, "prefix": 1}}


def test_metrics_carry_the_decisions_the_fraction_histogram_and_index_sizes() -> None:
    pool = _pool()
    s = pool.scheduler
    s.request("m", ask=RouteAsk(b"x" * 64 * 3), now=0.0)
    s.request("m", ask=RouteAsk(b"x" * 64 * 4), now=0.0)
    collector = StatusCollector("e1", lambda ref: True)
    collector.source = lambda: GatewayStatus(routing=routing_view(pool))
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'iop_routing_decisions_total{edge_id="e1",model_group="m",reason="prefix"} 1.0' in text
    assert 'iop_routing_matched_fraction_bucket{edge_id="e1",le="+Inf",model_group="m"} 2.0' in text
    assert 'iop_routing_matched_fraction_bucket{edge_id="e1",le="0.5",model_group="m"} 1.0' in text
    assert 'iop_prefix_index_blocks{edge_id="e1",node_id="n1",provider_id="a"}' in text
