#!/usr/bin/env python3
"""Time the caller-controlled computations of the edge on hostile inputs.

Usage: ``python scripts/measure_hostile_compute.py``

Each case is one input a caller can send (or make an ``echo`` model send
back), run through the function the edge calls for it, in process: tool-call
parsing and argument validation, the strict-output stream filter, and the
decoding of a request body.  The figures go in docs/reliability.md
("Bounded work on what a caller controls").  Every case must finish in
milliseconds; before the fixes several of them never finished, so the script
gives up on a case after ``--limit`` seconds (SIGALRM) and says so.
"""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Callable
from typing import Any

from iopd.edge.openai.strict import StrictStreamFilter
from iopd.edge.openai.tools import parse_text_tool_calls


class _GaveUp(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _GaveUp


def _tool(parameters: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def _block(arguments: str) -> str:
    return '<tool_call>{"name": "f", "arguments": ' + arguments + "}</tool_call>"


def _strict(deltas: list[str]) -> str:
    f = StrictStreamFilter()
    return "".join(f.feed(d) for d in deltas) + f.flush()


def cases() -> list[tuple[str, Callable[[], object]]]:
    """(name, thunk) of every measured input."""
    return [
        (
            'tool call, schema allOf [{"$ref": "#"}] x 3',
            lambda: parse_text_tool_calls(
                _block("{}"), _tool({"type": "object", "allOf": [{"$ref": "#"}] * 3})
            ),
        ),
        (
            'tool call, pattern "^(a+)+$" vs "a"*40 + "!"',
            lambda: parse_text_tool_calls(
                _block('{"a": "' + "a" * 40 + '!"}'),
                _tool({"properties": {"a": {"pattern": "^(a+)+$"}}}),
            ),
        ),
        (
            "tool call, 88 KB of unclosed <tool_call>",
            lambda: parse_text_tool_calls("<tool_call>" * 8_000, _tool({})),
        ),
        (
            "tool call, code fence around 1,000 newline+space pairs",
            lambda: parse_text_tool_calls(
                "<tool_call>```" + "\n " * 1_000 + "x```</tool_call>", _tool({})
            ),
        ),
        ("strict stream, 200,000 deltas without the tag", lambda: _strict(["abcd "] * 200_000)),
        (
            "strict stream, 200,000 whitespace deltas inside the element",
            lambda: _strict(["<completion>x", *["  "] * 200_000, "y</completion>"]),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=30, help="seconds before giving up a case")
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    for name, thunk in cases():
        signal.alarm(args.limit)
        start = time.perf_counter()
        try:
            thunk()
            outcome = f"{(time.perf_counter() - start) * 1000:9.2f} ms"
        except _GaveUp:
            outcome = f"gave up after {args.limit} s"
        finally:
            signal.alarm(0)
        print(f"{name:<62} {outcome}")


if __name__ == "__main__":
    main()
