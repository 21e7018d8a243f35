"""One daemon for one machine: ``nodes[].embedded: true``.

The config rules are checked directly; the behaviour end to end, with the
official ``openai`` SDK: in process (``run_edge`` through tests/support/gateway.py,
next to a node that dials in) and as ``python -m iopd edge --config`` from
the shipped ``configs/one-machine.yaml``, in front of a mock OpenAI server.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest
import trio

from iopd.config.load import ConfigError, parse_edge_config
from iopd.config.refresh_classify import classify
from iopd.config.rules import validate_edge_config
from iopd.edge.embedded import embedded_node_config
from iopd.node.run import run_node
from tests.support.gateway import (
    http_request,
    in_thread,
    node_token,
    running_gateway,
    token_hash,
    wait_until,
)
from tests.support.mock_providers import MockOpenAIServer
from tests.support.paths import ROOT

YAML = """
edge:
  id: edge-one
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
models:
  - id: local
    providers: {{vllm-1: served}}
  - id: echo
    providers: {{echo-b: echo}}
nodes:
  - id: here
    embedded: true
    providers:
      - id: vllm-1
        type: openai
        base_url: {base}/v1
        models: [served]
        capacity: 4
  - id: node-b
    token_hash_sha256: {hash_b}
    providers:
      - id: echo-b
        type: echo
        models: [echo]
"""


def _problems(text: str) -> list[str]:
    try:
        parse_edge_config(text, env={})
    except ConfigError as exc:
        return exc.errors
    return []


def _yaml(**kw: str) -> str:
    return YAML.format(base=kw.get("base", "http://127.0.0.1:8000"), hash_b=token_hash(node_token("node-b")))


# ------------------------------------------------------------------ config


def test_an_embedded_node_needs_no_token_hash() -> None:
    assert _problems(_yaml()) == []


def test_an_embedded_node_with_a_token_hash_is_refused() -> None:
    text = _yaml().replace(
        "    embedded: true\n", f"    embedded: true\n    token_hash_sha256: {token_hash('x')}\n"
    )
    (line,) = _problems(text)
    assert line.startswith("nodes[0].token_hash_sha256:")
    assert "embedded" in line


def test_an_embedded_node_without_providers_is_refused() -> None:
    cfg = parse_edge_config(_yaml(), env={})
    here = msgspec.structs.replace(cfg.nodes[0], providers=[])
    bare = msgspec.structs.replace(cfg, nodes=[here, cfg.nodes[1]], models=cfg.models[1:])
    (problem,) = validate_edge_config(bare)
    assert problem.path == "nodes[0].providers"
    assert "embedded" in problem.reason


def test_a_dialling_node_without_a_token_hash_is_told_about_both_forms() -> None:
    text = _yaml().replace(f"    token_hash_sha256: {token_hash(node_token('node-b'))}\n", "")
    (line,) = _problems(text)
    assert line.startswith("nodes[1].token_hash_sha256: required")
    assert "token_verifier" in line
    assert "embedded: true" in line


def test_turning_embedded_on_or_off_needs_a_restart() -> None:
    old = parse_edge_config(_yaml(), env={})
    node = msgspec.structs.replace(old.nodes[0], embedded=False, token_hash_sha256=token_hash("a"))
    new = msgspec.structs.replace(old, nodes=[node, old.nodes[1]])
    assert classify(old, new).restart_required == ["nodes[0].embedded"]
    assert classify(old, old).is_empty


# -------------------------------------------------------------- in process


async def test_embedded_node_serves_the_sdk_beside_a_node_that_dials_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = MockOpenAIServer()
            await n.start(mock.serve)
            async with running_gateway(_yaml(base=mock.base_url), nodes=[]) as gw:
                # run_edge reported started only once its embedded node was ready.
                assert gw.runtime.hub.connected_since("here") is not None
                await gw.start_node("node-b")
                client = gw.sdk()
                msgs = [{"role": "user", "content": "hi"}]
                reply = await in_thread(
                    lambda: client.chat.completions.create(model="local", messages=msgs)
                )
                assert reply.choices[0].message.content == mock.reply_text
                assert mock.requests[-1].json()["model"] == "served"
                chunks = await in_thread(
                    lambda: list(
                        client.chat.completions.create(model="local", messages=msgs, stream=True)
                    )
                )
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                echoed = await in_thread(
                    lambda: client.chat.completions.create(model="echo", messages=msgs)
                )
                assert echoed.choices[0].message.content == "hi"

                status = await http_request(gw.handle.admin, "GET", "/status")
                doc = status.json()
                assert [(x["id"], x["connected"]) for x in doc["nodes"]] == [
                    ("here", True),
                    ("node-b", True),
                ]
                await wait_until(
                    lambda: getattr(gw.runtime.health.get("vllm-1"), "health", "") == "healthy"
                )

                # The minted token is in no log line and not in /status.
                token = gw.runtime.embedded_tokens["here"]
                assert len(token) >= 40
                assert token not in caplog.text
                assert token.encode() not in status.body
                assert token_hash(token) not in caplog.text
            n.cancel_scope.cancel()


async def test_the_embedded_listener_admits_embedded_nodes_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A dialling node with a valid token is refused there: it is no way around edge.tls."""
    caplog.set_level(logging.INFO)
    with trio.fail_after(30):
        async with running_gateway(_yaml(), nodes=[]) as gw:
            started = next(
                r for r in caplog.records if "event=embedded_nodes_started" in r.getMessage()
            )
            wire = started.getMessage().rpartition("wire=")[2]
            host, _, port = wire.rpartition(":")
            cfg = embedded_node_config(
                gw.runtime.snapshot.config, "node-b", node_token("node-b"), (host, int(port))
            )
            async with trio.open_nursery() as n:
                handle = await n.start(run_node, cfg)
                await wait_until(lambda: handle.link.last_refused is not None)
                assert handle.link.last_refused.code == "unknown_node"
                assert gw.runtime.hub.connected_since("node-b") is None
                n.cancel_scope.cancel()


