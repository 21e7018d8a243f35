"""The error map: every wire error code, its retry verdict at each point of a
request, and the caller's error; a code this edge does not know."""

from __future__ import annotations

import msgspec
import pytest

from iopd import errors
from iopd.edge.openai.run_errors import (
    CODES,
    known_code,
    provider_error,
    run_error,
    run_failure,
    tunnel_failure,
)
from iopd.edge.pool.retry_rules import AttemptFailure, TrackerEffect, classify_failure
from iopd.vocabulary import ERROR_CODES
from wire.framing import FrameDecoder, encode_frame
from wire.messages import Message, ProviderTunnelFrame, RunEvent


def _retry(failure: AttemptFailure | None) -> bool | None:
    """The verdict's ``retry`` before any byte reached the caller (None: no verdict)."""
    if failure is None:
        return None
    return classify_failure(failure, caller_saw_bytes=False).retry


def _event(code: str, message: str = "node text") -> RunEvent:
    return RunEvent(stream_id=1, kind="error", code=code, message=message)


def test_every_code_has_one_row() -> None:
    assert set(CODES) == ERROR_CODES


#: code: (retried: run before its first event, run after one, tunnel before
#: its head, tunnel after it), the caller's error class and HTTP status.
EXPECTED: dict[str, tuple[tuple[bool | None, ...], type[errors.GatewayError], int]] = {
    "provider_error": ((True, False, False, False), errors.ProviderError, 502),
    "provider_timeout": ((False, False, False, False), errors.ProviderTimeout, 504),
    "bad_request": ((False, False, False, False), errors.InvalidRequest, 400),
    "provider_unreachable": ((True, False, True, False), errors.ProviderError, 502),
    "provider_reset": ((True, False, True, False), errors.ProviderError, 502),
    "provider_saturated": ((True, True, False, False), errors.ProviderError, 502),
    "node_busy": ((True, True, True, True), errors.ProviderError, 502),
    "cancelled": ((None, None, False, False), errors.ProviderError, 502),
}


def test_the_expectations_name_every_code() -> None:
    assert set(EXPECTED) == ERROR_CODES


@pytest.mark.parametrize("code", sorted(EXPECTED))
def test_each_rows_verdicts_and_caller_error(code: str) -> None:
    retried, caller, status = EXPECTED[code]
    ev = _event(code)
    got = (
        _retry(run_failure(ev, "ollama", produced=False)),
        _retry(run_failure(ev, "ollama", produced=True)),
        _retry(tunnel_failure(code, head_sent=False)),
        _retry(tunnel_failure(code, head_sent=True)),
    )
    assert got == retried
    error = run_error(ev)
    assert type(error) is caller and error.status == status
    assert type(provider_error(code, "x")) is caller


def test_saturation_and_caller_400_are_statuses() -> None:
    saturated = run_failure(_event("provider_saturated"), "ollama", False)
    assert saturated is not None and saturated.status == 429
    verdict = classify_failure(saturated, caller_saw_bytes=False)
    assert verdict.effect is TrackerEffect.SATURATED
    bad = tunnel_failure("bad_request", head_sent=False)
    assert bad.status == 400
    assert classify_failure(bad, caller_saw_bytes=False).effect is TrackerEffect.SUCCESS


def test_a_cli_run_failing_before_any_event_may_have_acted() -> None:
    failure = run_failure(_event("provider_error"), "cli", produced=False)
    assert failure is not None and not _retry(failure)
    # ...but a cli process that never started is safe to retry.
    assert _retry(run_failure(_event("provider_unreachable"), "cli", produced=False))


def test_a_provider_never_reached_gets_a_fixed_message() -> None:
    # A node's own text for these may name the provider's address.
    for code in ("provider_unreachable", "provider_reset"):
        message = run_error(_event(code, "connect to 10.0.0.7:8000 failed")).message
        assert "10.0.0.7" not in message and message
    assert run_error(_event("provider_error", "it broke")).message == "it broke"
    assert run_error(_event("provider_error", "")).message == "the provider failed"


@pytest.mark.parametrize("code", ["from_a_newer_node", "node_lost", "node_dispatch_error", ""])
def test_an_unknown_code_reads_as_provider_error(code: str) -> None:
    assert known_code(code) == "provider_error"
    ev = _event(code)
    assert run_failure(ev, "ollama", False) == run_failure(_event("provider_error"), "ollama", False)
    assert tunnel_failure(code, False) == tunnel_failure("provider_error", False)
    error = run_error(ev)
    assert type(error) is errors.ProviderError and error.message == "node text"


def test_an_unknown_code_crosses_the_wire() -> None:
    """The ``code`` fields stay ``str`` on the wire: a frame of a node that
    knows a code this edge does not still decodes, with its code as sent."""
    for msg in (
        _event("from_a_newer_node"),
        ProviderTunnelFrame(stream_id=1, kind="error", code="from_a_newer_node"),
    ):
        decoder = FrameDecoder()
        decoded: list[Message] = decoder.feed(encode_frame(msg))
        assert decoded == [msg]
    # And the bytes of a known code are the string's bytes (a Literal on our side only).
    raw = msgspec.msgpack.encode(_event("provider_timeout"))
    assert b"provider_timeout" in raw
