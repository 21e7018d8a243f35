"""CI-sized HTTP fuzzing of a real edge (``scripts/fuzz_http.py`` with a fixed seed).

200 malformed or mutated requests (random bytes, byte mutations of valid
requests, broken chunked bodies, absurd headers, odd request lines, hostile
JSON) against an in-process edge + echo node on loopback: every reply is
HTTP below 500, every 4xx is an OpenAI envelope, nothing hangs and no log
record carries a traceback.  The checker itself is tested first, so a broken
checker cannot make the fuzz pass vacuously.
"""

from __future__ import annotations

import json

import pytest
import trio

from tests.support.paths import load_script

SEED = 20261129

fuzz_http = load_script("fuzz_http")


def _response(status: int, body: bytes) -> bytes:
    return f"HTTP/1.1 {status} X\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


def test_checker_accepts_envelopes_and_closed_connections() -> None:
    envelope = json.dumps(
        {"error": {"message": "m", "type": "invalid_request_error", "code": "x", "param": None}}
    ).encode()
    assert fuzz_http.check_response(_response(400, envelope), False) == ("400", None)
    assert fuzz_http.check_response(b"", False) == ("closed", None)
    assert fuzz_http.check_response(_response(200, b"{}"), False) == ("200", None)


def test_checker_allows_501_and_checks_refusals() -> None:
    envelope = json.dumps(
        {"error": {"message": "m", "type": "invalid_request_error", "code": "x", "param": None}}
    ).encode()
    assert fuzz_http.check_response(_response(501, envelope), False) == ("501", None)
    assert fuzz_http.check_refused(_response(400, envelope)) is None
    # a smuggled request answered, or no refusal at all
    assert fuzz_http.check_refused(_response(400, envelope) + _response(200, b"{}")) is not None
    assert fuzz_http.check_refused(_response(200, b"{}")) is not None


def test_checker_flags_5xx_bare_4xx_tracebacks_and_non_http() -> None:
    assert fuzz_http.check_response(_response(500, b"{}"), False)[1] is not None
    assert fuzz_http.check_response(_response(400, b"bad request"), False)[1] is not None
    assert fuzz_http.check_response(_response(400, b"Traceback (most"), False)[1] is not None
    assert fuzz_http.check_response(b"garbage", False)[1] is not None
    # A later 5xx on a pipelined connection counts too.
    ok = _response(200, b"{}")
    assert fuzz_http.check_response(ok + _response(502, b"{}"), False)[1] is not None


def test_cases_are_deterministic_and_cover_every_family() -> None:
    import random

    a = [fuzz_http.make_case(random.Random(SEED)) for _ in range(1)]
    b = [fuzz_http.make_case(random.Random(SEED)) for _ in range(1)]
    assert a == b
    rng = random.Random(SEED)
    families = {fuzz_http.make_case(rng)[0] for _ in range(200)}
    assert families == {
        "random", "mutated", "chunked", "headers", "line", "json", "framing", "limits"
    }


async def test_deeply_nested_json_is_a_400_envelope_not_a_500(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: ``[[[[...]]]]`` made the JSON decoder raise RecursionError → 500."""
    deep = b"[" * 30000 + b"]" * 30000  # under max_body_bytes
    with trio.fail_after(30):
        report_raw: list[bytes] = []

        async def probe(addr: tuple[str, int], n: int, seed: int, **_: object) -> object:
            for target in ("/v1/chat/completions", "/v1/responses", "/api/chat"):
                payload = fuzz_http._req("POST", target, deep)
                report_raw.append(await fuzz_http.run_case(addr, payload))
            return fuzz_http.FuzzReport()

        monkeypatch.setattr(fuzz_http, "fuzz_edge", probe)
        report = await fuzz_http.fuzz_in_process_edge(1, SEED)
    assert report.logged_errors == []
    for raw, ollama in zip(report_raw, (False, False, True), strict=True):
        assert raw.startswith(b"HTTP/1.1 400 ")
        assert fuzz_http.check_response(raw, False, ollama) == ("400", None)


async def test_200_fuzzed_requests_get_4xx_envelopes_or_a_close_never_5xx() -> None:
    with trio.fail_after(120):
        report = await fuzz_http.fuzz_in_process_edge(200, SEED)
    assert report.cases == 200
    assert sum(report.outcomes.values()) == 200
    assert report.violations == []
    assert report.logged_errors == []
    # The run exercised more than one kind of answer.
    assert report.outcomes["400"] > 0 and report.outcomes["404"] > 0
    assert report.families["framing"] > 0 and report.families["limits"] > 0
