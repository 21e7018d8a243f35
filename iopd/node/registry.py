"""The node's adapter registry: provider id -> Adapter, with swap-and-drain.

Every ``NodeConfig`` from the edge builds a whole new registry; the executor
swaps it in and *retires* the old one.  A retired registry takes no new runs,
but the runs already in flight on it finish on the old adapters; its
adapters are closed only when the last of those runs has left
(``AdapterRegistry.use``) — never under a running request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import trio

from iopd.node.adapters.base import Adapter
from iopd.node.adapters.cli import CliAdapter
from iopd.node.adapters.echo import EchoAdapter
from iopd.node.adapters.ollama import OllamaAdapter
from iopd.node.adapters.openai import OpenAIAdapter
from wire.messages import ProviderSpec

log = logging.getLogger(__name__)

#: Adapter class per provider ``type``.
ADAPTER_TYPES: dict[str, type[Adapter]] = {
    "openai": OpenAIAdapter,
    "ollama": OllamaAdapter,
    "cli": CliAdapter,
    "echo": EchoAdapter,
}
#: Seconds allowed for closing a registry's adapters.
CLOSE_TIMEOUT = 10.0


class RegistryError(Exception):
    """A NodeConfig's provider set cannot be turned into adapters."""


class AdapterRegistry:
    """A fixed set of adapters plus the count of runs using them."""

    def __init__(self, adapters: dict[str, Adapter], *, version: int = 0) -> None:
        self.adapters = adapters
        self.version = version
        self.active_runs = 0
        self.retired = False
        self.closed = trio.Event()
        self._closing = False

    @classmethod
    def build(cls, specs: Iterable[ProviderSpec], *, version: int = 0) -> AdapterRegistry:
        """One adapter per spec, by type; raises RegistryError naming the bad provider."""
        adapters: dict[str, Adapter] = {}
        for spec in specs:
            if spec.id in adapters:
                raise RegistryError(f"provider {spec.id!r} is defined twice")
            adapter_type = ADAPTER_TYPES.get(spec.type)
            if adapter_type is None:
                raise RegistryError(f"provider {spec.id!r}: unknown type {spec.type!r}")
            if spec.type == "cli" and not spec.command:
                raise RegistryError(f"provider {spec.id!r}: type cli needs a command")
            try:
                adapters[spec.id] = adapter_type(spec)
            except ValueError as exc:
                raise RegistryError(f"provider {spec.id!r}: {exc}") from None
        return cls(adapters, version=version)

    def get(self, provider_id: str) -> Adapter | None:
        """The adapter of ``provider_id``, or None."""
        return self.adapters.get(provider_id)

    @property
    def specs(self) -> list[ProviderSpec]:
        return [a.spec for a in self.adapters.values()]

    def use(self) -> _RunSlot:
        """Count one run in flight on this registry for the duration of an ``async with``."""
        return _RunSlot(self)

    async def retire(self) -> None:
        """Take no new runs; close the adapters now or when the last run leaves."""
        self.retired = True
        if self.active_runs == 0:
            await self.aclose()

    async def aclose(self) -> None:
        """Close every adapter once (shielded, bounded by CLOSE_TIMEOUT)."""
        if self._closing:
            return
        self._closing = True
        with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
            for adapter in self.adapters.values():
                try:
                    await adapter.aclose()
                except Exception as exc:  # one bad adapter must not keep others open
                    log.warning(
                        "event=adapter_close_failed provider=%s error=%s",
                        adapter.spec.id,
                        type(exc).__name__,
                    )
        self.closed.set()


class _RunSlot:
    """``AdapterRegistry.use()``: a class, as it wraps every run (cheaper than a generator)."""

    __slots__ = ("_registry",)

    def __init__(self, registry: AdapterRegistry) -> None:
        self._registry = registry

    async def __aenter__(self) -> None:
        self._registry.active_runs += 1

    async def __aexit__(self, *exc_info: object) -> None:
        registry = self._registry
        registry.active_runs -= 1
        if registry.retired and registry.active_runs == 0:
            await registry.aclose()
