"""What the web console shows, as one JSON-ready document: built from ``/status``.

Why one document for both: the page is rendered on the server from it
(``GET /``) and then updated in place from the same document pushed by
``GET /events``, so the two can never disagree on a field.  Pure and
synchronous: it reads the runtime's ``status()``, the pool's queue per model
group and the activity recorder, and does no I/O.

A provider's state is the runtime controls' (``active``, ``draining``,
``drained``, ``disabled``), shown ``disabled`` when the config disables it.
Its ``actions`` are the controls that change that state (``ACTIONS``): the
page shows those buttons only, so no button offers what is already so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypedDict

from iopd.config.catalog import GroupSpec
from iopd.edge.metering.activity import ErrorRow, UsageRow
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from iopd.edge.runtime.status_document import ProviderRow, RoutingProviderRow

__all__ = ["ACTIONS", "MAX_USAGE_ROWS", "ConsoleView", "console_view"]

#: The busiest principal × model rows shown (the recorder may hold more).
MAX_USAGE_ROWS: Final = 100

#: The console's buttons for each runtime state, in the order shown.  A provider
#: the config disables has none: only an edit of the config (and a refresh) changes it.
ACTIONS: Final[Mapping[str, tuple[str, ...]]] = {
    "active": ("drain", "disable"),
    "draining": ("enable", "disable"),
    "drained": ("enable", "disable"),
    "disabled": ("enable",),
}

#: The states a drain changes: a node whose providers are all elsewhere has nothing to drain.
_DRAINABLE: Final = frozenset({"active"})


class NodeView(TypedDict):
    id: str
    alias: str
    connected: bool
    connected_since: float | None  # Unix time
    providers: list[str]
    drainable: bool  # some provider of it is active: "Drain node" would change something


class ProviderView(TypedDict):
    id: str
    node_id: str
    type: str
    health: str
    state: str  # active | draining | drained | disabled
    in_flight: int
    capacity: int
    load_ratio: float
    queued: int
    index_blocks: int | None  # its prefix index size (None: not in the routing document)
    hit_rate: float | None  # of its index's lookups (None until one counted it)
    last_error: str
    override: dict[str, int] | None  # the runtime overrides, when the controls set some
    actions: list[str]  # the controls offered in this state (``ACTIONS``)
    disabled_in_config: bool


class GroupProviderView(TypedDict):
    provider: str
    served: str  # the model name the provider is asked for
    health: str
    state: str


class GroupView(TypedDict):
    """One model group, as ``iopd status`` lists it, with where its requests go next."""

    id: str
    source: str  # models, route (legacy), fallback
    providers: list[GroupProviderView]
    policy: str  # ``models[].routing``: prefix | least_load
    routing: str  # its fallbacks and queue timeout, in words
    queued: int


class QueueView(TypedDict):
    depth: int
    max_queue: int


class ConsoleView(TypedDict):
    """The console's document (``GET /`` renders it, ``/events`` pushes it)."""

    edge_id: str
    config_version: int
    nodes: list[NodeView]
    providers: list[ProviderView]
    queue: QueueView
    groups: list[GroupView]
    usage: list[UsageRow]
    usage_minutes: int
    errors: list[ErrorRow]


def console_view(rt: EdgeRuntime) -> ConsoleView:
    """The console's document for the edge as it is now."""
    status = rt.status()
    queued = rt.pool.queued_by_group()
    index = status["routing"]["providers"]
    providers = [_provider(row, index.get(row["id"])) for row in status["providers"]]
    by_id = {p["id"]: p for p in providers}
    specs = rt.snapshot.catalog.groups
    return {
        "edge_id": status["edge_id"],
        "config_version": status["config_version"],
        "nodes": [
            {
                "id": n["id"],
                "alias": n["alias"],
                "connected": n["connected"],
                "connected_since": n["connected_since"],
                "providers": n["providers"],
                "drainable": any(
                    by_id[pid]["state"] in _DRAINABLE for pid in n["providers"] if pid in by_id
                ),
            }
            for n in status["nodes"]
        ],
        "providers": providers,
        "queue": {"depth": status["queue"]["depth"], "max_queue": status["queue"]["max_queue"]},
        "groups": [
            {
                "id": m["id"],
                "source": m["source"],
                "providers": [
                    {
                        "provider": mp["provider"],
                        "served": mp["served"],
                        "health": by_id[mp["provider"]]["health"]
                        if mp["provider"] in by_id
                        else "-",
                        "state": by_id[mp["provider"]]["state"] if mp["provider"] in by_id else "-",
                    }
                    for mp in m["providers"]
                ],
                "policy": m["routing"],
                "routing": _routing(specs.get(m["id"])),
                "queued": queued.get(m["id"], 0),
            }
            for m in status["models"]
        ],
        "usage": rt.activity.usage()[:MAX_USAGE_ROWS],
        "usage_minutes": rt.activity.window_minutes,
        "errors": rt.activity.recent_errors(),
    }


def _routing(spec: GroupSpec | None) -> str:
    """Where a group's request goes when its providers cannot take it, in words."""
    if spec is None:
        return "-"
    if spec.fallbacks:
        after = (
            "full, unhealthy or queue timeout" if spec.fallback_on_queue_timeout else "unavailable"
        )
        text = f"fallback when {after}: {' → '.join(spec.fallbacks)}"
    else:
        text = "no fallback"
    if spec.queue_timeout is not None:
        text += f"; waits at most {spec.queue_timeout:g} s"
    return text


def _provider(row: ProviderRow, index: RoutingProviderRow | None) -> ProviderView:
    """One provider row of ``/status`` (and its prefix index's) as the console shows it."""
    # ``enabled: false`` in the config outranks the runtime state (which is
    # ``active`` unless an operator changed it): such a provider takes nothing.
    state = str(row["state"] if row["enabled"] else "disabled")
    override = row.get("override")
    return {
        "id": row["id"],
        "node_id": row["node_id"],
        "type": row["type"],
        "health": row["health"],
        "state": state,
        "in_flight": row["in_flight"],
        "capacity": row["capacity"],
        "load_ratio": row["load_ratio"],
        "queued": row["queued"],
        "index_blocks": index["index_blocks"] if index is not None else None,
        "hit_rate": index["hit_rate"] if index is not None and index["lookups"] else None,
        "last_error": row["last_error"],
        "override": _set_overrides(override),
        "actions": list(ACTIONS.get(state, ())) if row["enabled"] else [],
        "disabled_in_config": not row["enabled"],
    }


def _set_overrides(override: object) -> dict[str, int] | None:
    """The overrides actually set (``None`` values dropped), or None when there are none."""
    if not isinstance(override, Mapping):
        return None
    set_ = {str(k): v for k, v in override.items() if isinstance(v, int)}
    return set_ or None
