"""What the edge keeps of each provider's health as its node reported it.

Apart from ``edge_runtime.py`` so that the runtime's module stays about the
snapshot and its refresh; ``EdgeRuntime.health`` holds one of these per provider.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from iopd.vocabulary import ShownHealth
from wire.messages import ModelInfo

__all__ = ["DISCONNECTED", "HEALTH_LOG_BURST", "HEALTH_LOG_WINDOW", "ProviderHealthState"]

#: ``event=provider_health`` lines per provider per ``HEALTH_LOG_WINDOW``
#: seconds: a node can flip a provider's health with every message, and a
#: real change is rare; the changes past it are counted in the next line.
HEALTH_LOG_BURST: Final = 5
HEALTH_LOG_WINDOW: Final = 10.0


@dataclass
class ProviderHealthState:
    health: ShownHealth = "unknown"
    last_error: str = ""
    #: What the node's probe said of each served model (``/api/tags``), by served name.
    models: dict[str, ModelInfo] = field(default_factory=dict)
    #: The ``event=provider_health`` budget: its window's start, lines logged in
    #: it, changes not logged since the last line.
    log_window: float = -HEALTH_LOG_WINDOW
    logged: int = 0
    unlogged: int = 0

    def may_log_change(self, now: float) -> bool:
        """One health change happened at ``now``: True to log it (at most
        ``HEALTH_LOG_BURST`` a window), else it is counted in ``unlogged``."""
        if now - self.log_window >= HEALTH_LOG_WINDOW:
            self.log_window, self.logged = now, 0
        if self.logged >= HEALTH_LOG_BURST:
            self.unlogged += 1
            return False
        self.logged += 1
        return True


#: What ``/status`` and the health gauge show for a provider whose node has no
#: live session: its last probe result is history, not the provider's state.
DISCONNECTED: Final = "disconnected"
