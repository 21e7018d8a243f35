"""What a normalized run's ``error`` event means: to the caller, and to the attempt loop.

Two readings of one ``RunEvent(kind="error")``: :func:`run_error` is the
``GatewayError`` the caller gets, and :func:`run_failure` is how far the
run got (``retry_rules.FailureKind``), which decides whether the request may
go to another provider.  The node's error code says how far:
``provider_unreachable`` and ``provider_reset`` never reached the provider,
``provider_timeout`` waited after sending, ``provider_saturated`` is the
provider's 429 (its ``Retry-After`` in the event's ``metadata``: the
provider rests, no failure is counted); any other failure before the
run's first event is a run error before any event (safe to retry, unless a
``cli`` process had started), and after one it never is.
"""

from __future__ import annotations

import time

from iopd import errors
from iopd.edge.nodes.node_session import NODE_BUSY
from iopd.edge.pool.outliers import saturation_seconds
from iopd.edge.pool.retry_rules import AttemptFailure, FailureKind
from wire.messages import RunEvent

__all__ = ["provider_error", "run_error", "run_failure", "run_retry_after"]

#: Run error codes that say how far the run got before any event.
_RUN_CODE_FAILURES: dict[str, FailureKind] = {
    "provider_unreachable": FailureKind.CONNECT_FAILED,
    "provider_reset": FailureKind.RESET_BEFORE_SEND,
    "provider_timeout": FailureKind.READ_TIMEOUT,
}


def run_failure(ev: RunEvent, provider_type: str, produced: bool) -> AttemptFailure | None:
    """What a run's error event says about the provider (None: nothing -- a cancel,
    or its node went away).  ``produced``: the request had an event already."""
    code = ev.code
    if code in ("cancelled", "node_lost", "node_dispatch_error"):
        return None
    if code == NODE_BUSY:  # not admitted: nothing ran (see Leasing.failed)
        return AttemptFailure(FailureKind.NODE_BUSY)
    if code == "bad_request":
        return AttemptFailure(FailureKind.PROVIDER_STATUS, 400)
    if code == "provider_timeout":
        return AttemptFailure(FailureKind.READ_TIMEOUT)
    if code == "provider_saturated":  # the provider's 429: it did not take the run
        return AttemptFailure(FailureKind.PROVIDER_STATUS, 429)
    if produced:
        return AttemptFailure(FailureKind.RUN_ERROR_AFTER_EVENT)
    kind = _RUN_CODE_FAILURES.get(code)
    if kind is not None:
        return AttemptFailure(kind)
    if provider_type == "cli":  # its process started: it may have acted
        return AttemptFailure(FailureKind.CLI_PROCESS_STARTED)
    return AttemptFailure(FailureKind.RUN_ERROR_BEFORE_EVENT)


def run_retry_after(ev: RunEvent) -> float:
    """Seconds a ``provider_saturated`` run asks the provider to rest (bounded)."""
    return saturation_seconds(ev.metadata.get("retry_after"), wall_now=time.time())


#: The caller's message for a provider never reached, whatever the node said:
#: a node's own text for these may name the provider's address (an older
#: node's did), which the caller must not learn; the node's log keeps it.
_NEVER_REACHED: dict[str, str] = {
    "provider_unreachable": "the provider could not be reached",
    "provider_reset": "the connection to the provider broke while the request was sent",
}


def provider_error(code: str, message: str) -> errors.GatewayError:
    """The caller's error for a node's error ``code`` (a run's or a tunnel's)."""
    msg = _NEVER_REACHED.get(code) or message or "the provider failed"
    if code == "provider_timeout":
        return errors.ProviderTimeout(msg)
    if code == "bad_request":
        return errors.InvalidRequest(msg)
    return errors.ProviderError(msg)


def run_error(ev: RunEvent) -> errors.GatewayError:
    """The caller's error for a run that ended with ``ev``."""
    if ev.code in ("node_lost", "node_dispatch_error"):
        return errors.NodeDispatchError(ev.message or "the provider failed")
    return provider_error(ev.code, ev.message)
