"""The pool's wait queue: weighted fair across principals, FIFO within one.

Why this shape: when waiters of several principals compete for the same
providers, capacity goes to them in proportion to their ``share``; one
principal flooding the pool only lengthens its own line.  This is start-time
weighted fair queuing with virtual time:

* Each *principal* with waiters carries one tag: the virtual finish time
  its next admission takes.  When its line goes from empty to one waiter,
  ``tag = max(V, last[p]) + 1 / share[p]``, where ``V`` is the queue's
  virtual time and ``last[p]`` the tag of its last admitted waiter (kept
  only while still ahead of ``V``).  Each admission of one of its waiters
  moves it on: ``tag = max(V, tag) + 1 / share[p]``.  Only admissions move
  it: a waiter that timed out or was cancelled never took the tag, so it
  costs nothing later, and a line that empties forgets its tag (waiting
  earlier earns no credit).  A principal that keeps one request waiting at
  a time still moves on by ``1 / share`` per admission (without that, it
  could take every slot ahead of a lower-share waiter forever).
* Waiters are admitted in ``(tag of their principal, seq)`` order among
  those that fit, so FIFO within a principal; each admission moves ``V`` up
  to the admitted waiter's start (``tag - 1 / share``).  Two principals
  that both keep waiters for the same slots are admitted ``share_a : share_b``
  (within one admission of each, see ``tests/edge/pool/test_fair_queue.py``), and with
  a single principal the order is plain FIFO, as before.
* ``Waiter.tag`` is the tag it was admitted with; while it waits, the tag it
  would get if every waiter of its principal ahead of it were admitted first
  (an upper bound: cancels ahead of it only lower it).

Fairness never idles a slot: the scheduler's rule "every waiter that fits is
admitted" still holds -- the order only decides *which* fitting waiter takes
a slot first.

Data structures (for large queues, ``scripts/bench_pool.py``): one FIFO per
*lane*, a ``(WaitKey, principal)`` pair (an insertion-ordered dict, O(1)
removal on cancel; a cancel touches no tag).  Re-examination merges lane
heads through a heap keyed by ``(tag of the principal, seq)``; when one of
a principal's lanes is admitted, the heap entries of its other lanes are
stale and are pushed again with the new tag as they come up.  Whether a
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
from .routing import RouteAsk

__all__ = ["FairQueue", "Lane", "Waiter", "WaiterState"]

#: A lane: the waiters of one principal with one key, in FIFO order.
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
    start: float = 0.0  # virtual start time: tag - 1 / share (fair queue)
    tag: float = 0.0  # virtual finish time: provisional while pending (see module doc)
    state: WaiterState = WaiterState.PENDING
    grant: Grant | None = None
    error: BaseException | None = None
    route: RouteAsk | None = None  # its prompt and session, for a prefix-routed group

    @property
    def group_id(self) -> str:
        return self.key.group_id

    @property
    def lane(self) -> Lane:
        return (self.key, self.principal)


class FairQueue:
    """Pending waiters by lane, their principals' fair-queue tags, count and byte totals."""

    def __init__(self) -> None:
        self.lanes: dict[Lane, dict[int, Waiter]] = {}
        self.depth = 0
        self.bytes = 0
        self.vtime = 0.0
        self._seq = itertools.count()
        self._tag: dict[str, float] = {}  # principal with waiters -> its next admission's tag
        self._share: dict[str, int] = {}  # principal with waiters -> its latest share
        self._last_admitted: dict[str, float] = {}  # only tags still ahead of vtime
        self._waiting: dict[str, int] = {}  # principal -> pending waiters

    def new_waiter(
        self, key: WaitKey, principal: str, share: int, queue_timeout: float, body_bytes: int
    ) -> Waiter:
        """Enqueue a waiter at the back of its lane.

        Its ``tag`` is provisional: the tag it would be admitted with if every
        waiter of its principal ahead of it were admitted first (cancels only
        lower it).  The principal's own tag is set here when its line was empty.
        """
        share = max(1, share)
        self._share[principal] = share
        ahead = self._waiting.get(principal, 0)
        if ahead == 0:
            base = self._last_admitted.pop(principal, self.vtime)
            if base > self.vtime:  # still ahead of V: keep it (else it is a no-op)
                self._last_admitted[principal] = base
            self._tag[principal] = max(self.vtime, base) + 1.0 / share
        tag = self._tag[principal] + ahead / share
        self._waiting[principal] = ahead + 1
        waiter = Waiter(
            seq=next(self._seq),
            key=key,
            queue_timeout=queue_timeout,
            body_bytes=body_bytes,
            principal=principal,
            start=tag - 1.0 / share,
            tag=tag,
        )
        self.lanes.setdefault(waiter.lane, {})[waiter.seq] = waiter
        self.depth += 1
        self.bytes += body_bytes
        return waiter

    def tag_of(self, principal: str) -> float:
        """The tag a principal's next admission carries (it has waiters)."""
        return self._tag[principal]

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
        else:  # an empty line forgets its tag: no credit, no debt
            del self._waiting[waiter.principal]
            del self._tag[waiter.principal]
            del self._share[waiter.principal]
        return True

    def admit(self, waiter: Waiter) -> None:
        """Take a pending waiter out for a slot: it carries its principal's tag.

        Virtual time moves to the waiter's start, and the principal's next
        waiter (if any) is due ``1 / share`` later.
        """
        principal = waiter.principal
        tag = self._tag[principal]
        share = self._share[principal]
        self.pop(waiter)
        waiter.tag = tag
        waiter.start = tag - 1.0 / share
        if waiter.start > self.vtime:
            self.vtime = waiter.start
        if tag > self._last_admitted.get(principal, self.vtime):
            self._last_admitted[principal] = tag  # its line may empty by a cancel later
        if principal in self._tag:
            self._tag[principal] = max(self.vtime, tag) + 1.0 / share

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
