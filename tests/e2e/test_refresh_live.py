"""Refresh applies callers' tokens and nodes live: in-process edge and nodes, real sockets."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support.edges import Edge, edge_yaml, running_edge
from tests.support.gateway import RawResponse, http_request, token_hash, wait_until

SLOW_MODELS = "  - id: echo\n    providers: {echo-1: echo}\n  - id: slow\n    providers: {echo-2: echo}\n"
ONLY_ECHO = "  - id: echo\n    providers: {echo-1: echo}\n"


def principals(*tokens: str) -> str:
    rows = "".join(
        f"    - {{token_ref: {t}, token_hash_sha256: {token_hash(t)}, principal_ref: p-{t}}}\n"
        for t in tokens
    )
    return "  principal_tokens:\n" + rows


async def chat_as(edge: Edge, token: str) -> RawResponse:
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
    return await http_request(
        edge.gw.host_port,
        "POST",
        "/v1/chat/completions",
        body=body,
        headers=[("authorization", f"Bearer {token}")],
    )


async def test_tokens_added_rotated_and_removed_live(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path, principal=principals("tok-a")) as edge:
            assert (await chat_as(edge, "tok-a")).status == 200
            assert (await chat_as(edge, "tok-b")).status == 401
            doc = await edge.apply(principal=principals("tok-a", "tok-b"))
            assert doc["restart_required"] == [] and doc["errors"] == []
            assert (await chat_as(edge, "tok-b")).status == 200
            await edge.apply(principal=principals("tok-b"))  # tok-a removed: refused next
            r = await chat_as(edge, "tok-a")
            assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert (await chat_as(edge, "tok-b")).status == 200


def logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


def without_node_b(text: str) -> str:
    return text[: text.index("  - id: node-b")]


async def test_a_removed_node_finishes_its_requests_then_its_session_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iopd.edge.nodes")
    over: dict[str, Any] = dict(models=SLOW_MODELS, delay2=100)
    results: list[RawResponse] = []
    with trio.fail_after(30):
        async with running_edge(tmp_path, **over) as edge:
            hub = edge.gw.runtime.hub

            async def slow() -> None:
                results.append(await edge.chat("one two three four five six", model="slow"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow)
                await wait_until(lambda: edge.in_flight().get("echo-2") == 1)
                edge.path.write_text(without_node_b(edge_yaml(models=ONLY_ECHO, delay2=100)))
                doc = await edge.refresh("apply")
                assert doc["applied"] is True and doc["restart_required"] == []
                assert doc["changed_nodes"] == ["node-b"] and doc["errors"] == []
                assert hub.session("node-b") is None  # out of routing at once
                assert not logged(caplog, "event=node_retired node=node-b")
            (done,) = results
            assert done.status == 200, done.body
            assert "six" in done.json()["choices"][0]["message"]["content"]
            await wait_until(lambda: logged(caplog, "event=node_retired node=node-b"))
            assert logged(caplog, "removed from the config by a refresh")
            status = await edge.status()
            assert [n["id"] for n in status["nodes"]] == ["node-a"]
            assert "echo-2" not in edge.in_flight()
            assert (await edge.chat("x", model="slow")).status == 404
            assert (await edge.chat("x")).status == 200


def team_tokens(*tokens: str) -> str:
    """Principal tokens that all belong to the principal ``team``."""
    rows = "".join(
        f"    - {{token_ref: {t}, token_hash_sha256: {token_hash(t)}, principal_ref: team}}\n"
        for t in tokens
    )
    return "  principal_tokens:\n" + rows


TEAM_LIMITS = "limits:\n  principals:\n    - {principal_ref: team, requests_per_minute: 2}\n"


async def test_a_rotated_token_keeps_its_principals_limit_counters(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_edge(tmp_path, principal=team_tokens("tok-a")) as edge:
            edge.path.write_text(edge_yaml(principal=team_tokens("tok-a")) + TEAM_LIMITS)
            assert (await edge.refresh("apply"))["applied"] is True
            assert [(await chat_as(edge, "tok-a")).status for _ in range(2)] == [200, 200]
            edge.path.write_text(edge_yaml(principal=team_tokens("tok-b")) + TEAM_LIMITS)
            doc = await edge.refresh("apply")
            assert doc["applied"] is True and doc["restart_required"] == []
            assert (await chat_as(edge, "tok-a")).status == 401
            r = await chat_as(edge, "tok-b")  # the same principal: its minute is used up
            assert r.status == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"


async def test_a_request_in_flight_when_its_token_is_removed_finishes(tmp_path: Path) -> None:
    over: dict[str, Any] = dict(delay1=100, delay2=100)
    results: list[RawResponse] = []
    with trio.fail_after(30):
        async with running_edge(tmp_path, principal=principals("tok-a", "tok-b"), **over) as edge:

            async def slow() -> None:
                body = {"model": "echo", "messages": [{"role": "user", "content": "a b c d e"}]}
                results.append(
                    await http_request(
                        edge.gw.host_port,
                        "POST",
                        "/v1/chat/completions",
                        body=body,
                        headers=[("authorization", "Bearer tok-a")],
                    )
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow)
                await wait_until(lambda: any(edge.in_flight().values()))
                await edge.apply(principal=principals("tok-b"), **over)
                assert (await chat_as(edge, "tok-a")).status == 401
            (done,) = results
            assert done.status == 200, done.body
