"""Logging for both daemons: one line per event to stdout (journald), key=value or JSON.

Every log call in iopd writes ``key=value`` pairs (``event=request status=ok ...``).
The JSON formatter parses those pairs into fields, so both formats carry the
same data and call sites stay plain ``logging`` calls.  Secrets are never
passed to a log call in the first place; ``redact`` is a last line of defence
for free-text reasons that might echo a peer's input.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_PAIR = re.compile(r"""(\w+)=("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|\S*)""")
_BEARER = re.compile(
    r"(?i)\b(bearer|token|api[_-]?key|authorization)(\s*[:=]\s*|\s+)((?:bearer|basic)\s+)?(\S+)"
)


def redact(text: str) -> str:
    """Mask anything that looks like a credential in free text."""
    return _BEARER.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3) or ''}***", text)


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=... logger=... <message pairs>``."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = (
            f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()} "
            f"logger={record.name} {record.getMessage()}"
        )
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``key=value`` pairs of the message become fields."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        doc: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        for key, value in _PAIR.findall(msg):
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            doc[key] = value
        rest = " ".join(_PAIR.sub(" ", msg).split())
        if rest:
            doc["msg"] = rest  # free text around the pairs is kept too
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def setup_logging(fmt: str = "keyvalue", level: str = "info") -> None:
    """Send iopd's logs to stdout in ``fmt`` at ``level`` (replaces earlier handlers)."""
    # iopd's lines never use the process/thread fields or the caller's source
    # location: skip gathering them on every record (measurable on the hot path).
    logging.logProcesses = False
    logging.logThreads = False
    logging.logMultiprocessing = False
    logging._srcfile = None
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
