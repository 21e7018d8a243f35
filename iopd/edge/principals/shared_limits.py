"""``limits.backend: redis``: per-principal limits every edge shares, and what an outage does.

Why this shape: the store (``iopd.edge.principals.store``) is the one owner of
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
* **Outage**: a store call that fails, answers anything but the script's
  reply (a protocol error, garbage, a truncated reply) or takes over
  ``limits.backend_timeout`` of the store's time (not this loop's lag:
  ``iopd.edge.principals.lag_deadline``) starts one: logged once, counted in
  ``iop_limits_backend_errors_total``, shown in ``/status``.  The client is
  discarded at once (never reused mid-reply); every :data:`PROBE_S` seconds
  a new one is built and probed (``PING`` and a script); once both answer,
  what the outage left is written to the store and the outage ends (bound:
  :meth:`SharedLimits.recovery_bound_s`).  Meanwhile ``on_backend_error``
  decides: ``local`` a per-edge limiter and slot count; ``reject`` 503
  ``limits_unavailable``; ``allow`` no limits.
* **The per-edge limiter** (``local``) is kept for the edge's whole life and
  counts every admission and every slot of this edge, the store's too: so
  during an outage this edge admits at most one limit's worth in any
  window together with what it admitted through the store, and an outage
  that flaps does not start it empty again.  What it admitted by itself is
  written to the store at recovery, stamped with its own times
  (``LimitsStore.record``): the window goes on, nothing restarts it.
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
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio
from prometheus_client import Counter

from iopd import errors
from iopd.config.schema import EdgeConfig, LimitsSection
from iopd.edge.metering.metrics import GatewayMetrics
from iopd.edge.principals.backend import (
    AnyAdmission,
    BackendRow,
    Decision,
    LimitsBackend,
    MemoryLimits,
)
from iopd.edge.principals.decisions import (
    Limits,
    NeverFits,
    PrincipalStatus,
    Rejection,
    headers_of,
    limits_from_config,
    reserved_tokens,
    settled_tokens,
)
from iopd.edge.principals.held import Held, LocalCounts
from iopd.edge.principals.lag_deadline import LAG_ALLOWANCE_S, lag_aware_deadline
from iopd.edge.principals.limiter import WINDOW_S, Admission, PrincipalLimiter
from iopd.edge.principals.reservation import Reservation
from iopd.edge.principals.store import Admitted, LimitsStore, StoreView, Unseen

__all__ = ["PROBE_S", "SLOT_POLL_S", "SharedLimits", "limits_backend_for"]

log = logging.getLogger("iopd.edge.limits")

#: A waiter held by a shared ``max_concurrent`` asks the store this often (s).
SLOT_POLL_S = 0.05
#: During an outage a new client is built and the store probed this often (s).
PROBE_S = 1.0
#: Admissions written to the store per ``record`` call (bounds one script's run).
RECORD_CHUNK = 200

_T = TypeVar("_T")


class _StoreDown(Exception):
    """The store failed a call or is in an outage (never leaves this module)."""


def limits_backend_for(
    cfg: EdgeConfig, limiter: PrincipalLimiter, clock: Callable[[], float], metrics: GatewayMetrics
) -> LimitsBackend:
    """The backend ``limits.backend`` names."""
    section = cfg.limits
    if section.backend == "redis" and section.redis_url:
        backstop = section.backend_timeout + LAG_ALLOWANCE_S + 1.0  # the client's own timeouts
        store = LimitsStore(section.redis_url, timeout=section.backend_timeout, backstop=backstop)
        return SharedLimits(section, store, metrics)
    return MemoryLimits(limiter, clock)


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
        self._leases: dict[str, Held] = {}  # key -> a running request's store lease
        self._lines: dict[str, trio.Lock] = {}  # ref -> FIFO of this edge's slot waiters
        self._redo: list[Callable[[], Awaitable[object]]] = []  # calls to repeat at recovery
        self._outage_since: float | None = None
        self._down = trio.Event()  # set when an outage starts: the client is discarded
        self._local: LocalCounts | None = None
        if self._mode == "local":
            self._local = LocalCounts(PrincipalLimiter(section, time.time()))
        #: ref -> admissions made without the store, oldest first, to write there at recovery.
        self._unseen: dict[str, deque[Held]] = {}
        #: ref -> tokens of settled ones past the minute (only their day counts) and when.
        self._unseen_day: dict[str, tuple[int, float]] = {}
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
        """One store call, bounded by ``backend_timeout`` of the store's time
        (:func:`iopd.edge.principals.lag_deadline.lag_aware_deadline`) and shielded from the caller's cancel (its outcome
        must be known); anything but a clean reply starts an outage."""
        if self._outage_since is not None:
            raise _StoreDown
        try:
            with trio.CancelScope(shield=True):
                result = await lag_aware_deadline(call, self._timeout)
        except Exception as exc:  # the client's errors, garbage, a timeout: the store is away
            self._failed(exc)
            raise _StoreDown from None
        return result

    def _failed(self, exc: BaseException) -> None:
        self.errors_total += 1
        self._errors.inc()
        if self._outage_since is None:
            self._outage_since = time.time()
            self._down.set()
            log.warning(
                "event=limits_backend_down reason=%s on_backend_error=%s",
                _reason(exc),
                self._mode,
            )

    # ------------------------------------------------------------- admission

    async def admit(self, principal_ref: str, reservation: Reservation) -> Decision:
        limits = self.limits_for(principal_ref)
        tokens = reserved_tokens(principal_ref, limits, reservation)
        if isinstance(tokens, NeverFits):
            return tokens
        held = Held(principal_ref, tokens, secrets.token_hex(12))
        floor = tokens if reservation.explicit_output else reservation.required
        if self._outage_since is None:
            try:
                got = await self._call(
                    lambda: self.store.admit(
                        principal_ref, held.key, limits, tokens, self._ttl, slot=True, floor=floor
                    )
                )
            except _StoreDown:
                self._redo_withdraw(held)  # it may have reached the store
                held = Held(principal_ref, tokens, secrets.token_hex(12))  # never that key again
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
                if self._local is not None:  # this edge's own count follows the store's
                    local = self._local.limiter.try_admit(principal_ref, reservation, time.time())
                    held.local = local if isinstance(local, Admission) else None
                held.reserved_tokens = got.tokens
                if got.slot:
                    self._holds_store_slot(held)
                return held
        return self._admit_in_outage(held, principal_ref, reservation)

    def _holds_store_slot(self, held: Held) -> None:
        held.slot = True
        self._leases[held.key] = held
        if self._local is not None and held.local_slot is None:
            self._local.count(held.principal_ref)
            held.local_slot = self._local

    def _admit_in_outage(self, held: Held, ref: str, reservation: Reservation) -> Decision:
        if self._mode == "reject":
            raise _unavailable()
        if self._mode == "allow" or self._local is None:
            return None
        decision = self._local.limiter.try_admit(ref, reservation, time.time())
        if not isinstance(decision, Admission):
            return decision
        held.local, held.at = decision, trio.current_time()
        held.reserved_tokens = decision.reserved_tokens  # cut like the store's, when cuttable
        limits = self.limits_for(ref)
        if limits.rate_limited or limits.max_concurrent:  # nothing to write for no limits
            self._remember_unseen(held)
        return held

    def _remember_unseen(self, held: Held) -> None:
        """Keep an admission made without the store until recovery writes it there.

        Memory: settled ones past the minute only count for the day, so they
        are folded into one sum per principal; what stays is what the minute
        holds (bounded by the limits) and what still runs.
        """
        ref, now = held.principal_ref, trio.current_time()
        line = self._unseen.setdefault(ref, deque())
        line.append(held)
        while line and line[0].settled and now - max(line[0].at, line[0].ended_at) > WINDOW_S:
            old = line.popleft()
            if not old.withdrawn:
                tokens, _ = self._unseen_day.get(ref, (0, 0.0))
                self._unseen_day[ref] = (tokens + old.used, old.ended_at)

    async def hold_slot(self, admission: AnyAdmission, timeout: float) -> None:
        if not isinstance(admission, Held) or admission.slot or admission.local_slot:
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
        if not isinstance(admission, Held) or admission.slot or admission.local_slot:
            return True
        return await self._try_slot(admission)

    async def free_slot(self, admission: AnyAdmission) -> None:
        if not isinstance(admission, Held) or admission.settled:
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

    async def _try_slot(self, held: Held) -> bool:
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
                    held.in_store = True
                    self._holds_store_slot(held)
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
        if isinstance(admission, Held):
            await self._end(admission, None, withdraw=True)

    async def settle(
        self, admission: AnyAdmission, used_tokens: int | None, estimated: int = 0
    ) -> None:
        if isinstance(admission, Held):
            await self._end(admission, used_tokens, withdraw=False, estimated=estimated)

    async def _end(
        self, held: Held, used_tokens: int | None, *, withdraw: bool, estimated: int = 0
    ) -> None:
        if held.settled:
            return
        held.settled = True
        ref, reserved = held.principal_ref, held.reserved_tokens
        used = settled_tokens(reserved, used_tokens, estimated)
        held.used, held.withdrawn, held.ended_at = used, withdraw, trio.current_time()
        self._leases.pop(held.key, None)
        if held.local_slot is not None:
            held.local_slot.give(held.principal_ref)
            held.local_slot = None
        if held.local is not None and self._local is not None:
            if withdraw:
                self._local.limiter.withdraw(held.local, time.time())
            else:
                self._local.limiter.settle(held.local, used_tokens, time.time(), estimated)
        if not held.in_store:
            return
        tpd = self.limits_for(ref).tokens_per_day

        async def end() -> StoreView:
            if withdraw:
                return await self.store.withdraw(ref, held.key, reserved, tpd, held.day)
            return await self.store.settle(ref, held.key, reserved, used, tpd, held.day)

        try:
            self._saw(ref, await self._call(end))
        except _StoreDown:
            self._redo.append(end)  # idempotent in the store: sent again at recovery

    def _redo_withdraw(self, held: Held) -> None:
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
        if self._outage_since is not None and self._local is not None:
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

    def recovery_bound_s(self) -> float:
        """How long after the store answers properly again this edge may stay in
        ``outage``, when the outage left nothing to write: the probe under way
        (a ``PING`` and a script: ``2 x backend_timeout`` plus the loop lag
        given back, :func:`iopd.edge.principals.lag_deadline.lag_aware_deadline`), the pause before the next
        (:data:`PROBE_S`), and that probe.  Each call the outage left (a
        principal's admissions to write, a settlement to send again) adds one
        ``backend_timeout`` (plus lag).
        """
        probe = 2 * self._timeout + LAG_ALLOWANCE_S
        return probe + PROBE_S + probe

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold a client; renew this edge's leases every TTL/3; in an outage,
        discard the client and probe the store with a new one every :data:`PROBE_S`."""
        started = False
        while True:
            try:
                async with self.store.client:
                    if not started:
                        started = True
                        task_status.started()
                    await self._serve()
            except Exception as exc:  # entering or closing a client that failed
                self._failed(exc)
            if not started:
                started = True
                task_status.started()
            await trio.sleep(PROBE_S)
            self.store.rebuild()

    async def _serve(self) -> None:
        """Until this client is to be discarded: probe it first when in an outage."""
        if self._outage_since is not None and not await self._probe():
            return
        while self._outage_since is None:
            with trio.move_on_after(self._ttl / 3):
                await self._down.wait()
            if self._outage_since is None:
                await self._renew()

    async def _renew(self) -> None:
        by_ref: dict[str, list[str]] = {}
        for key, held in self._leases.items():
            by_ref.setdefault(held.principal_ref, []).append(key)
        for ref, keys in by_ref.items():
            try:
                await self._call(functools.partial(self.store.renew, ref, keys, self._ttl))
            except _StoreDown:
                return

    async def _probe(self) -> bool:
        """One try of the store during an outage; on clean answers, recover (True)."""
        try:
            await lag_aware_deadline(self.store.probe, 2 * self._timeout)
            # Until nothing is left: requests admitted meanwhile (the outage holds
            # until the last await) are written in the next round.
            while self._unseen or self._unseen_day or self._redo:
                await self._write_unseen()
                while self._redo:  # what the outage left unknown, made exact
                    await self._redo_one(self._redo[0])
                    self._redo.pop(0)
        except Exception as exc:
            self.errors_total += 1
            self._errors.inc()
            log.info("event=limits_backend_probe_failed reason=%s", _reason(exc))
            return False
        outage_s = time.time() - (self._outage_since or time.time())
        self._outage_since, self._down = None, trio.Event()
        log.warning("event=limits_backend_up outage_s=%.1f", outage_s)
        await self._renew()
        return True

    async def _redo_one(self, call: Callable[[], Awaitable[object]]) -> None:
        """One call the outage left; one the store refuses outright (it answered,
        with an error) is dropped, logged: it would never succeed."""
        from coredis.exceptions import ResponseError

        try:
            await lag_aware_deadline(call, self._timeout)
        except ResponseError as exc:
            log.warning("event=limits_backend_redo_refused reason=%s", _reason(exc))

    async def _write_unseen(self) -> None:
        """Write what this edge admitted without the store into it (``LimitsStore.record``).

        A running admission is marked ``in_store`` before the call, so its
        settlement, should it come meanwhile, is queued to be sent after this
        (the outage still holds).  A call that fails puts its admissions back,
        to be sent again with the next probe: one that did reach the store is
        skipped there, one that has settled meanwhile is written as settled
        and its queued settlement then finds it done.
        """
        for ref in list(self._unseen.keys() | self._unseen_day.keys()):
            line = self._unseen.pop(ref, deque())
            day = self._unseen_day.pop(ref, None)
            batch = [h for h in line if not h.withdrawn]
            for held in batch:
                held.in_store = held.in_store or not held.settled
            try:
                await self._record(ref, batch, day)
            except BaseException:
                self._unseen.setdefault(ref, deque()).extendleft(reversed(line))
                if day is not None:
                    tokens, at = self._unseen_day.get(ref, (0, 0.0))
                    self._unseen_day[ref] = (tokens + day[0], max(at, day[1]))
                raise

    async def _record(self, ref: str, batch: list[Held], day: tuple[int, float] | None) -> None:
        now = trio.current_time()
        unseen = [self._unseen_of(h, now) for h in batch]
        if day is not None:  # settled past the minute: the day's total only
            tokens, at = day
            unseen.append(Unseen(f"day-{secrets.token_hex(8)}", now - at, tokens, settled=True))
        tpd = self.limits_for(ref).tokens_per_day
        by_key = {h.key: h for h in batch}
        for start in range(0, len(unseen), RECORD_CHUNK):
            chunk = unseen[start : start + RECORD_CHUNK]
            days = await lag_aware_deadline(
                functools.partial(self.store.record, ref, tpd, self._ttl, chunk), self._timeout
            )
            for u, got in zip(chunk, days, strict=True):
                held = by_key.get(u.key)
                if held is None:
                    continue
                held.day = got
                if u.slot and not held.settled and held.local_slot is not None:
                    self._holds_store_slot(held)  # the script took its lease

    @staticmethod
    def _unseen_of(held: Held, now: float) -> Unseen:
        if not held.settled:
            return Unseen(held.key, now - held.at, held.reserved_tokens, slot=bool(held.local_slot))
        kept = min(held.used, held.reserved_tokens)
        debt = held.used - kept
        age = now - held.at
        return Unseen(held.key, age, kept, debt, now - held.ended_at, settled=True)


def _reason(exc: BaseException) -> str:
    """A failure's name for the log: the exception's class, never its text (it may
    hold a URL); the first of a group (the client's task group wraps its errors)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return "timeout" if isinstance(exc, trio.TooSlowError) else type(exc).__name__


def _unavailable() -> errors.LimitsUnavailable:
    return errors.LimitsUnavailable(
        "The per-principal limits store is unreachable and limits.on_backend_error is reject; "
        "try again shortly."
    )
