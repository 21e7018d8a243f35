"""The pool's wait queue: weighted fair across principals, FIFO within one (issue #17).

Why this shape: when waiters of several principals compete for the same
providers, capacity goes to them in proportion to their ``share``; one
principal flooding the pool only lengthens its own line.  This is start-time
weighted fair queuing with virtual time:

* Each waiter gets a *tag* at enqueue: ``start = max(V, last[p])``,
  ``tag = start + 1 / share[p]``, where ``V`` is the queue's virtual time
  and ``last[p]`` the tag of principal ``p``'s previous waiter while ``p``
  has waiters, else of its last *admitted* one.  So waiting earlier earns
  no credit, waiters that timed out or were cancelled cost nothing later,
  and a principal that keeps one request waiting at a time still moves on
  by ``1 / share`` per admission (without that, it could take every slot
  ahead of a lower-share waiter forever).
* Waiters are admitted in ``(tag, seq)`` order among those that fit; each
  admission moves ``V`` up to the admitted waiter's start.  Two principals
  that both keep waiters for the same slots are admitted ``share_a : share_b``
  (within one admission of each, see ``tests/test_pool_fair.py``), and with
  a single principal the order is plain FIFO, as before.

Fairness never idles a slot: the scheduler's rule "every waiter that fits is
admitted" still holds -- the order only decides *which* fitting waiter takes
a slot first.

Data structures (for large queues, ``scripts/bench_pool.py``): one FIFO per
*lane*, a ``(WaitKey, principal)`` pair (an insertion-ordered dict, O(1)
removal on cancel).  Tags grow within a principal, so each lane is in tag
order and re-examination only merges lane heads through a heap.  Whether a
lane's head fits depends only on its key and its principal's running count,
and admissions only take slots and running counts, so a lane whose head does
not fit is dropped for the rest of the pass.

The queue is bounded twice: by count (``max_queue``) and by the request-body
bytes its waiters hold (``max_queued_bytes``); the scheduler checks both.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from iopd.errors import QueueFull

from .candidates import Grant, PoolSnapshot, WaitKey

__all__ = ["FairQueue", "Lane", "Waiter", "WaiterState"]

#: A lane: the waiters of one principal with one key, in FIFO (= tag) order.
Lane = tuple[WaitKey, str]


class WaiterState(enum.Enum):
    PENDING = "pending"
    ADMITTED = "admitted"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class Waiter:
    """A queued request.  The scheduler resolves it to a grant or an error."""

    seq: int
    key: WaitKey
    queue_timeout: float
    body_bytes: int = 0  # counted in the queue's bytes while pending
    principal: str = ""
    start: float = 0.0  # virtual start time (fair queue)
    tag: float = 0.0  # virtual finish time: admission order among fitting waiters
    state: WaiterState = WaiterState.PENDING
    grant: Grant | None = None
    error: BaseException | None = None

    @property
    def group_id(self) -> str:
        return self.key.group_id

    @property
    def lane(self) -> Lane:
        return (self.key, self.principal)


class FairQueue:
    """Pending waiters by lane, their fair-queue tags, and the count and byte totals."""

    def __init__(self) -> None:
        self.lanes: dict[Lane, dict[int, Waiter]] = {}
        self.depth = 0
        self.bytes = 0
        self.vtime = 0.0
        self._seq = itertools.count()
        self._last_tag: dict[str, float] = {}  # principals with waiters
        self._last_admitted: dict[str, float] = {}  # only tags still ahead of vtime
        self._waiting: dict[str, int] = {}  # principal -> pending waiters

    def new_waiter(
        self, key: WaitKey, principal: str, share: int, queue_timeout: float, body_bytes: int
    ) -> Waiter:
        """Enqueue a waiter at the back of its lane, tagged for the fair order."""
        base = self._last_tag.get(principal)
        if base is None:
            base = self._last_admitted.pop(principal, self.vtime)
            if base > self.vtime:  # still ahead of V: keep it (else it is a no-op)
                self._last_admitted[principal] = base
        start = max(self.vtime, base)
        tag = start + 1.0 / max(1, share)
        self._last_tag[principal] = tag
        self._waiting[principal] = self._waiting.get(principal, 0) + 1
        waiter = Waiter(
            seq=next(self._seq),
            key=key,
            queue_timeout=queue_timeout,
            body_bytes=body_bytes,
            principal=principal,
            start=start,
            tag=tag,
        )
        self.lanes.setdefault(waiter.lane, {})[waiter.seq] = waiter
        self.depth += 1
        self.bytes += body_bytes
        return waiter

    def check_room(self, group_id: str, body_bytes: int, snap: PoolSnapshot) -> None:
        """Raise ``QueueFull`` unless one more waiter of ``body_bytes`` fits both bounds."""
        if self.depth >= snap.max_queue:
            raise QueueFull(
                f"all providers of model group '{group_id}' are busy and the request "
                f"queue is full ({snap.max_queue} waiting); retry later"
            )
        held = self.bytes
        if snap.max_queued_bytes == 0 or held + body_bytes > snap.max_queued_bytes:
            raise QueueFull(
                f"all providers of model group '{group_id}' are busy and the request "
                f"queue is full ({held} of {snap.max_queued_bytes} body "
                f"bytes held by waiting requests; this one has {body_bytes}); retry later"
            )

    def pop(self, waiter: Waiter) -> bool:
        """Take a pending waiter out of its lane; False when it was not there."""
        q = self.lanes.get(waiter.lane)
        if q is None or q.pop(waiter.seq, None) is None:
            return False
        if not q:
            del self.lanes[waiter.lane]
        self.depth -= 1
        self.bytes -= waiter.body_bytes
        left = self._waiting[waiter.principal] - 1
        if left:
            self._waiting[waiter.principal] = left
        else:  # an empty line forgets its tags: no credit, no debt
            del self._waiting[waiter.principal]
            del self._last_tag[waiter.principal]
        return True

    def admitted(self, waiter: Waiter) -> None:
        """A popped waiter got a slot: virtual time moves to its start."""
        if waiter.start > self.vtime:
            self.vtime = waiter.start
        if waiter.tag > self._last_admitted.get(waiter.principal, self.vtime):
            self._last_admitted[waiter.principal] = waiter.tag

    def drain_lane(self, lane: Lane) -> list[Waiter]:
        """Remove every waiter of a lane (its group lost its last candidate)."""
        out = list(self.lanes.get(lane, {}).values())
        for w in out:
            self.pop(w)
        return out

    def drain(self) -> list[Waiter]:
        """Remove every waiter (shutdown), in enqueue order."""
        out = self.pending()
        for w in out:
            self.pop(w)
        return out

    def pending(self) -> list[Waiter]:
        """All pending waiters in enqueue order (O(n log n); for tests and status)."""
        return sorted(self.iter_waiters(), key=lambda w: w.seq)

    def iter_waiters(self) -> Iterator[Waiter]:
        for q in self.lanes.values():
            yield from q.values()

    def lanes_of(self, principal: str) -> Iterable[Lane]:
        return [lane for lane in self.lanes if lane[1] == principal]

    def waiting_of(self, principal: str) -> int:
        return self._waiting.get(principal, 0)

    def waiting_by_principal(self) -> dict[str, int]:
        return dict(self._waiting)
