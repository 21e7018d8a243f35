"""The retry classifier: its table, every veto, metric reasons, origins.

The table: docs/operations.md, "Retry before the first byte".
"""

from __future__ import annotations

import itertools

import pytest

from iopd.edge.pool.retry_rules import (
    CALLER_STATUSES,
    AttemptFailure,
    FailureKind,
    FailureReason,
    NoRetry,
    RetryPolicy,
    TrackerEffect,
    Verdict,
    classify_failure,
    url_origin,
)

K = FailureKind
R = FailureReason
E = TrackerEffect

#: (failure, safe to retry, metric reason, tracker effect): that table, written out.
TABLE: list[tuple[AttemptFailure, bool, FailureReason | None, TrackerEffect]] = [
    (AttemptFailure(K.CONNECT_FAILED), True, R.CONNECT, E.FAILURE),
    (AttemptFailure(K.RESET_BEFORE_SEND), True, R.RESET, E.FAILURE),
    (AttemptFailure(K.NODE_LOST_BEFORE_RUN), True, R.CONNECT, E.NONE),
    (AttemptFailure(K.NODE_BUSY), True, None, E.NONE),  # not a failure (Leasing.failed)
    (AttemptFailure(K.PROVIDER_STATUS, 429), True, R.STATUS_429, E.SATURATED),
    (AttemptFailure(K.PROVIDER_STATUS, 502), True, R.STATUS_5XX, E.FAILURE),
    (AttemptFailure(K.PROVIDER_STATUS, 503), True, R.STATUS_5XX, E.FAILURE),
    (AttemptFailure(K.RUN_ERROR_BEFORE_EVENT), True, R.RUN_ERROR, E.FAILURE),
    (AttemptFailure(K.PROVIDER_STATUS, 500), False, R.STATUS_5XX, E.FAILURE),
    (AttemptFailure(K.PROVIDER_STATUS, 504), False, R.STATUS_5XX, E.FAILURE),
    (AttemptFailure(K.PROVIDER_STATUS, 599), False, R.STATUS_5XX, E.FAILURE),
    (AttemptFailure(K.RESET_AFTER_SEND), False, R.RESET, E.FAILURE),
    (AttemptFailure(K.RUN_ERROR_AFTER_EVENT), False, R.RUN_ERROR, E.FAILURE),
    (AttemptFailure(K.CLI_PROCESS_STARTED), False, R.RUN_ERROR, E.FAILURE),
    *[
        (AttemptFailure(K.PROVIDER_STATUS, s), False, None, E.SUCCESS)
        for s in (*sorted(CALLER_STATUSES), 403, 409, 499)
    ],
]


def test_table_covers_every_kind() -> None:
    assert {f.kind for f, *_ in TABLE} | {K.READ_TIMEOUT} == set(FailureKind)


@pytest.mark.parametrize(("failure", "safe", "reason", "effect"), TABLE, ids=str)
def test_table(
    failure: AttemptFailure, safe: bool, reason: FailureReason | None, effect: TrackerEffect
) -> None:
    for on_timeout in (False, True):  # retry_on_timeout only concerns timeouts
        v = classify_failure(failure, caller_saw_bytes=False, retry_on_timeout=on_timeout)
        assert (v.retry, v.reason, v.effect) == (safe, reason, effect)
        if not safe:
            expected = NoRetry.CALLER_ERROR if effect is E.SUCCESS else NoRetry.UNSAFE
            assert v.no_retry is expected
        else:
            assert v.no_retry is None


def test_read_timeout_retried_only_when_enabled() -> None:
    timeout = AttemptFailure(K.READ_TIMEOUT)
    assert classify_failure(timeout, caller_saw_bytes=False) == Verdict(
        False, R.TIMEOUT, E.FAILURE, NoRetry.TIMEOUT
    )
    assert classify_failure(timeout, caller_saw_bytes=False, retry_on_timeout=True) == Verdict(
        True, R.TIMEOUT, E.FAILURE
    )


ALL_FAILURES = [f for f, *_ in TABLE] + [AttemptFailure(K.READ_TIMEOUT)]


@pytest.mark.parametrize("failure", ALL_FAILURES, ids=str)
def test_a_byte_to_the_caller_vetoes_every_retry(failure: AttemptFailure) -> None:
    for on_timeout, auth, differs in itertools.product((False, True), repeat=3):
        v = classify_failure(
            failure,
            caller_saw_bytes=True,
            retry_on_timeout=on_timeout,
            carries_provider_auth=auth,
            next_origin_differs=differs,
        )
        assert not v.retry and v.no_retry is NoRetry.BYTES_SENT
        # The metric and the tracker still hear about it.
        clean = classify_failure(failure, caller_saw_bytes=False, retry_on_timeout=on_timeout)
        assert (v.reason, v.effect) == (clean.reason, clean.effect)


