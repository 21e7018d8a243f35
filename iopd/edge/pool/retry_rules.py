"""Whether a failed attempt may be retried on another provider, as pure data.

Why a table: a retry is only safe when the failed attempt cannot have had an
effect the caller would see twice -- the provider never got the request, or
said so itself (429, 502, 503), or a normalized run failed before producing
anything.  The rules are a small fixed table from the *kind* of failure, so
they are written as one (``_RULES``), and everything that can veto a retry
(bytes already sent to the caller, a caller's provider key that must not
travel to another origin, a timeout without ``retry_on_timeout``) is checked
in one function, ``classify_failure``.  The edge's request path only has to
name what happened (a ``FailureKind``, plus the HTTP status for
``PROVIDER_STATUS``) and act on the ``Verdict``: retry or not, the metric
reason, and what the outlier tracker should record.

Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit

__all__ = [
    "CALLER_STATUSES",
    "RETRYABLE_STATUSES",
    "AttemptFailure",
    "FailureKind",
    "FailureReason",
    "NoRetry",
    "RetryPolicy",
    "TrackerEffect",
    "Verdict",
    "classify_failure",
    "url_origin",
]


class FailureReason(enum.Enum):
    """The ``reason`` label of ``iop_provider_attempt_failures_total`` (a fixed set)."""

    CONNECT = "connect"
    RESET = "reset"
    TIMEOUT = "timeout"
    STATUS_5XX = "status_5xx"
    STATUS_429 = "status_429"
    RUN_ERROR = "run_error"


class FailureKind(enum.Enum):
    """What went wrong with one attempt, as the request path observed it.

    The names say at which point it failed, because that decides whether the
    provider can have acted on the request.
    """

    #: The node or the provider could not be reached, or refused the connection.
    CONNECT_FAILED = "connect_failed"
    #: The connection was reset before any byte of the request reached the provider.
    RESET_BEFORE_SEND = "reset_before_send"
    #: The connection was reset after the request (or part of it) was sent.
    RESET_AFTER_SEND = "reset_after_send"
    #: The node's session was lost before the run started on it.
    NODE_LOST_BEFORE_RUN = "node_lost_before_run"
    #: The provider answered with an HTTP error status (``AttemptFailure.status``).
    PROVIDER_STATUS = "provider_status"
    #: The provider sent nothing for ``read_timeout`` after the request was sent.
    READ_TIMEOUT = "read_timeout"
    #: A normalized run (ollama, echo) failed with a provider error before any event.
    RUN_ERROR_BEFORE_EVENT = "run_error_before_event"
    #: A normalized run failed after it had produced an event.
    RUN_ERROR_AFTER_EVENT = "run_error_after_event"
    #: A ``cli`` run failed after its process had started (it may have acted).
    CLI_PROCESS_STARTED = "cli_process_started"
    #: The node did not admit the stream (the provider is full across edges):
    #: nothing ran; the request leases again, which is no retry and no failure.
    NODE_BUSY = "node_busy"


#: Provider statuses that say "not done, try elsewhere": retried.
RETRYABLE_STATUSES: frozenset[int] = frozenset({429, 502, 503})
#: The caller's own mistakes, relayed as they are (any other 4xx is treated the same).
CALLER_STATUSES: frozenset[int] = frozenset({400, 401, 404, 413, 422})


class TrackerEffect(enum.Enum):
    """What the outlier tracker should record for an attempt that ended this way."""

    FAILURE = "failure"  # counts toward ejection
    SATURATED = "saturated"  # a 429: not chosen for its Retry-After, not a failure
    SUCCESS = "success"  # the provider worked (a caller's 4xx); resets the count
    NONE = "none"  # says nothing about the provider (its node went away)
    #: A 429 or 5xx answered to the caller's own provider credential: about that
    #: key, not the provider; relayed to the caller, nobody else's routing changes.
    CALLER_CREDENTIALED = "caller_credentialed"


class NoRetry(enum.Enum):
    """Why a failed attempt is not retried (for the log line)."""

    UNSAFE = "unsafe"  # the provider may have acted on the request
    CALLER_ERROR = "caller_error"  # a 4xx of the caller's own: relayed
    TIMEOUT = "timeout"  # a read timeout, and provider_pool.retry_on_timeout is off
    BYTES_SENT = "bytes_sent"  # a byte already reached the caller
    PROVIDER_AUTH = "provider_auth"  # the caller's provider key may not go to another origin
    #: A 429 to the caller's own key: every provider of its origin shares that key's limit.
    CALLER_CREDENTIAL = "caller_credential"


class _Rule(NamedTuple):
    safe: bool
    reason: FailureReason | None
    effect: TrackerEffect


#: Every failure kind but PROVIDER_STATUS (which depends on the status): the table of
#: docs/operations.md, "Retry before the first byte".
_RULES: dict[FailureKind, _Rule] = {
    FailureKind.CONNECT_FAILED: _Rule(True, FailureReason.CONNECT, TrackerEffect.FAILURE),
    FailureKind.RESET_BEFORE_SEND: _Rule(True, FailureReason.RESET, TrackerEffect.FAILURE),
    FailureKind.RESET_AFTER_SEND: _Rule(False, FailureReason.RESET, TrackerEffect.FAILURE),
    FailureKind.NODE_LOST_BEFORE_RUN: _Rule(True, FailureReason.CONNECT, TrackerEffect.NONE),
    FailureKind.READ_TIMEOUT: _Rule(False, FailureReason.TIMEOUT, TrackerEffect.FAILURE),
    FailureKind.RUN_ERROR_BEFORE_EVENT: _Rule(True, FailureReason.RUN_ERROR, TrackerEffect.FAILURE),
    FailureKind.RUN_ERROR_AFTER_EVENT: _Rule(False, FailureReason.RUN_ERROR, TrackerEffect.FAILURE),
    FailureKind.CLI_PROCESS_STARTED: _Rule(False, FailureReason.RUN_ERROR, TrackerEffect.FAILURE),
    FailureKind.NODE_BUSY: _Rule(True, None, TrackerEffect.NONE),
}


def _status_rule(status: int) -> _Rule:
    if status == 429:
        return _Rule(True, FailureReason.STATUS_429, TrackerEffect.SATURATED)
    if status in RETRYABLE_STATUSES:
        return _Rule(True, FailureReason.STATUS_5XX, TrackerEffect.FAILURE)
    if status >= 500:
        return _Rule(False, FailureReason.STATUS_5XX, TrackerEffect.FAILURE)
    return _Rule(False, None, TrackerEffect.SUCCESS)  # the caller's 4xx


@dataclass(frozen=True, slots=True)
class AttemptFailure:
    """One failed attempt: its kind, and the provider's status for ``PROVIDER_STATUS``."""

    kind: FailureKind
    status: int | None = None

    def __post_init__(self) -> None:
        if self.kind is FailureKind.PROVIDER_STATUS:
            if self.status is None or not 400 <= self.status <= 599:
                raise ValueError(
                    f"PROVIDER_STATUS needs an error status 400..599, got {self.status}"
                )
        elif self.status is not None:
            raise ValueError(f"{self.kind.name} carries no status")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do about one failed attempt.

    ``reason`` is the metric label (None for a caller's 4xx, which is not a
    provider failure); ``effect`` is what the outlier tracker records, whether
    or not the attempt is retried; ``no_retry`` says why not when ``retry``
    is False.
    """

    retry: bool
    reason: FailureReason | None
    effect: TrackerEffect
    no_retry: NoRetry | None = None


def classify_failure(
    failure: AttemptFailure,
    *,
    caller_saw_bytes: bool,
    retry_on_timeout: bool = False,
    carries_provider_auth: bool = False,
    next_origin_differs: bool = False,
    caller_credentialed: bool = False,
) -> Verdict:
    """The retry decision for one failed attempt (attempt count and budget aside).

    ``caller_saw_bytes``: any byte of the response (head included) reached
    the caller.  ``carries_provider_auth``: the request carries the caller's
    own provider key (``openai.provider_auth.header``);
    ``next_origin_differs``: the candidate a retry would go to has another
    ``base_url`` origin than the provider that failed (see ``url_origin``).
    ``caller_credentialed``: this attempt took the caller's own provider
    credential to the provider; an error status it got back (429, 5xx) is
    then about that key and only this request's (``CALLER_CREDENTIALED``: no
    saturation, no failure count), and a 429 is not retried (the same key's
    limit holds at every provider it may go to).  Failures before any answer
    (connect, reset, timeout) stay the provider's own.
    Whether an attempt is left (``RetryPolicy``) and the group's budget
    allows one (``RetryBudget``) is for the caller to check after this.
    """
    rule = (
        _status_rule(failure.status)
        if failure.kind is FailureKind.PROVIDER_STATUS and failure.status is not None
        else _RULES[failure.kind]
    )
    effect = rule.effect
    credential_429 = False
    if (
        caller_credentialed
        and failure.kind is FailureKind.PROVIDER_STATUS
        and effect in (TrackerEffect.FAILURE, TrackerEffect.SATURATED)
    ):
        credential_429 = effect is TrackerEffect.SATURATED
        effect = TrackerEffect.CALLER_CREDENTIALED
    no_retry: NoRetry | None = None
    if caller_saw_bytes:
        no_retry = NoRetry.BYTES_SENT
    elif failure.kind is FailureKind.READ_TIMEOUT:
        no_retry = None if retry_on_timeout else NoRetry.TIMEOUT
    elif rule.effect is TrackerEffect.SUCCESS:
        no_retry = NoRetry.CALLER_ERROR
    elif not rule.safe:
        no_retry = NoRetry.UNSAFE
    elif credential_429:
        no_retry = NoRetry.CALLER_CREDENTIAL
    if no_retry is None and carries_provider_auth and next_origin_differs:
        no_retry = NoRetry.PROVIDER_AUTH
    return Verdict(no_retry is None, rule.reason, effect, no_retry)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``provider_pool.retry_attempts`` and ``retry_on_timeout``, as the request path reads them."""

    attempts: int = 2  # extra attempts after the first; 0 disables retries
    on_timeout: bool = False

    def attempt_left(self, retries_done: int) -> bool:
        """True when a request that was retried ``retries_done`` times may be retried again."""
        return retries_done < self.attempts


_DEFAULT_PORTS = {"http": 80, "https": 443}


def url_origin(url: str) -> str:
    """The origin of a provider's ``base_url``: ``scheme://host:port``, lowercased.

    Default ports are written out, so ``https://api.x`` and ``https://api.x:443``
    are one origin.  A caller's provider key may only be retried to a provider
    with the same origin as the one it was first sent to.  Raises
    ``ValueError`` for a URL without a scheme or host (config validation
    refuses those for ``openai`` and ``ollama`` providers).
    """
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if not scheme or not host:
        raise ValueError("not an absolute URL")
    port = parts.port if parts.port is not None else _DEFAULT_PORTS.get(scheme)
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}" + (f":{port}" if port is not None else "")
