"""The cache-aware routing as ``/status`` and the metrics show it.

Read from the pool's router when asked (a scrape, a status call), never on
the admission path: each provider's prefix index size and hit rate, the
sessions placed, the index's bounds, and the decisions per model group.
"""

from __future__ import annotations

from iopd.edge.metering.gauges import RoutingView
from iopd.edge.pool.pool import ProviderPool
from iopd.edge.runtime.status_document import RoutingProviderRow, RoutingRow

__all__ = ["routing_row", "routing_view"]


def routing_row(pool: ProviderPool) -> RoutingRow:
    """``/status`` ``routing``: the index's memory and bounds, per provider and group."""
    router = pool.scheduler.router
    policy = router.policy
    providers: dict[str, RoutingProviderRow] = {}
    for pid in pool.snapshot.providers:
        stats = router.index.stats(pid)
        providers[pid] = {
            "index_blocks": stats.blocks,
            "lookups": stats.lookups,
            "hits": stats.hits,
            "hit_rate": round(stats.hit_rate, 4),
        }
    decisions: dict[str, dict[str, int]] = {}
    for (group, reason), n in sorted(router.decisions.items()):
        decisions.setdefault(group, {})[reason] = n
    return {
        "index_blocks": router.index.total_blocks,
        "index_blocks_per_provider": policy.index_blocks,
        "index_bytes_per_block": policy.block_bytes,
        "sessions": len(router.sessions),
        "max_sessions": policy.max_sessions,
        "providers": providers,
        "decisions": decisions,
    }


def routing_view(pool: ProviderPool) -> RoutingView:
    """The routing counts for the metrics collector (config ids only)."""
    router = pool.scheduler.router
    return RoutingView(
        decisions=dict(router.decisions),
        matched={g: tuple(h) for g, h in router.matched.items()},
        index_blocks={
            (slot.node_id, pid): router.index.blocks(pid)
            for pid, slot in pool.snapshot.providers.items()
        },
    )
