"""The gauges read at scrape time: queue, nodes, providers, principals in flight.

Why a collector and not gauges set by the code: the values are read from one
status callable (the runtime's) at each scrape, so they are always current
and nothing has to remember to update a gauge.  ``GatewayMetrics`` (in
``iopd.edge.metering.metrics``) registers one ``StatusCollector`` on its registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from iopd.edge.pool.routing import MATCH_BUCKETS
from iopd.vocabulary import ShownHealth, load_ratio

log = logging.getLogger("iopd.edge.metrics")

__all__ = [
    "HEALTH_GAUGE",
    "GatewayStatus",
    "ProviderGaugeRow",
    "RoutingView",
    "StatusCollector",
    "StatusSource",
]

HEALTH_GAUGE: Final[Mapping[ShownHealth, int]] = {
    "ejected": -2,
    "disconnected": -1,
    "unhealthy": 0,
    "unknown": 1,
    "healthy": 2,
}
"""``iop_provider_health`` gauge value per health state (higher is better).

``disconnected`` (the provider's node has no live session) is below
``unhealthy`` rather than folded into it, so a dashboard tells a node that
went away from a provider its node probes as failing, and the values that
existed before it (0, 1, 2) keep their meaning in saved queries and alerts.
``ejected`` (passive outlier ejection: its requests failed) is -2, below
both, for the same reason: every earlier value keeps its meaning, and
``< 1`` still catches every provider that is not serving normally."""


# ------------------------------------------------------------ status rows


@dataclass(frozen=True)
class ProviderGaugeRow:
    """One provider's live numbers, as the pool sees them at scrape time."""

    node_id: str
    provider_id: str
    in_flight: int
    capacity: int
    long_in_flight: int = 0
    long_capacity: int = 0
    health: ShownHealth = "unknown"
    enabled: bool = True


@dataclass(frozen=True)
class RoutingView:
    """The cache-aware routing's counts (``iopd.edge.pool.routing.Router``), config ids only."""

    #: Grants by (model group, reason).
    decisions: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: Per group: counts per ``MATCH_BUCKETS`` bucket, then the sum of the fractions.
    matched: Mapping[str, Sequence[float]] = field(default_factory=dict)
    #: Block hashes the prefix index holds per (node id, provider id).
    index_blocks: Mapping[tuple[str, str], int] = field(default_factory=dict)


@dataclass(frozen=True)
class GatewayStatus:
    """What the status source returns at each scrape: one consistent read."""

    queue_depth: int = 0
    max_queue: int = 0
    queued_bytes: int = 0
    connected_nodes: int = 0
    providers: Sequence[ProviderGaugeRow] = field(default_factory=tuple)
    #: Requests holding a provider slot, by ``principal_ref`` (config ids only).
    principals_in_flight: Mapping[str, int] = field(default_factory=dict)
    routing: RoutingView = field(default_factory=RoutingView)


StatusSource = Callable[[], GatewayStatus]


class StatusCollector(Collector):
    """Reads the status source at scrape time and yields gauge families."""

    def __init__(self, edge_id: str, principal_allowed: Callable[[str], bool]) -> None:
        self._edge_id = edge_id
        self.source: StatusSource | None = None
        self._principal_allowed = principal_allowed

    def describe(self) -> Iterable[Metric]:
        # Declaring no names up front keeps the registry from calling collect()
        # at registration time (the source may not be set yet).
        return []

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        try:
            status = self.source()
        except Exception:  # a scrape must never fail because of the pool
            log.exception("event=callback_failed component=metrics callback=status_source")
            return
        edge = [self._edge_id]
        for name, doc, value in (
            (
                "iop_queue_depth",
                "Requests waiting in the global provider queue.",
                status.queue_depth,
            ),
            ("iop_queue_max", "provider_pool.max_queue (0 = never wait).", status.max_queue),
            (
                "iop_queue_bytes",
                "Request-body bytes held by the requests in the global provider queue.",
                status.queued_bytes,
            ),
            ("iop_connected_nodes", "Nodes with a live wire session.", status.connected_nodes),
        ):
            g = GaugeMetricFamily(name, doc, labels=["edge_id"])
            g.add_metric(edge, float(value))
            yield g
        labels = ["edge_id", "node_id", "provider_id"]
        fams = {
            "in_flight": GaugeMetricFamily(
                "iop_provider_in_flight",
                "Leases held on the provider (normal slots).",
                labels=labels,
            ),
            "capacity": GaugeMetricFamily(
                "iop_provider_capacity", "Capacity in force (normal slots).", labels=labels
            ),
            "load_ratio": GaugeMetricFamily(
                "iop_provider_load_ratio",
                "in_flight / capacity (0 when capacity is 0).",
                labels=labels,
            ),
            "long_in_flight": GaugeMetricFamily(
                "iop_provider_long_in_flight", "Long-context slots in use.", labels=labels
            ),
            "long_capacity": GaugeMetricFamily(
                "iop_provider_long_capacity", "Configured long_context_capacity.", labels=labels
            ),
            "health": GaugeMetricFamily(
                "iop_provider_health",
                "Provider health: -1 node disconnected, 0 unhealthy, 1 unknown (not probed yet),"
                " 2 healthy.",
                labels=labels,
            ),
            "enabled": GaugeMetricFamily(
                "iop_provider_enabled", "1 when the provider is enabled in config.", labels=labels
            ),
        }
        for row in status.providers:
            key = [self._edge_id, row.node_id, row.provider_id]
            fams["in_flight"].add_metric(key, float(row.in_flight))
            fams["capacity"].add_metric(key, float(row.capacity))
            fams["load_ratio"].add_metric(key, load_ratio(row.in_flight, row.capacity))
            fams["long_in_flight"].add_metric(key, float(row.long_in_flight))
            fams["long_capacity"].add_metric(key, float(row.long_capacity))
            fams["health"].add_metric(key, float(HEALTH_GAUGE.get(row.health, 1)))
            fams["enabled"].add_metric(key, 1.0 if row.enabled else 0.0)
        yield from fams.values()
        principals = GaugeMetricFamily(
            "iop_principal_in_flight",
            "Requests of the principal holding a provider slot (limits.max_concurrent counts these).",
            labels=["edge_id", "principal_ref"],
        )
        for ref, running in sorted(status.principals_in_flight.items()):
            if self._principal_allowed(ref):  # a config id, never a caller's string
                principals.add_metric([self._edge_id, ref], float(running))
        yield principals
        yield from routing_families(self._edge_id, status.routing)


def routing_families(edge_id: str, view: RoutingView) -> Iterator[Metric]:
    """``iop_routing_decisions_total``, the matched-fraction histogram, the index sizes."""
    decisions = CounterMetricFamily(
        "iop_routing_decisions",
        "Provider choices by reason: prefix (cached prefix), session (a session's "
        "placement), load (least load), fallback (a target over the load bound or busy).",
        labels=["edge_id", "model_group", "reason"],
    )
    for (group, reason), n in sorted(view.decisions.items()):
        decisions.add_metric([edge_id, group, reason], float(n))
    yield decisions
    matched = HistogramMetricFamily(
        "iop_routing_matched_fraction",
        "Fraction of a prompt's blocks the chosen provider was found to hold (prefix groups).",
        labels=["edge_id", "model_group"],
    )
    for group, hist in sorted(view.matched.items()):
        cumulative, buckets = 0.0, []
        for upper, count in zip(MATCH_BUCKETS, hist, strict=False):
            cumulative += count
            buckets.append((repr(upper), cumulative))
        buckets.append(("+Inf", cumulative))
        matched.add_metric([edge_id, group], buckets, hist[-1])
    yield matched
    blocks = GaugeMetricFamily(
        "iop_prefix_index_blocks",
        "Block hashes the prefix index holds for the provider (bounded by index_blocks).",
        labels=["edge_id", "node_id", "provider_id"],
    )
    for (node_id, pid), held in sorted(view.index_blocks.items()):
        blocks.add_metric([edge_id, node_id, pid], float(held))
    yield blocks
