"""Security properties of a running gateway (edge + node in process, real sockets).

* **Secrets never leak**: canary tokens (caller bearer, principal token, a
  wrong bearer, the node token, a wrong node token, a forwarded provider-auth
  value, a provider ``api_key``) are pushed through every auth path and error
  path, including providers that echo request headers back in their errors.
  Afterwards every captured log record (DEBUG and up, with tracebacks),
  ``/metrics``, ``/status`` and every error body the edge wrote are searched:
  zero hits.  (A passthrough provider's own body is relayed unchanged by
  design (docs/reliability.md, "Security"); that one body is the provider's, not the gateway's.)
* **Constant-time comparisons**: the auth code compares digests with
  ``hmac.compare_digest`` and never with ``==``.

The gateway with its canaries is ``tests/support/security_env.py``; the same gateway pins that
no caller chooses an outbound URL (``test_outbound_urls.py``) and that the admin API cannot be
reached from the public listener (``test_admin_unreachable.py``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import logging
import signal
import textwrap
from pathlib import Path

import pytest
import trio

from iopd.config.schema import NodeConfigFile, NodeSection
from iopd.edge.nodes import hub as edge_nodes
from iopd.edge.principals import authenticator as openai_auth
from tests.support.gateway import http_request, token_hash, wait_until
from tests.support.mock_providers import MockOllamaServer, MockReply, RecordedRequest
from tests.support.security_env import (
    API_KEY,
    CALLER,
    CANARIES,
    LEGACY,
    NODE,
    PROVIDER_AUTH,
    WRONG_BEARER,
    WRONG_NODE,
    chat,
    raw_request,
    security_env,
)
from wire import scram


def _echo_headers(req: RecordedRequest) -> MockReply:
    """A provider error that echoes every request header back (a leaky provider)."""
    dumped = {k: v for k, v in req.headers}
    return MockReply(status=500, body=json.dumps({"error": {"echo": dumped}}).encode())


def _log_text(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured record, formatted with its traceback, plus the raw args."""
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    parts = [caplog.text]
    for record in caplog.records:
        parts.append(formatter.format(record))
        parts.append(repr(record.args))
    return "\n".join(parts)


# ------------------------------------------------------------------ canaries


async def test_canary_secrets_never_reach_logs_metrics_status_or_error_bodies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with trio.fail_after(60):
        async with security_env() as env:
            relayed_by_design: list[str] = []

            # Good principal token, legacy bearer, wrong and missing bearers.
            assert (await env.call("/v1/chat/completions", chat("echo"))).status == 200
            r = await env.call("/v1/chat/completions", chat("echo", stream=True), token=LEGACY)
            assert r.status == 200
            for bad in (WRONG_BEARER, f"{WRONG_BEARER} {CALLER}x", CALLER.upper()):
                r = await env.call("/v1/chat/completions", chat("echo"), token=bad)
                assert r.status == 401
            r = await env.call(
                "/v1/chat/completions",
                chat("echo"),
                token=None,
                headers=[("authorization", f"Basic {WRONG_BEARER}")],
            )
            assert r.status == 401
            assert (await env.call("/v1/models", method="GET", token=WRONG_BEARER)).status == 401

            # Provider auth forwarding on passthrough: the value reaches the
            # provider in the target header; the caller's token never does.
            pa = [("x-provider-authorization", f"Bearer {PROVIDER_AUTH}")]
            r = await env.call("/v1/chat/completions", chat("pt"), headers=pa)
            assert r.status == 200
            sent = env.oa.requests[-1]
            assert sent.header("authorization") == f"Bearer {PROVIDER_AUTH}"
            assert all(CALLER not in v for _, v in sent.headers)
            assert sent.header("x-provider-authorization") is None

            # A passthrough provider that echoes headers in its error: relayed
            # as is (the provider's body); the gateway adds nothing of its own.
            # (Health probes keep passing, so the provider stays a candidate.)
            env.oa.handler = lambda req: None if req.path == "/v1/models" else _echo_headers(req)
            r = await env.call("/v1/chat/completions", chat("pt"), headers=pa, record=False)
            assert r.status == 500
            relayed_by_design.append(r.body.decode())
            assert CALLER not in r.body.decode()  # the caller's token was never sent
            r = await env.call(
                "/v1/responses", {"model": "pt", "input": "hi"}, headers=pa, record=False
            )
            assert r.status == 500
            assert CALLER not in r.body.decode()

            # A normalized provider (api_key configured) echoing headers in its
            # error and in its health probe: the edge writes its own envelope.
            env.ol.handler = lambda req: None if req.path == "/api/tags" else _echo_headers(req)
            assert any(
                req.header("authorization") == f"Bearer {API_KEY}" for req in env.ol.requests
            ), "the api_key is sent to the provider (else this test proves nothing)"
            r = await env.call("/v1/chat/completions", chat("ol"))
            assert r.status == 502
            assert r.json()["error"]["code"] == "provider_error"
            r = await env.call("/v1/chat/completions", chat("ol", stream=True))
            assert r.status in (200, 502)
            # Now the health probe fails too (echoing headers): into last_error.
            env.ol.handler = _echo_headers
            admin = env.gw.handle.admin
            while True:
                status = await http_request(admin, "GET", "/status")
                ol_status = [p for p in status.json()["providers"] if p["id"] == "ol-1"]
                if ol_status and ol_status[0]["last_error"]:
                    break
                await trio.sleep(0.05)

            # Node handshakes with a wrong token (the edge refuses, logs it).
            host, port = env.gw.handle.wire
            bad_node = NodeConfigFile(
                node=NodeSection(
                    id="node-a",
                    edge=f"{host}:{port}",
                    token=WRONG_NODE,
                    reconnect_initial_backoff=0.05,
                    reconnect_max_backoff=0.1,
                    accept_legacy_proof=True,  # this edge holds the hash form
                )
            )
            bad_scope = trio.CancelScope()
            env.nursery.start_soon(functools.partial(_run_until, bad_node, bad_scope))
            await wait_until(
                lambda: sum("code=bad_token" in r.getMessage() for r in caplog.records) >= 2
            )
            bad_scope.cancel()

            # Everything an operator or caller can see.
            status = await http_request(admin, "GET", "/status")
            metrics = await http_request(admin, "GET", "/metrics")
            assert status.status == 200 and metrics.status == 200

            surfaces = {
                "logs": _log_text(caplog),
                "status": status.body.decode(),
                "metrics": metrics.body.decode(),
                "edge_output": "\n".join(env.edge_output),
            }
            for canary in CANARIES:
                for where, text in surfaces.items():
                    assert canary not in text, f"{canary!r} leaked into {where}"
            assert relayed_by_design  # (checked above: only the provider's own body)