# -------------------------------------------------------------- subprocess


async def test_iopd_edge_with_the_one_machine_config_serves_the_sdk(tmp_path: Path) -> None:
    """``iopd edge --config one-machine.yaml``: one command, one file, the SDK answered."""
    import openai

    from tests.support.daemons import run_daemon

    shipped = (ROOT / "configs" / "one-machine.yaml").read_text()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = MockOpenAIServer()
            mock.listed = ["Qwen/Qwen3-8B"]
            await n.start(mock.serve)
            text = shipped
            for old, new in (
                ("127.0.0.1:7070", "127.0.0.1:0"),
                ("127.0.0.1:7071", "127.0.0.1:0"),
                ("listen: 127.0.0.1:8080", "listen: 127.0.0.1:0"),
                ("http://127.0.0.1:8000/v1", f"{mock.base_url}/v1"),
            ):
                assert old in text
                text = text.replace(old, new)
            path = tmp_path / "one.yaml"
            path.write_text(text)
            async with run_daemon(n, "edge", "edge", path) as edge:
                started = await edge.wait_event("edge_started")
                await edge.wait_event("embedded_nodes_started")
                client = openai.OpenAI(
                    base_url=f"http://{started['openai']}/v1", api_key="unused", max_retries=0
                )
                reply = await in_thread(
                    lambda: client.chat.completions.create(
                        model="local", messages=[{"role": "user", "content": "hi"}]
                    )
                )
                assert reply.choices[0].message.content == mock.reply_text
                assert mock.requests[-1].path == "/v1/chat/completions"
                edge.proc.send_signal(2)  # SIGINT: drain, then exit 0
                assert await edge.wait_exit() == 0
            assert "Traceback" not in edge.output
            n.cancel_scope.cancel()
