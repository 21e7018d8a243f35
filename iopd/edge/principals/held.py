"""What an edge keeps about its shared-limits admissions (``limits.backend: redis``).

``Held``: one admission with what this edge knows of it (its day, whether
the store may hold it, its local stand-ins, its times and usage), so an
outage's admissions can be written to the store at recovery.
``LocalCounts``: this edge's own counts, which stand in for the store during
an outage (``on_backend_error: local``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from iopd.edge.principals.backend import SharedAdmission
from iopd.edge.principals.limiter import Admission, PrincipalLimiter

__all__ = ["Held", "LocalCounts"]


@dataclass
class LocalCounts:
    """This edge's own counts, which stand in for the store during an outage
    (``on_backend_error: local``): every admission and slot of this edge."""

    limiter: PrincipalLimiter
    running: dict[str, int] = field(default_factory=dict)

    def take(self, ref: str, cap: int) -> bool:
        if self.running.get(ref, 0) >= cap:
            return False
        self.count(ref)
        return True

    def count(self, ref: str) -> None:
        """A slot this edge holds in the store: counted here too."""
        self.running[ref] = self.running.get(ref, 0) + 1

    def give(self, ref: str) -> None:
        left = self.running.get(ref, 0) - 1
        if left > 0:
            self.running[ref] = left
        else:
            self.running.pop(ref, None)


@dataclass(eq=False)
class Held(SharedAdmission):
    """A :class:`SharedAdmission` with what this edge keeps about it."""

    day: int = -1  # its UTC day by the server's clock; -1 while unknown
    in_store: bool = False  # the store may hold it (settle or withdraw there)
    local: Admission | None = None  # counted by this edge's own limiter
    local_slot: LocalCounts | None = None  # holds a slot of this edge's own count
    at: float = 0.0  # trio time of its admission
    ended_at: float = 0.0  # trio time of its settlement
    used: int = 0  # tokens it settled with
    withdrawn: bool = False
