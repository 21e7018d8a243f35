"""Active health probes of the node's providers.

One probe loop per provider of the *current* registry, every
``health_interval`` seconds (``Adapter.probe``: openai ``GET /v1/models``,
ollama ``GET /api/tags``, each also checking that every served model name is
in the list (``iopd.node.served_models``), cli ``health_command``, echo
always healthy).  An ollama probe also keeps what the list says of each
served model (``ProviderHealth.models``, for the edge's ``/api/tags``).
Health is ``unknown`` until the first probe answers.  When a provider's
health, last error or models change, a ``ProviderStatus`` with just that provider
goes to the ``StatusSink`` (the wire link); ``current_status()`` gives all of
them (sent by the link after every reconnect).

When the registry is swapped the probe loops restart on the new adapters;
a provider whose spec did not change keeps its last known health.

A provider the node refused (``iopd.node.consent``) has no adapter and no
probe loop: it is reported ``unhealthy`` with the refusal as its last
error, so the edge routes around it and shows why.

A draining node (``begin_drain``) reports every provider ``unhealthy`` and
stops probing: it refuses new streams, so the edge must route around it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import trio

from iopd.node.adapters.base import Adapter
from iopd.node.handler import StatusSink
from iopd.node.registry import AdapterRegistry
from wire.messages import Health, ProviderHealth, ProviderStatus

log = logging.getLogger(__name__)

#: Shortest interval between probes of one provider, whatever the config says.
MIN_INTERVAL = 0.05


class HealthMonitor:
    """Probes the providers of the registry it was last given."""

    def __init__(self) -> None:
        self._registry: AdapterRegistry | None = None
        self._health: dict[str, ProviderHealth] = {}
        self._swapped = trio.Event()
        self._sink: StatusSink | None = None
        self._draining: str | None = None  # the last_error reported while draining

    def begin_drain(self, reason: str = "node is draining") -> None:
        """Report every provider unhealthy from now on (the node takes no new work)."""
        self._draining = reason
        for entry in self._health.values():
            entry.health, entry.last_error = "unhealthy", reason
        if self._sink is not None:
            self._sink.send_status(self.current_status())

    def set_registry(
        self, registry: AdapterRegistry, *, refused: Mapping[str, str] | None = None
    ) -> None:
        """Follow ``registry`` from now on (probe loops restart).

        ``refused``: provider id -> why the node refused it; those are reported
        unhealthy (to the sink now, and in every ``current_status``), never probed.
        """
        previous = self._registry
        kept: dict[str, ProviderHealth] = {}
        for provider_id, adapter in registry.adapters.items():
            old_adapter = previous.get(provider_id) if previous is not None else None
            old_health = self._health.get(provider_id)
            if (
                old_adapter is not None
                and old_health is not None
                and old_adapter.spec == adapter.spec
            ):
                kept[provider_id] = old_health
            else:
                kept[provider_id] = ProviderHealth(provider_id=provider_id)
            if self._draining is not None:
                kept[provider_id].health = "unhealthy"
                kept[provider_id].last_error = self._draining
        news = []
        for provider_id, why in (refused or {}).items():
            entry = ProviderHealth(provider_id=provider_id, health="unhealthy", last_error=why)
            if entry != self._health.get(provider_id):
                news.append(entry)
            kept.setdefault(provider_id, entry)
        self._health = kept
        self._registry = registry
        self._swapped.set()
        self._swapped = trio.Event()
        if news and self._sink is not None:
            self._sink.send_status(ProviderStatus(providers=news))

    def current_status(self) -> ProviderStatus:
        """Health of every provider of the current registry."""
        return ProviderStatus(
            providers=[
                ProviderHealth(
                    provider_id=h.provider_id,
                    health=h.health,
                    last_error=h.last_error,
                    models=h.models,
                )
                for h in self._health.values()
            ]
        )

    def health_of(self, provider_id: str) -> Health:
        entry = self._health.get(provider_id)
        return entry.health if entry is not None else "unknown"

    async def run(self, sink: StatusSink, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe forever, reporting changes to ``sink``."""
        self._sink = sink
        task_status.started()
        while True:
            registry, swapped = self._registry, self._swapped
            async with trio.open_nursery() as nursery:
                if registry is not None:
                    for adapter in registry.adapters.values():
                        nursery.start_soon(self._probe_loop, adapter, sink)
                await swapped.wait()
                nursery.cancel_scope.cancel()

    async def probe_once(self, adapter: Adapter) -> tuple[Health, str]:
        """One probe; a probe that raises counts as unhealthy (never propagates)."""
        try:
            return await adapter.probe()
        except Exception as exc:
            return "unhealthy", f"probe failed: {type(exc).__name__}"

    async def _probe_loop(self, adapter: Adapter, sink: StatusSink) -> None:
        provider_id = adapter.spec.id
        while True:
            health, last_error = await self.probe_once(adapter)
            models = list(adapter.model_infos)
            entry = self._health.get(provider_id)
            if entry is None:  # pragma: no cover - swapped away under us
                return
            if self._draining is not None:
                return  # stays unhealthy until the node exits
            changed = (entry.health, entry.last_error) != (health, last_error)
            if changed or entry.models != models:
                entry.health, entry.last_error, entry.models = health, last_error, models
                if changed:
                    log.info(
                        "event=provider_health provider=%s health=%s last_error=%r",
                        provider_id,
                        health,
                        last_error,
                    )
                sink.send_status(
                    ProviderStatus(
                        providers=[
                            ProviderHealth(
                                provider_id=provider_id,
                                health=health,
                                last_error=last_error,
                                models=models,
                            )
                        ]
                    )
                )
            await trio.sleep(max(MIN_INTERVAL, adapter.spec.health_interval))
