"""``limits.backend: redis``: per-principal limits every edge shares, and what an outage does.

Why this shape: the store (``iopd.edge.limits_store``) is the one owner of
the counters while it answers; this module adds what an edge does around
it, and nothing is decided twice:

* **Admission** is one script call (the check, the reservation and, when a
  slot is free, the principal's concurrency lease); **settlement** is one
  more (tokens and the lease at once).  Retries and fallbacks hold the same
  admission, so nothing counts twice; a call whose outcome is unknown (a
  timeout, a cancel) is made exact later: its withdrawal or settlement is
  sent again at recovery, and the store's ``done`` set makes that
  idempotent.
* **Concurrency** (``max_concurrent``) is a lease per running request in the
  store, with a TTL of ``limits.lease_ttl`` renewed every TTL/3 while the
  request runs, so an edge that dies frees its slots within the TTL.  A
  request never holds a slot while it waits for a provider, nor a provider
  while it waits for a slot, so the cap counts running requests, as the
  pool counts them with ``memory``.  A slot free at admission is taken
  with it (one round trip); one that is not is waited for here, FIFO per
  principal on this edge (a fair ``trio.Lock``), the head of that line
  asking the store every :data:`SLOT_POLL_S` seconds, so a slot freed on
  any edge is taken within that.  Then the request leases a provider; if
  it has to queue, its slot is given back meanwhile (:meth:`free_slot`)
  and taken again when the pool grants one (:meth:`try_slot`); refused
  then, it lets the provider go and waits here again
  (``iopd.edge.openai.limits.lease_with_slot``).  ``share`` and the fair
  queue across principals stay the pool's, per edge.
* **Outage**: a store call that fails or takes over ``limits.backend_timeout``
  starts one.  It is logged once, counted in ``iop_limits_backend_errors_total``
  and shown in ``/status`` (``limits_backend``); the store is asked again
  every :data:`PROBE_S` seconds, and meanwhile ``limits.on_backend_error``
  says what requests get: ``local`` a per-edge limiter and slot count that
  start empty (so up to N x the limits across N edges) and are discarded at
  recovery; ``reject`` 503 ``limits_unavailable``; ``allow`` no limits.
  Requests admitted by the store keep their store admission through the
  outage (settled at recovery); their leases, if the outage outlasts the
  TTL, are put back by the next renewal.

Headers and ``/status`` use the windows the store returned with this edge's
last call for the principal (no extra round trip), aged by the time since.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio
from prometheus_client import Counter

from iopd import errors
from iopd.config.schema import EdgeConfig, LimitsSection
from iopd.edge.limit_decisions import (
    Limits,
    NeverFits,
    PrincipalStatus,
    Rejection,
    headers_of,
    limits_from_config,
    reserved_tokens,
)
from iopd.edge.limits_backend import (
    AnyAdmission,
    BackendRow,
    Decision,
    LimitsBackend,
    MemoryLimits,
    SharedAdmission,
)
from iopd.edge.limits_store import Admitted, LimitsStore, StoreView
from iopd.edge.metrics import GatewayMetrics
from iopd.edge.principal_limits import Admission, PrincipalLimiter
from iopd.edge.token_reservation import Reservation

__all__ = ["PROBE_S", "SLOT_POLL_S", "SharedLimits", "limits_backend_for"]

log = logging.getLogger("iopd.edge.limits")

#: A waiter held by a shared ``max_concurrent`` asks the store this often (s).
SLOT_POLL_S = 0.05
#: During an outage the store is asked again this often (s).
PROBE_S = 1.0

_T = TypeVar("_T")


class _StoreDown(Exception):
    """The store failed a call or is in an outage (never leaves this module)."""


def limits_backend_for(
    cfg: EdgeConfig, limiter: PrincipalLimiter, clock: Callable[[], float], metrics: GatewayMetrics
) -> LimitsBackend:
    """The backend ``limits.backend`` names."""
    section = cfg.limits
    if section.backend == "redis" and section.redis_url:
        store = LimitsStore(section.redis_url, timeout=section.backend_timeout)
        return SharedLimits(section, store, metrics)
    return MemoryLimits(limiter, clock)


@dataclass
class _Local:
    """What stands in for the store during one outage (``on_backend_error: local``)."""

    limiter: PrincipalLimiter
    running: dict[str, int] = field(default_factory=dict)

    def take(self, ref: str, cap: int) -> bool:
        if self.running.get(ref, 0) >= cap:
            return False
        self.running[ref] = self.running.get(ref, 0) + 1
        return True

    def give(self, ref: str) -> None:
        left = self.running.get(ref, 0) - 1
        if left > 0:
            self.running[ref] = left
        else:
            self.running.pop(ref, None)


@dataclass(eq=False)
class _Held(SharedAdmission):
    """A :class:`SharedAdmission` with what this edge keeps about it."""

    day: int = -1  # its UTC day by the server's clock; -1 while unknown
    in_store: bool = False  # the store may hold it (settle or withdraw there)
    local: Admission | None = None  # admitted by the outage's local limiter
    local_slot: _Local | None = None  # holds a slot of that outage's count


class SharedLimits:
    """``limits.backend: redis`` (see the module doc)."""

    def __init__(self, section: LimitsSection, store: LimitsStore, metrics: GatewayMetrics) -> None:
        self.store = store
        self._mode = section.on_backend_error
        self._timeout = section.backend_timeout
        self._ttl = section.lease_ttl
        self._section = section
        self._default, self._limits = limits_from_config(section)
        self._seen: dict[str, tuple[StoreView, float]] = {}  # ref -> (view, trio time read)
        self._leases: dict[str, _Held] = {}  # key -> a running request's store lease
        self._lines: dict[str, trio.Lock] = {}  # ref -> FIFO of this edge's slot waiters
        self._redo: list[Callable[[], Awaitable[object]]] = []  # calls to repeat at recovery
        self._outage_since: float | None = None
        self._local: _Local | None = None
        self.errors_total = 0
        self._errors = Counter(
            "iop_limits_backend_errors",
            "Calls to the shared limits store that failed or ran over limits.backend_timeout.",
            ("edge_id",),
            registry=metrics.registry,
        ).labels(metrics.edge_id)

    # ------------------------------------------------------------- config

    def limits_for(self, ref: str) -> Limits:
        return self._limits.get(ref, self._default)

    def apply_config(self, section: LimitsSection) -> None:
        self._section = section
        self._default, self._limits = limits_from_config(section)
        if self._local is not None:
            self._local.limiter.apply_config(section, time.time())

    # ------------------------------------------------------------- store calls

    async def _call(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """One store call, bounded by ``backend_timeout`` and shielded from the
        caller's cancel (its outcome must be known); an error starts an outage."""
        if self._outage_since is not None:
            raise _StoreDown
        try:
            with trio.CancelScope(shield=True), trio.fail_after(self._timeout):
                result = await call()
        except Exception as exc:  # the client's errors, a timeout: all mean the store is away
            self._failed(exc)
            raise _StoreDown from None
        return result

    def _failed(self, exc: BaseException) -> None:
        self.errors_total += 1
        self._errors.inc()
        if self._outage_since is None:
            self._outage_since = time.time()
            if self._mode == "local":  # per-edge counters, empty from now on
                self._local = _Local(PrincipalLimiter(self._section, time.time()))
            reason = "timeout" if isinstance(exc, trio.TooSlowError) else type(exc).__name__
            log.warning(
                "event=limits_backend_down reason=%s on_backend_error=%s", reason, self._mode
            )

    # ------------------------------------------------------------- admission

    async def admit(self, principal_ref: str, reservation: Reservation) -> Decision:
        limits = self.limits_for(principal_ref)
        tokens = reserved_tokens(principal_ref, limits, reservation)
        if isinstance(tokens, NeverFits):
            return tokens
        held = _Held(principal_ref, tokens, secrets.token_hex(12))
        if self._outage_since is None:
            try:
                got = await self._call(
                    lambda: self.store.admit(
                        principal_ref, held.key, limits, tokens, self._ttl, slot=True
                    )
                )
            except _StoreDown:
                self._redo_withdraw(held)  # it may have reached the store
            else:
                if got is None:  # cannot happen: a fresh key is never withdrawn
                    return None
                self._saw(principal_ref, got.view)
                if not isinstance(got, Admitted):
                    return Rejection(
                        principal_ref,
                        got.limit,
                        got.limit_value,
                        got.used,
                        got.requested,
                        got.retry_after_s,
                    )
                held.in_store, held.day, held.slot = True, got.day, got.slot
                if got.slot:
                    self._leases[held.key] = held
                return held
        return self._admit_in_outage(held, principal_ref, reservation)

    def _admit_in_outage(self, held: _Held, ref: str, reservation: Reservation) -> Decision:
        if self._mode == "reject":
            raise _unavailable()
        if self._mode == "allow" or self._local is None:
            return None
        decision = self._local.limiter.try_admit(ref, reservation, time.time())
        if not isinstance(decision, Admission):
            return decision
        held.local = decision
        return held

    async def hold_slot(self, admission: AnyAdmission, timeout: float) -> None:
        if not isinstance(admission, _Held) or admission.slot or admission.local_slot:
            return
        ref = admission.principal_ref
        if not self.limits_for(ref).max_concurrent:
            return
        line = self._lines.setdefault(ref, trio.Lock())
        with trio.move_on_after(timeout):
            async with line:
                # Polling on purpose: a slot frees on any edge, and the store tells no one.
                while not await self._try_slot(admission):  # noqa: ASYNC110
                    await trio.sleep(SLOT_POLL_S)
                if not line.statistics().tasks_waiting:
                    self._lines.pop(ref, None)
                return
        raise errors.QueueTimeout(
            f"timed out waiting for a slot of principal {ref!r} (limits max_concurrent)"
        )

    async def try_slot(self, admission: AnyAdmission) -> bool:
        if not isinstance(admission, _Held) or admission.slot or admission.local_slot:
            return True
        return await self._try_slot(admission)

    async def free_slot(self, admission: AnyAdmission) -> None:
        if not isinstance(admission, _Held) or admission.settled:
            return
        ref, key = admission.principal_ref, admission.key
        if admission.local_slot is not None:
            admission.local_slot.give(ref)
            admission.local_slot = None
        if not admission.slot:
            return
        admission.slot = False
        self._leases.pop(key, None)  # not renewed from now on
        with contextlib.suppress(_StoreDown):  # then it expires within the TTL (or settles)
            await self._call(lambda: self.store.free_slot(ref, key))

    async def _try_slot(self, held: _Held) -> bool:
        """One try at a slot: the store's, or during an outage the mode's."""
        ref, cap = held.principal_ref, self.limits_for(held.principal_ref).max_concurrent
        if cap == 0:
            return True
        if self._outage_since is None:
            try:
                taken = await self._call(lambda: self.store.take_slot(ref, held.key, cap, self._ttl))
            except _StoreDown:
                held.in_store = True  # the lease may be there: settle frees it
            else:
                if taken == 1:
                    held.slot, held.in_store = True, True
                    self._leases[held.key] = held
                return taken != 0
        if self._mode == "reject":
            raise _unavailable()
        if self._mode == "allow" or self._local is None:
            return True
        if self._local.take(ref, cap):
            held.local_slot = self._local
            return True
        return False

    async def withdraw(self, admission: AnyAdmission) -> None:
        if isinstance(admission, _Held):
            await self._end(admission, None, withdraw=True)

    async def settle(self, admission: AnyAdmission, used_tokens: int | None) -> None:
        if isinstance(admission, _Held):
            await self._end(admission, used_tokens, withdraw=False)

    async def _end(self, held: _Held, used_tokens: int | None, *, withdraw: bool) -> None:
        if held.settled:
            return
        held.settled = True
        self._leases.pop(held.key, None)
        if held.local_slot is not None:
            held.local_slot.give(held.principal_ref)
        if held.local is not None and self._local is not None:
            if withdraw:
                self._local.limiter.withdraw(held.local, time.time())
            else:
                self._local.limiter.settle(held.local, used_tokens, time.time())
        if not held.in_store:
            return
        ref, reserved = held.principal_ref, held.reserved_tokens
        used = reserved if used_tokens is None else max(0, used_tokens)
        tpd = self.limits_for(ref).tokens_per_day

        async def end() -> StoreView:
            if withdraw:
                return await self.store.withdraw(ref, held.key, reserved, tpd, held.day)
            return await self.store.settle(ref, held.key, reserved, used, tpd, held.day)

        try:
            self._saw(ref, await self._call(end))
        except _StoreDown:
            self._redo.append(end)  # idempotent in the store: sent again at recovery

    def _redo_withdraw(self, held: _Held) -> None:
        ref, key, reserved = held.principal_ref, held.key, held.reserved_tokens
        tpd = self.limits_for(ref).tokens_per_day
        self._redo.append(lambda: self.store.withdraw(ref, key, reserved, tpd, -1))

    # ------------------------------------------------------------- views

    def _saw(self, ref: str, view: StoreView) -> None:
        self._seen[ref] = (view, trio.current_time())

    def headers(self, principal_ref: str) -> list[tuple[str, str]]:
        limits = self.limits_for(principal_ref)
        if not limits.rate_limited:
            return []
        return headers_of(self.status_of(principal_ref))

    def status_of(self, principal_ref: str) -> PrincipalStatus:
        limits = self.limits_for(principal_ref)
        if self._local is not None:
            return self._local.limiter.status_of(principal_ref, time.time())
        seen = self._seen.get(principal_ref)
        if seen is None:
            return StoreView(time.time(), 0, 0.0, 0, 0.0, int(time.time() // 86_400), 0).status(
                principal_ref, limits
            )
        view, at = seen
        return view.status(principal_ref, limits, trio.current_time() - at)

    def status(self) -> dict[str, PrincipalStatus]:
        refs = sorted(self._limits.keys() | self._seen.keys())
        return {ref: self.status_of(ref) for ref in refs}

    def backend_row(self) -> BackendRow:
        return {
            "backend": "redis",
            "on_backend_error": self._mode,
            "state": "ok" if self._outage_since is None else "outage",
            "outage_since": self._outage_since,
            "errors_total": self.errors_total,
        }

    # ------------------------------------------------------------- background

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the client; renew this edge's leases every TTL/3; probe during an outage."""
        async with self.store.client:
            task_status.started()
            while True:
                if self._outage_since is None:
                    await trio.sleep(self._ttl / 3)
                    await self._renew()
                else:
                    await trio.sleep(PROBE_S)
                    await self._probe()

    async def _renew(self) -> None:
        by_ref: dict[str, list[str]] = {}
        for key, held in self._leases.items():
            by_ref.setdefault(held.principal_ref, []).append(key)
        for ref, keys in by_ref.items():
            try:
                await self._call(functools.partial(self.store.renew, ref, keys, self._ttl))
            except _StoreDown:
                return

    async def _probe(self) -> None:
        """One try of the store during an outage; on an answer, recover."""
        try:
            with trio.fail_after(self._timeout):
                await self.store.ping()
            while self._redo:  # what the outage left unknown, made exact
                with trio.fail_after(self._timeout):
                    await self._redo[0]()
                self._redo.pop(0)
        except Exception:
            self.errors_total += 1
            self._errors.inc()
            return
        outage_s = time.time() - (self._outage_since or time.time())
        self._outage_since, self._local = None, None
        log.warning("event=limits_backend_up outage_s=%.1f", outage_s)
        await self._renew()


def _unavailable() -> errors.LimitsUnavailable:
    return errors.LimitsUnavailable(
        "The per-principal limits store is unreachable and limits.on_backend_error is reject; "
        "try again shortly."
    )
