"""Logging for both daemons: one line per event to stdout (journald), key=value or JSON.

Every log call in iopd writes ``key=value`` pairs (``event=request status=ok ...``).
The JSON formatter parses those pairs into fields, so both formats carry the
same data and call sites stay plain ``logging`` calls.  Secrets are never
passed to a log call in the first place; two last lines of defence catch
free text that might echo one: ``redact`` masks what looks like a credential,
and ``LOG_SECRETS`` masks every piece of a *configured* secret (a provider
key, a node token) in every log record, whatever handler writes it.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable

from iopd.redact import Scrubber

_PAIR = re.compile(r"""(\w+)=("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|\S*)""")
_BEARER = re.compile(
    r"(?i)\b(bearer|token|api[_-]?key|authorization)(\s*[:=]\s*|\s+)((?:bearer|basic)\s+)?(\S+)"
)


def redact(text: str) -> str:
    """Mask anything that looks like a credential in free text."""
    return _BEARER.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3) or ''}***", text)


class _LogSecrets:
    """The secrets of every daemon in this process, scrubbed from every log record.

    Each running daemon (an edge, a node; the demo and the tests run several
    in one process) registers a source: a callable returning the ``Scrubber``
    of its *current* secrets, so a refresh or a config push needs no call
    here.  Scrubbing happens in the log-record factory, so it covers every
    handler (stdout, journald, a test's capture) and happens once per record,
    before any formatter sees it.
    """

    def __init__(self) -> None:
        self._sources: dict[str, Callable[[], Scrubber]] = {}
        self._installed = False

    def add(self, owner: str, source: Callable[[], Scrubber]) -> None:
        """Scrub ``source()``'s secrets from every record until ``forget(owner)``."""
        self._sources[owner] = source
        if not self._installed:
            self._installed = True
            make = logging.getLogRecordFactory()

            def factory(*args: object, **kwargs: object) -> logging.LogRecord:
                record = make(*args, **kwargs)
                if self._sources:
                    self.scrub_record(record)
                return record

            logging.setLogRecordFactory(factory)

    def forget(self, owner: str) -> None:
        """Stop scrubbing ``owner``'s secrets (its daemon stopped)."""
        self._sources.pop(owner, None)

    def scrub(self, text: str) -> str:
        """``text`` without any piece of any registered secret."""
        for source in list(self._sources.values()):
            text = source().scrub(text)
        return text

    def scrub_record(self, record: logging.LogRecord) -> None:
        """Scrub the record's message (and exception text) in place; never raises."""
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: the handler reports it as usual
            return
        clean = self.scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[0] is not None:
            record.exc_text = self.scrub(_EXC_FORMATTER.formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = self.scrub(record.stack_info)


_EXC_FORMATTER = logging.Formatter()
#: The process-wide registry (``add`` when a daemon starts, ``forget`` when it stops).
LOG_SECRETS = _LogSecrets()


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    """The record's traceback: the scrubbed text when the factory made one."""
    if record.exc_text:
        return record.exc_text
    assert record.exc_info is not None
    return formatter.formatException(record.exc_info)


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=... logger=... <message pairs>``."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = (
            f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()} "
            f"logger={record.name} {record.getMessage()}"
        )
        if record.exc_info:
            line += " exc=" + json.dumps(_exception_text(self, record))
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
            doc["exc"] = _exception_text(self, record)
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
