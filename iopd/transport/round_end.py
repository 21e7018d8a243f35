"""Run short synchronous callbacks at the end of the current run-loop round.

Why: the node relays hundreds of streams to the edge over one wire
connection, each stream in a task of its own.  Written at once, every chunk
costs one ``write(2)`` at the node and wakes the edge's reader for it; at 400
streams that is twenty thousand writes and wake-ups a second for one socket.
Deferred to the end of the round, every frame that the round's tasks
produced leaves in one write, and the edge reads them in one go
(``WireChannel.send_soon``).

*The end of a round* is trio's ``before_io_wait`` instrument hook: the run
loop calls it once per round, after the round's batch of tasks has run and
right before it polls for I/O (with a zero timeout when tasks are runnable).
So nothing is held longer than the rest of the batch: on an idle path the
callback runs as soon as the task that registered it blocks.

The callbacks run outside any task, inside the run loop itself.  They must
not raise (an exception is logged and the callback is dropped), must not
block, and must not wake tasks directly: a task rescheduled there could wait
for the poll's full timeout.  A callback that needs a task woken hands that
to ``TrioToken.run_sync_soon``, which also interrupts the poll.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

log = logging.getLogger("iopd.transport")

__all__ = ["call_at_round_end"]


class _RoundEnd(trio.abc.Instrument):
    """The run's one instrument: runs what was registered during the round."""

    def __init__(self) -> None:
        self.due: list[Callable[[], None]] = []

    def before_io_wait(self, timeout: float) -> None:
        if not self.due:
            return
        due, self.due = self.due, []
        for callback in due:
            try:
                callback()
            except Exception:  # trio would remove the instrument: never let one out
                log.exception("round-end callback failed")


_INSTRUMENT: trio.lowlevel.RunVar[_RoundEnd] = trio.lowlevel.RunVar("iopd_round_end")


def call_at_round_end(callback: Callable[[], None]) -> None:
    """Call ``callback()`` once, when the current round's tasks have run.

    From a task of a trio run (the instrument is added to that run on first
    use).  Callbacks run in the order they were registered.
    """
    try:
        instrument = _INSTRUMENT.get()
    except LookupError:
        instrument = _RoundEnd()
        trio.lowlevel.add_instrument(instrument)
        _INSTRUMENT.set(instrument)
    instrument.due.append(callback)
