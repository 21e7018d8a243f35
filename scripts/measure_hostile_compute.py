#!/usr/bin/env python3
"""Time the caller-controlled computations of the edge on hostile inputs.

Usage: ``python scripts/measure_hostile_compute.py [--queued]``

Each case is one input a caller can send (or make an ``echo`` model send
back), run through the function the edge calls for it, in process: tool-call
parsing and argument validation, the strict-output stream filter, and the
decoding of a request body.  The figures go in docs/reliability.md
("Bounded work on what a caller controls").  Every case must finish in
milliseconds; before the fixes several of them never finished, so the script
gives up on a case after ``--limit`` seconds (SIGALRM) and says so.

``--queued`` runs an edge and an echo node in this process (tests/support/gateway.py;
run from the repository root) with one slot held by a slow request, sends
ten 8 MiB bodies of ``[]`` items at once, and reports the process's peak RSS
growth while they are decoded or queued, and the longest the event loop was
held (the lateness of a 10 ms sleep).
"""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Callable
from typing import Any

import trio

from iopd.edge.openai.incoming.requests import parse_json_object
from iopd.edge.openai.outgoing.strict import StrictStreamFilter
from iopd.edge.openai.outgoing.tools import parse_text_tool_calls


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
        ("request body, 8 MiB of [] items (decode or refuse)", _decode_8mib_of_lists),
    ]


_BODY_8MIB_OF_LISTS = (
    b'{"model":"echo","messages":[{"role":"user","content":"hi"}],"x":['
    + b"[]," * (8 * 1024 * 1024 // 3 - 40)
    + b"[]]}"
)


def _decode_8mib_of_lists() -> object:
    try:
        return parse_json_object(_BODY_8MIB_OF_LISTS)
    except Exception as exc:  # the 400 is the expected outcome once bounded
        return exc


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


_QUEUED_YAML = """
edge: {{id: edge-measure, node_listen: 127.0.0.1:0, admin_listen: 127.0.0.1:0}}
openai: {{listen: 127.0.0.1:0}}
models:
  - id: echo
    providers: {{echo-1: echo}}
nodes:
  - id: node-a
    token_hash_sha256: {hash}
    providers:
      - {{id: echo-1, type: echo, models: [echo], capacity: 1, delay_ms: 2500}}
"""


async def _queued() -> None:
    from tests.support.gateway import http_request, node_token, running_gateway, token_hash

    statuses: list[int] = []
    lag = [0.0]
    peak = [0]

    async def watch() -> None:
        while True:
            before = trio.current_time()
            await trio.sleep(0.01)
            lag[0] = max(lag[0], trio.current_time() - before - 0.01)
            peak[0] = max(peak[0], _rss_kib())

    async with running_gateway(_QUEUED_YAML.format(hash=token_hash(node_token("node-a")))) as gw:
        hold = {"model": "echo", "messages": [{"role": "user", "content": "slow answer"}]}

        async def send(body: bytes | dict[str, object]) -> None:
            reply = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)
            statuses.append(reply.status)

        async with trio.open_nursery() as outer:
            outer.start_soon(send, hold)
            await trio.sleep(0.5)
            base = _rss_kib()
            peak[0] = base
            outer.start_soon(watch)
            async with trio.open_nursery() as burst:
                for _ in range(10):
                    burst.start_soon(send, _BODY_8MIB_OF_LISTS)
            outer.cancel_scope.cancel()
    print(
        f"ten queued 8 MiB [] bodies: statuses {sorted(statuses)}, peak RSS growth "
        f"{(peak[0] - base) / 1024:.0f} MiB, longest loop stall {lag[0] * 1000:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=30, help="seconds before giving up a case")
    parser.add_argument("--queued", action="store_true", help="only the in-process edge run")
    args = parser.parse_args()
    if args.queued:
        trio.run(_queued)
        return
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
