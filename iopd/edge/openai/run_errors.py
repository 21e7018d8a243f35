"""What a node's error code means to the edge: one table.

A provider's failure crosses the wire as one word (``wire.messages.ErrorCode``:
the node's adapters choose it from the OS error or the provider's answer).
The edge reads that word in three ways -- how far the attempt got, which
decides whether the request may go to another provider (an
``AttemptFailure``, which ``retry_rules.classify_failure`` turns into a
verdict), the caller's ``GatewayError``, and for a few codes a fixed message
-- and all three are the code's row of ``CODES``.

How far the attempt got depends on where the error came: a normalized run's
error before its first event, or after one; a tunnel's error before the
provider's head went out to the caller, or after.  So each row has the four.
``provider_unreachable`` and ``provider_reset`` never reached the provider
(retried before any output), ``provider_timeout`` waited after sending,
``provider_saturated`` is the provider's 429 to a run (its ``Retry-After``
in the event's ``metadata``: the provider rests, no failure is counted),
``node_busy`` is the edge's own word for a node's ``Busy`` (nothing ran: the
request leases again); any other failure of a run before its first event is
safe to retry, unless a ``cli`` process had started, and after one it never
is.  ``cancelled`` says nothing about the provider.

A code this edge does not know (from a node of another version) reads as
``provider_error`` (:func:`known_code`).  A node lost under a stream is not a
code: its stream raises ``NodeDispatchError`` at its next read
(``iopd/edge/nodes/node_session.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

from iopd import errors
from iopd.edge.pool.outliers import saturation_seconds
from iopd.edge.pool.retry_rules import AttemptFailure, FailureKind
from iopd.vocabulary import ERROR_CODES, NEVER_REACHED, ErrorCode
from wire.messages import RunEvent

__all__ = [
    "CODES",
    "CodeRow",
    "known_code",
    "provider_error",
    "run_error",
    "run_failure",
    "run_retry_after",
    "tunnel_failure",
]

@dataclass(frozen=True, slots=True)
class CodeRow:
    """What one error code means.

    ``run_before``/``run_after``: a normalized run's error before its first
    event / after one (None: it says nothing about the provider, no verdict).
    ``tunnel_before``/``tunnel_after``: a tunnel's error frame before the head
    went out / after.  ``caller``: the caller's error; ``message``: the
    caller's message whatever the node said (None: the node's).
    """

    run_before: AttemptFailure | None
    run_after: AttemptFailure | None
    tunnel_before: AttemptFailure
    tunnel_after: AttemptFailure
    caller: type[errors.GatewayError]
    message: str | None = None


def _kind(kind: FailureKind) -> AttemptFailure:
    return AttemptFailure(kind)


def _status(status: int) -> AttemptFailure:
    return AttemptFailure(FailureKind.PROVIDER_STATUS, status)


_RESET_AFTER = _kind(FailureKind.RESET_AFTER_SEND)
_AFTER_EVENT = _kind(FailureKind.RUN_ERROR_AFTER_EVENT)
_TIMEOUT = _kind(FailureKind.READ_TIMEOUT)
_BUSY = _kind(FailureKind.NODE_BUSY)

#: One row per code.  The caller's message for a provider never reached is
#: fixed (``NEVER_REACHED``): a node's own text for these may name the
#: provider's address (an older node's did), which the caller must not learn;
#: the node's log keeps it.
CODES: Final[dict[ErrorCode, CodeRow]] = {
    "provider_error": CodeRow(
        _kind(FailureKind.RUN_ERROR_BEFORE_EVENT),
        _AFTER_EVENT,
        _RESET_AFTER,
        _RESET_AFTER,
        errors.ProviderError,
    ),
    "provider_timeout": CodeRow(_TIMEOUT, _TIMEOUT, _TIMEOUT, _TIMEOUT, errors.ProviderTimeout),
    # The node cannot run it (an unknown provider, a part it cannot take): the caller's 400.
    "bad_request": CodeRow(
        _status(400), _status(400), _status(400), _status(400), errors.InvalidRequest
    ),
    "provider_unreachable": CodeRow(
        _kind(FailureKind.CONNECT_FAILED),
        _AFTER_EVENT,
        _kind(FailureKind.CONNECT_FAILED),
        _RESET_AFTER,
        errors.ProviderError,
        NEVER_REACHED["provider_unreachable"],
    ),
    "provider_reset": CodeRow(
        _kind(FailureKind.RESET_BEFORE_SEND),
        _AFTER_EVENT,
        _kind(FailureKind.RESET_BEFORE_SEND),
        _RESET_AFTER,
        errors.ProviderError,
        NEVER_REACHED["provider_reset"],
    ),
    # The provider's 429 to a run: it did not take it.  (A tunnel relays a 429 as its head.)
    "provider_saturated": CodeRow(
        _status(429), _status(429), _RESET_AFTER, _RESET_AFTER, errors.ProviderError
    ),
    # Not admitted by the node: nothing ran (see Leasing.failed).
    "node_busy": CodeRow(_BUSY, _BUSY, _BUSY, _BUSY, errors.ProviderError),
    "cancelled": CodeRow(None, None, _RESET_AFTER, _RESET_AFTER, errors.ProviderError),
}


def known_code(code: str) -> ErrorCode:
    """``code`` as this edge knows it: an unknown one (a node of another
    version) is a ``provider_error``, as an older edge reads a newer code."""
    for known in ERROR_CODES:
        if known == code:
            return known
    return "provider_error"


def run_failure(ev: RunEvent, provider_type: str, produced: bool) -> AttemptFailure | None:
    """What a run's error event says about the provider (None: nothing, as
    for a cancel).  ``produced``: the request had an event already."""
    row = CODES[known_code(ev.code)]
    if produced:
        return row.run_after
    failure = row.run_before
    if (
        provider_type == "cli"
        and failure is not None
        and failure.kind is FailureKind.RUN_ERROR_BEFORE_EVENT
    ):
        return _kind(FailureKind.CLI_PROCESS_STARTED)  # its process started: it may have acted
    return failure


def tunnel_failure(code: str, head_sent: bool) -> AttemptFailure:
    """What a tunnel's error frame says happened; anything the node does not
    name (or anything after the head) is a failure after the provider had the
    request."""
    row = CODES[known_code(code)]
    return row.tunnel_after if head_sent else row.tunnel_before


def run_retry_after(ev: RunEvent) -> float:
    """Seconds a ``provider_saturated`` run asks the provider to rest (bounded)."""
    return saturation_seconds(ev.metadata.get("retry_after"), wall_now=time.time())


def provider_error(code: str, message: str) -> errors.GatewayError:
    """The caller's error for a node's error ``code`` (a run's or a tunnel's)."""
    row = CODES[known_code(code)]
    return row.caller(row.message or message or "the provider failed")


def run_error(ev: RunEvent) -> errors.GatewayError:
    """The caller's error for a run that ended with ``ev``."""
    return provider_error(ev.code, ev.message)