@pytest.mark.parametrize("failure", ALL_FAILURES, ids=str)
def test_provider_auth_never_goes_to_another_origin(failure: AttemptFailure) -> None:
    base = classify_failure(failure, caller_saw_bytes=False, retry_on_timeout=True)
    for auth, differs in itertools.product((False, True), repeat=2):
        v = classify_failure(
            failure,
            caller_saw_bytes=False,
            retry_on_timeout=True,
            carries_provider_auth=auth,
            next_origin_differs=differs,
        )
        if auth and differs and base.retry:
            assert not v.retry and v.no_retry is NoRetry.PROVIDER_AUTH
        else:
            assert v == base  # same origin, or no caller key: nothing changes


@pytest.mark.parametrize(("failure", "safe", "reason", "effect"), TABLE, ids=str)
def test_an_answer_to_the_callers_own_credential_marks_the_provider_for_nobody(
    failure: AttemptFailure, safe: bool, reason: FailureReason | None, effect: TrackerEffect
) -> None:
    """The provider's error status on the caller's key is that key's business;
    a failure before any answer (or a caller's 4xx: the provider works) is not."""
    for saw in (False, True):
        plain = classify_failure(failure, caller_saw_bytes=saw, retry_on_timeout=True)
        own = classify_failure(
            failure, caller_saw_bytes=saw, retry_on_timeout=True, caller_credentialed=True
        )
        assert own.reason == plain.reason  # the metric still counts what happened
        answered = failure.kind is K.PROVIDER_STATUS and effect is not E.SUCCESS
        if not answered:
            assert own == plain
            continue
        assert own.effect is E.CALLER_CREDENTIALED
        if failure.status == 429 and not saw:
            # Every provider it may go to shares that key's limit: relayed now.
            assert not own.retry and own.no_retry is NoRetry.CALLER_CREDENTIAL
        else:
            assert (own.retry, own.no_retry) == (plain.retry, plain.no_retry)


def test_a_timeout_on_the_callers_own_credential_is_still_the_providers() -> None:
    for kind in (K.READ_TIMEOUT, K.RESET_AFTER_SEND, K.CONNECT_FAILED):
        v = classify_failure(
            AttemptFailure(kind), caller_saw_bytes=False, caller_credentialed=True
        )
        assert v.effect is E.FAILURE


def test_attempt_failure_checks_its_status() -> None:
    with pytest.raises(ValueError):
        AttemptFailure(K.PROVIDER_STATUS)
    for bad in (200, 302, 399, 600):
        with pytest.raises(ValueError):
            AttemptFailure(K.PROVIDER_STATUS, bad)
    with pytest.raises(ValueError):
        AttemptFailure(K.CONNECT_FAILED, 502)


def test_metric_reasons_are_the_fixed_set() -> None:
    assert {r.value for r in FailureReason} == {
        "connect",
        "reset",
        "timeout",
        "status_5xx",
        "status_429",
        "run_error",
    }


def test_retry_policy_counts_extra_attempts() -> None:
    assert [RetryPolicy(attempts=2).attempt_left(n) for n in range(4)] == [True, True, False, False]
    assert not RetryPolicy(attempts=0).attempt_left(0)


@pytest.mark.parametrize(
    ("url", "origin"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
        ("https://API.Example.com/openai/v1", "https://api.example.com:443"),
        ("https://api.example.com:443", "https://api.example.com:443"),
        ("http://host", "http://host:80"),
        ("http://[::1]:9000/v1", "http://[::1]:9000"),
        ("  http://user:pw@host:81/x  ", "http://host:81"),
    ],
)
def test_url_origin(url: str, origin: str) -> None:
    assert url_origin(url) == origin


def test_origins_compare_as_the_provider_auth_rule_needs() -> None:
    assert url_origin("https://a.example/v1") == url_origin("https://a.example:443/other")
    assert url_origin("https://a.example") != url_origin("http://a.example")
    assert url_origin("https://a.example") != url_origin("https://b.example")
    assert url_origin("https://a.example") != url_origin("https://a.example:8443")


@pytest.mark.parametrize("url", ["", "127.0.0.1:8000", "/v1", "http://"])
def test_url_origin_rejects_relative(url: str) -> None:
    with pytest.raises(ValueError):
        url_origin(url)
