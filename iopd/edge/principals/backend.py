"""Where per-principal counters live: one interface, two backends.

The request path (``iopd.edge.openai.limits``) talks to a
:class:`LimitsBackend` only.  ``limits.backend: memory`` is
:class:`MemoryLimits`: this edge's :class:`PrincipalLimiter`, exactly the
limiter of ``iopd.edge.principals.limiter`` (its calls do no I/O; concurrency and the fair queue
stay the pool's).  ``limits.backend: redis`` is
``iopd.edge.principals.shared_limits.SharedLimits``: the same rules run as scripts in a
Redis/Valkey server every edge shares, and a principal's ``max_concurrent``
is held there as leases (:meth:`LimitsBackend.hold_slot`, ``try_slot``,
``free_slot``: one per running request), so N edges
enforce each principal's limits as one edge would.

The rules both follow are in ``iopd.edge.principals.decisions`` (how much a
reservation holds, how windows become headers) and in the module doc of
``iopd.edge.principals.limiter`` (windows, settlement, debt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypedDict

import trio

from iopd.config.schema import LimitsSection
from iopd.edge.principals.decisions import NeverFits, PrincipalStatus, Rejection
from iopd.edge.principals.limiter import Admission, PrincipalLimiter
from iopd.edge.principals.reservation import Reservation

__all__ = [
    "AnyAdmission",
    "BackendRow",
    "Decision",
    "LimitsBackend",
    "MemoryLimits",
    "SharedAdmission",
]


@dataclass(eq=False)
class SharedAdmission:
    """An admission recorded in the shared store; held once for the request's whole life."""

    principal_ref: str
    reserved_tokens: int
    key: str  # the store's id of this admission (its request, token entry and slot lease)
    #: Holds a concurrency lease in the store (``max_concurrent``), renewed while it runs.
    slot: bool = False
    settled: bool = False


#: What the request path holds: an admission of either backend (or of the
#: per-edge limiter that stands in for the store during an outage).
AnyAdmission = Admission | SharedAdmission
#: What an admission attempt answers; None: admitted without limits
#: (``on_backend_error: allow`` during an outage).
Decision = AnyAdmission | Rejection | NeverFits | None


class BackendRow(TypedDict):
    """``GET /status`` ``limits_backend``: the shared store as this edge sees it."""

    backend: str  # memory | redis
    on_backend_error: str
    state: str  # ok | outage
    outage_since: float | None  # wall-clock seconds, while in an outage
    errors_total: int  # store calls that failed or ran over backend_timeout


class LimitsBackend(Protocol):
    """What the request path asks of the limits (see the module doc)."""

    async def admit(self, principal_ref: str, reservation: Reservation) -> Decision:
        """Admit against every rate and budget at once, or say why not."""
        ...

    async def hold_slot(self, admission: AnyAdmission, timeout: float) -> None:
        """Wait (at most ``timeout`` s, then ``QueueTimeout``) for a concurrency slot
        when ``max_concurrent`` is shared; a no-op when the pool holds it."""
        ...

    async def try_slot(self, admission: AnyAdmission) -> bool:
        """One try at that slot, without waiting (True: held, or none needed)."""
        ...

    async def free_slot(self, admission: AnyAdmission) -> None:
        """Give a held slot back: the request waits for a provider again."""
        ...

    async def withdraw(self, admission: AnyAdmission) -> None:
        """Undo an admission (no live candidate: the request never counted)."""
        ...

    async def settle(
        self, admission: AnyAdmission, used_tokens: int | None, estimated: int = 0
    ) -> None:
        """End an admission with its metered usage (None: none metered; then the
        larger of the reservation and ``estimated``, ``limit_decisions.settled_tokens``)."""
        ...

    def headers(self, principal_ref: str) -> list[tuple[str, str]]:
        """OpenAI's ``x-ratelimit-*`` headers as this edge knows them now (no I/O)."""
        ...

    def status(self) -> dict[str, PrincipalStatus]:
        """Every principal this edge knows windows of."""
        ...

    def status_of(self, principal_ref: str) -> PrincipalStatus:
        """One principal's windows (a blank view when unknown)."""
        ...

    def apply_config(self, section: LimitsSection) -> None:
        """A refresh: the limits change, the counters stay."""
        ...

    def backend_row(self) -> BackendRow:
        """The store's state for ``/status``."""
        ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Whatever the backend does in the background for as long as the edge runs."""
        ...


class MemoryLimits:
    """``limits.backend: memory``: this edge's :class:`PrincipalLimiter`.

    Nothing here awaits anything: each call is the limiter's, synchronously.
    ``max_concurrent`` is the pool's (its fair queue counts the slots).
    """

    def __init__(self, limiter: PrincipalLimiter, clock: Callable[[], float]) -> None:
        self.limiter = limiter
        self._clock = clock
        self.errors_total = 0

    async def admit(self, principal_ref: str, reservation: Reservation) -> Decision:
        return self.limiter.try_admit(principal_ref, reservation, self._clock())

    async def hold_slot(self, admission: AnyAdmission, timeout: float) -> None:
        return None

    async def try_slot(self, admission: AnyAdmission) -> bool:
        return True

    async def free_slot(self, admission: AnyAdmission) -> None:
        return None

    async def withdraw(self, admission: AnyAdmission) -> None:
        if isinstance(admission, Admission):
            self.limiter.withdraw(admission, self._clock())

    async def settle(
        self, admission: AnyAdmission, used_tokens: int | None, estimated: int = 0
    ) -> None:
        if isinstance(admission, Admission):
            self.limiter.settle(admission, used_tokens, self._clock(), estimated)

    def headers(self, principal_ref: str) -> list[tuple[str, str]]:
        return self.limiter.headers(principal_ref, self._clock())

    def status(self) -> dict[str, PrincipalStatus]:
        return self.limiter.status(self._clock())

    def status_of(self, principal_ref: str) -> PrincipalStatus:
        return self.limiter.status_of(principal_ref, self._clock())

    def apply_config(self, section: LimitsSection) -> None:
        self.limiter.apply_config(section, self._clock())

    def backend_row(self) -> BackendRow:
        return {
            "backend": "memory",
            "on_backend_error": "local",
            "state": "ok",
            "outage_since": None,
            "errors_total": 0,
        }

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
