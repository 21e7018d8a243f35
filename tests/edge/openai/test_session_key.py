"""The request's session key (``incoming/session_key.py``): order, bounds, digests."""

from __future__ import annotations

from iopd.edge.openai.incoming.session_key import (
    MAX_SESSION_KEY_CHARS,
    session_digest,
    session_key,
)


def test_agent_headers_come_before_the_body() -> None:
    body = {"prompt_cache_key": "cache-1", "user": "u"}
    assert session_key([("session_id", "0199-abc")], body) == "0199-abc"
    assert session_key([("x-session-id", "oc-1")], body) == "oc-1"
    assert session_key([("x-claude-code-session-id", "cc-1")], None) == "cc-1"
    assert session_key([("originator", "codex_cli_rs")], body) == "cache-1"
    assert session_key([], {"user": "u", "safety_identifier": "s"}) == "u"
    assert (
        session_key([], {"metadata": {"user_id": "anthropic-user"}, "user": "u"})
        == "anthropic-user"
    )
    assert session_key([("user-agent", "x")], {"model": "m"}) is None
    assert session_key([], None) is None


def test_the_operator_header_comes_first() -> None:
    headers = [("session_id", "codex"), ("x-team-session", "team-7")]
    assert session_key(headers, None, header="X-Team-Session") == "team-7"
    assert session_key(headers, None) == "codex"
    assert session_key([("x-team-session", "  ")], {"user": "u"}, header="x-team-session") == "u"


def test_long_or_odd_values_are_digested_whole() -> None:
    long = "a" * 5000
    key = session_key([("session_id", long)], None)
    assert key is not None and key.startswith("sha256:") and len(key) <= MAX_SESSION_KEY_CHARS
    assert key != session_key([("session_id", long + "b")], None)  # no cut prefix joins them
    spaced = session_key([], {"user": "jane doe@example.com"})
    assert spaced is not None and spaced.startswith("sha256:") and "jane" not in spaced
    assert session_key([], {"user": 12}) is None


def test_the_log_shows_a_digest() -> None:
    assert session_digest(None) == "-"
    shown = session_digest("0199-abc")
    assert len(shown) == 12 and "0199" not in shown