def _pieces(secret: str, text: str, run: int = 8) -> list[str]:
    """Every ``run``-character piece of ``secret`` with a digit in it (the canaries'
    random part: ``provider`` alone is a word of every /status) found in ``text``."""
    pieces = (secret[i : i + run] for i in range(len(secret) - run + 1))
    return [p for p in pieces if any(c.isdigit() for c in p) and p in text]


async def test_a_cut_canary_key_reaches_no_log_status_or_error_body(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cut key: a provider quoting the key in a body the node cuts at 512 bytes
    (12 characters into the key); and a log line quoting a piece of each secret
    the daemons hold (the provider key, the node token, the legacy bearer)."""
    caplog.set_level(logging.DEBUG)

    def cut_echo(req: RecordedRequest) -> MockReply | None:
        if req.path == "/api/tags":
            return None  # the health probe passes
        key = (req.header("authorization") or "").removeprefix("Bearer ")
        return MockReply(status=500, body=b"x" * (512 - 12) + key.encode())

    with trio.fail_after(60):
        async with security_env() as env:
            env.ol.handler = cut_echo
            for body in (chat("ol"), chat("ol", stream=True)):
                r = await env.call("/v1/chat/completions", body)
                assert r.status in (200, 502) and b'x***","type":"server_error"' in r.body
            status = (await http_request(env.gw.handle.admin, "GET", "/status")).body.decode()
            for secret in (API_KEY, NODE, LEGACY):
                logging.getLogger("iopd.test").warning("event=echo text=%s", secret[-12:])
            surfaces = {
                "logs": _log_text(caplog),
                "status": status,
                "edge_output": "\n".join(env.edge_output),
            }
    for secret in (API_KEY, NODE, LEGACY):
        for where, text in surfaces.items():
            assert _pieces(secret, text) == [], f"a piece of {secret!r} leaked into {where}"
    assert "event=echo text=***" in caplog.text


async def _run_until(cfg: NodeConfigFile, scope: trio.CancelScope) -> None:
    from iopd.node.run import run_node

    with scope:
        await run_node(cfg)


# ------------------------------------------------------- constant-time compares

_SECRET_WORDS = ("token", "hash", "digest", "secret", "api_key", "presented", "expected")


def _names(node: ast.AST) -> set[str]:
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id.lower())
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr.lower())
    return out


def _equality_on_secrets(source: str) -> list[str]:
    """``==``/``!=`` comparisons whose operands name a token, hash or digest."""
    bad = []
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops
        ):
            names = _names(node)
            constants = {sub.value for sub in ast.walk(node) if isinstance(sub, ast.Constant)}
            if any(word in name for name in names for word in _SECRET_WORDS) and not any(
                isinstance(c, str) for c in constants
            ):  # comparing against a literal (a key name, a scheme) is not a secret check
                bad.append(ast.unparse(node))
    return bad


def test_secret_checker_catches_a_plain_equality() -> None:
    assert _equality_on_secrets("if presented == entry.token_hash_sha256: pass")
    assert not _equality_on_secrets("if hmac.compare_digest(a_hash, b_hash): pass")


def test_caller_auth_compares_digests_in_constant_time() -> None:
    source = inspect.getsource(openai_auth.Authenticator.authenticate)
    assert "hmac.compare_digest" in source
    assert _equality_on_secrets(source) == []
    assert _equality_on_secrets(inspect.getsource(openai_auth)) == []


def test_node_handshake_compares_proofs_in_constant_time() -> None:
    for fn in (scram.Verifier.verify_proof, scram.verify_server_signature):
        source = inspect.getsource(fn)
        assert "hmac.compare_digest" in source
        assert _equality_on_secrets(source) == []
    assert _equality_on_secrets(inspect.getsource(edge_nodes.NodeHub._authenticate)) == []


# ------------------------------------------------ real daemons, their output

DAEMON_EDGE_YAML = """\
edge:
  id: sec-edge
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  log_level: debug
  drain_timeout: 2
openai:
  listen: 127.0.0.1:0
  bearer_token: {legacy}
  principal_tokens:
    - {{token_ref: sec-app, token_hash_sha256: {caller_hash}, principal_ref: sec-user}}
  provider_auth: {{header: X-Provider-Authorization, target_header: Authorization}}
models:
  - id: echo
    providers: {{echo-1: echo}}
  - id: ol
    providers: {{ol-1: "mock:latest"}}
nodes:
  - id: sec-node
    token_verifier: "{node_verifier}"
    providers:
      - id: echo-1
        type: echo
        models: [echo]
      - id: ol-1
        type: ollama
        base_url: {ol_base}
        api_key: {api_key}
        models: ["mock:latest"]
        health_interval: 0.2
"""

DAEMON_NODE_YAML = """\
node:
  id: sec-node
  edge: 127.0.0.1:{wire_port}
  token: {token}
  log_level: debug
  reconnect_initial_backoff: 0.1
  reconnect_max_backoff: 0.3
"""


async def test_canaries_never_reach_daemon_stdout_or_stderr(tmp_path: Path) -> None:
    from tests.support.daemons import NODE_TOKEN as OPS_NODE_TOKEN
    from tests.support.daemons import host_port, node_verifier, run_daemon

    canaries = [*CANARIES, OPS_NODE_TOKEN]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            ol = await nursery.start(MockOllamaServer().serve)
            # Chats fail echoing the request headers; the health probe stays green.
            ol.handler = lambda req: None if req.path == "/api/tags" else _echo_headers(req)
            edge_cfg = tmp_path / "edge.yaml"
            edge_cfg.write_text(
                DAEMON_EDGE_YAML.format(
                    legacy=LEGACY,
                    caller_hash=token_hash(CALLER),
                    node_verifier=node_verifier(OPS_NODE_TOKEN),
                    ol_base=ol.base_url,
                    api_key=API_KEY,
                )
            )
            async with run_daemon(nursery, "edge", "edge", edge_cfg) as edge:
                started = await edge.wait_event("edge_started")
                wire_port = host_port(started["wire"])[1]
                openai, admin = host_port(started["openai"]), host_port(started["admin"])
                good_cfg = tmp_path / "node.yaml"
                good_cfg.write_text(
                    DAEMON_NODE_YAML.format(wire_port=wire_port, token="${IOP_NODE_TOKEN}")
                )
                bad_cfg = tmp_path / "bad-node.yaml"
                bad_cfg.write_text(DAEMON_NODE_YAML.format(wire_port=wire_port, token=WRONG_NODE))
                async with run_daemon(nursery, "node", "node", good_cfg) as node:
                    await edge.wait_event("node_connected")
                    async with run_daemon(nursery, "bad-node", "node", bad_cfg) as bad:
                        await edge.wait_for(lambda ln: "code=bad_token" in ln)
                        bad.proc.kill()
                    outputs: list[str] = []
                    pa = [("x-provider-authorization", f"Bearer {PROVIDER_AUTH}")]
                    calls: list[tuple[str, str | None, list[tuple[str, str]]]] = [
                        ("echo", CALLER, pa),
                        ("echo", LEGACY, []),
                        ("echo", WRONG_BEARER, []),
                        ("ol", CALLER, pa),
                        ("nope", CALLER, pa),
                    ]
                    for model, tok, hdrs in calls:
                        auth = [("authorization", f"Bearer {tok}")] if tok else []
                        for stream in (False, True):
                            r = await raw_request(
                                openai,
                                "POST",
                                "/v1/chat/completions",
                                body=chat(model, stream=stream),
                                headers=auth + hdrs,
                            )
                            outputs.append(r.body.decode("utf-8", "replace"))
                    assert any(
                        req.header("authorization") == f"Bearer {API_KEY}" for req in ol.requests
                    )
                    outputs.append((await http_request(admin, "GET", "/status")).body.decode())
                    outputs.append((await http_request(admin, "GET", "/metrics")).body.decode())
                    node.proc.send_signal(signal.SIGTERM)
                    await node.wait_exit()
                edge.proc.send_signal(signal.SIGTERM)
                assert await edge.wait_exit() == 0
            nursery.cancel_scope.cancel()
    everything = {
        "edge": edge.output,
        "node": node.output,
        "bad-node": bad.output,
        "responses": "\n".join(outputs),
    }
    # The leaky provider's error (headers echoed) did reach the daemons' logs.
    assert "authorization" in (edge.output + node.output).lower()
    assert "event=request" in edge.output
    for canary in canaries:
        for where, text in everything.items():
            assert canary not in text, f"{canary!r} leaked into {where}"
