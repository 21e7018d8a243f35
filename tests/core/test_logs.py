"""Log formatting (iopd/logs.py): key=value lines, JSON lines, redaction, setup."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from iopd.logs import JsonFormatter, KeyValueFormatter, redact, setup_logging


def _record(
    msg: str,
    *args: object,
    level: int = logging.INFO,
    name: str = "iopd.edge",
    exc: bool = False,
) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            exc_info = sys.exc_info()
    return logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)


def _json(record: logging.LogRecord) -> dict[str, Any]:
    line = JsonFormatter().format(record)
    assert "\n" not in line  # one event, one line
    doc = json.loads(line)
    assert isinstance(doc, dict)
    return doc


REQUEST_LINE = (
    "event=request request_id=%s principal=%s group=%s provider=%s endpoint=%s "
    "mode=%s status=%s http_status=%d duration_ms=%.1f input_tokens=%d output_tokens=%d"
)
REQUEST_ARGS = ("req_1", "alice", "echo", "echo-a", "chat_completions", "normalized", "ok", 200,
                12.345, 3, 7)  # fmt: skip


# ------------------------------------------------------------------ key=value


def test_keyvalue_prefix_and_message() -> None:
    rec = _record("event=node_connected node=%s", "node-a", level=logging.WARNING)
    line = KeyValueFormatter().format(rec)
    ts, rest = line.split(" ", 1)
    assert ts.startswith("ts=") and ts.endswith("Z")
    assert rest == "level=warning logger=iopd.edge event=node_connected node=node-a"


def test_keyvalue_timestamp_is_utc_with_milliseconds() -> None:
    rec = _record("event=x")
    rec.created = 0.25
    rec.msecs = 250.0
    assert KeyValueFormatter().format(rec).startswith("ts=1970-01-01T00:00:00.250Z ")


def test_keyvalue_exception_is_one_json_string_on_the_same_line() -> None:
    line = KeyValueFormatter().format(
        _record("event=handler_failed", level=logging.ERROR, exc=True)
    )
    assert "\n" not in line
    head, _, exc = line.partition(" exc=")
    assert head.endswith("event=handler_failed")
    text = json.loads(exc)
    assert text.startswith("Traceback") and "RuntimeError: boom" in text


# ----------------------------------------------------------------------- JSON


def test_json_request_line_fields() -> None:
    doc = _json(_record(REQUEST_LINE, *REQUEST_ARGS))
    assert doc["level"] == "info"
    assert doc["logger"] == "iopd.edge"
    assert doc["ts"].endswith("Z")
    assert {k: v for k, v in doc.items() if k not in ("ts", "level", "logger")} == {
        "event": "request",
        "request_id": "req_1",
        "principal": "alice",
        "group": "echo",
        "provider": "echo-a",
        "endpoint": "chat_completions",
        "mode": "normalized",
        "status": "ok",
        "http_status": "200",
        "duration_ms": "12.3",
        "input_tokens": "3",
        "output_tokens": "7",
    }


def test_both_formats_carry_the_same_pairs() -> None:
    rec = _record(REQUEST_LINE, *REQUEST_ARGS)
    kv_line = KeyValueFormatter().format(rec)
    doc = _json(rec)
    for key in ("request_id", "principal", "group", "provider", "mode", "status", "duration_ms"):
        assert f" {key}={doc[key]}" in kv_line


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ('event=refresh reason="file not found: a b"', "file not found: a b"),
        ("event=refresh reason='single quoted value'", "single quoted value"),
        ('event=refresh reason=""', ""),
        ("event=refresh reason=", ""),
        ("event=refresh reason=plain", "plain"),
    ],
)
def test_json_quoted_values_lose_their_quotes(message: str, expected: str) -> None:
    doc = _json(_record(message))
    assert doc["event"] == "refresh"
    assert doc["reason"] == expected


def test_json_repr_formatted_reason_is_one_field() -> None:
    # Call sites log free text with %r (edge/daemon.py: reason=%r).
    doc = _json(_record("event=edge_failed reason=%r", "[Errno 98] Address in use"))
    assert doc["reason"] == "[Errno 98] Address in use"
    assert doc["event"] == "edge_failed"


def test_json_escaped_quote_stays_inside_the_value() -> None:
    doc = _json(_record(r'event=x reason="say \"hi\" now" after=1'))
    assert doc["reason"] == r"say \"hi\" now"
    assert doc["after"] == "1"


def test_json_keeps_free_text_around_pairs() -> None:
    # transport/listen.py logs "wire listening on %s:%d tls=%s".
    doc = _json(_record("wire listening on %s:%d tls=%s", "127.0.0.1", 7070, False))
    assert doc["tls"] == "False"
    assert any("wire listening on 127.0.0.1:7070" in str(v) for v in doc.values())


def test_json_message_without_pairs_goes_to_msg() -> None:
    doc = _json(_record("connection error"))
    assert doc["msg"] == "connection error"
    assert "event" not in doc


def test_json_non_ascii_kept_readable() -> None:
    line = JsonFormatter().format(_record("event=x alias=%s", "김철수"))
    assert "김철수" in line
    assert json.loads(line)["alias"] == "김철수"


def test_json_exception_field() -> None:
    doc = _json(_record("event=handler_failed", level=logging.ERROR, exc=True))
    assert doc["event"] == "handler_failed"
    assert doc["level"] == "error"
    assert doc["exc"].startswith("Traceback")
    assert "RuntimeError: boom" in doc["exc"]


# ------------------------------------------------------------------- redact


@pytest.mark.parametrize(
    "text",
    [
        "Authorization: Bearer sk-canary-123",
        "Authorization=sk-canary-123",
        "bad token=sk-canary-123",
        "api_key: sk-canary-123",
        "API-KEY=sk-canary-123",
        "bearer sk-canary-123",
    ],
)
def test_redact_masks_credentials(text: str) -> None:
    out = redact(text)
    assert "sk-canary-123" not in out
    assert "***" in out


def test_redact_leaves_plain_text_alone() -> None:
    text = "event=refresh outcome=applied changed_providers=2"
    assert redact(text) == text


# ------------------------------------------------------------------- setup


@pytest.fixture
def restore_root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)


@pytest.mark.parametrize(
    ("fmt", "formatter"), [("json", JsonFormatter), ("keyvalue", KeyValueFormatter)]
)
def test_setup_logging_writes_to_stdout_in_the_format(
    fmt: str,
    formatter: type[logging.Formatter],
    restore_root_logging: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    setup_logging(fmt, "warning")
    root = logging.getLogger()
    assert len(root.handlers) == 1
    assert isinstance(root.handlers[0].formatter, formatter)
    log = logging.getLogger("iopd.test")
    log.info("event=dropped")
    log.warning("event=kept n=%d", 1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert "dropped" not in lines[0]
    if fmt == "json":
        assert json.loads(lines[0])["event"] == "kept"
    else:
        assert lines[0].endswith("level=warning logger=iopd.test event=kept n=1")


def test_setup_logging_replaces_earlier_handlers(restore_root_logging: None) -> None:
    setup_logging("keyvalue", "info")
    setup_logging("json", "debug")
    root = logging.getLogger()
    assert len(root.handlers) == 1
    assert isinstance(root.handlers[0].formatter, JsonFormatter)
    assert root.level == logging.DEBUG
