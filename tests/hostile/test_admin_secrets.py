"""The admin Host, cut keys, caller headers upstream: replayed on a real edge + node.

* DNS rebinding: the admin API answers only loopback ``Host``
  values; with ``edge.admin_token_hash_sha256`` every route but ``/healthz``
  wants the bearer.
* A cut key: a provider error body cut at 512 bytes inside the
  provider's key leaks no 8-character piece of it, to the caller or a log.
* Caller headers upstream: only the allow-list (plus
  ``openai.forward_headers``) reaches a passthrough provider.

The scrubber itself (``iopd.redact``) is checked here against a naive
reference on random texts.
"""

from __future__ import annotations

import json
import logging
import random

import pytest
import trio

from iopd.redact import MIN_RUN, Scrubber
from tests.support.configs import gateway_yaml, node_entry, provider_entry
from tests.support.gateway import http_request, node_token, running_gateway, token_hash
from tests.support.mock_providers import MockOllamaServer, MockReply, RecordedRequest

#: A provider key long enough to be cut 100 characters in.
LONG_KEY = "sk-cut-canary-" + "".join(
    random.Random(7).choices("abcdefghjkmnpqrstuvwxyz23456789", k=110)
)


def pieces_of(secret: str, text: str) -> list[str]:
    """Every ``MIN_RUN``-character piece of ``secret`` found in ``text``."""
    return [
        secret[i : i + MIN_RUN]
        for i in range(len(secret) - MIN_RUN + 1)
        if secret[i : i + MIN_RUN] in text
    ]


# ------------------------------------------------------------------ the scrubber


def _naive_scrub(text: str, secrets: list[str]) -> str:
    """Mark every run of 8+ characters of a secret (short ones whole), the slow way."""
    covered = [False] * len(text)
    for secret in secrets:
        if len(secret) < 4:
            continue
        if len(secret) < MIN_RUN:
            at = text.find(secret)
            while at >= 0:
                covered[at : at + len(secret)] = [True] * len(secret)
                at = text.find(secret, at + len(secret))
            continue
        for i in range(len(text)):
            for j in range(i + MIN_RUN, len(text) + 1):
                if text[i:j] not in secret:
                    break
                covered[i:j] = [True] * (j - i)
    out, i = [], 0
    while i < len(text):
        if covered[i]:
            while i < len(text) and covered[i]:
                i += 1
            out.append("***")
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


@pytest.mark.parametrize("cut", [9, 12, 100, len(LONG_KEY)])
def test_a_key_cut_inside_a_message_is_scrubbed(cut: int) -> None:
    scrubber = Scrubber([LONG_KEY])
    message = f"provider returned status 401: {{'error': 'bad key Bearer {LONG_KEY[:cut]}"
    clean = scrubber.scrub(message)
    assert pieces_of(LONG_KEY, clean) == []
    assert clean == "provider returned status 401: {'error': 'bad key Bearer ***"


def test_a_piece_from_the_middle_and_two_keys_side_by_side() -> None:
    other = "another-provider-secret-0987654321"
    scrubber = Scrubber([LONG_KEY, other, None, ""])
    assert scrubber.scrub(f"x {LONG_KEY[20:28]} y") == "x *** y"
    assert scrubber.scrub(f"[{LONG_KEY[3:40]}{other[5:]}]") == "[***]"
    assert scrubber.scrub(f"{LONG_KEY[:7]} stays") == f"{LONG_KEY[:7]} stays"


def test_a_message_without_a_secret_is_returned_unchanged() -> None:
    scrubber = Scrubber([LONG_KEY, "short1"])
    message = "provider returned status 500: upstream overloaded, retry later"
    assert scrubber.scrub(message) is message
    assert Scrubber([]).scrub(message) is message


def test_short_secrets_are_scrubbed_whole_and_tiny_ones_not_at_all() -> None:
    scrubber = Scrubber(["pw1234", "t"])
    assert scrubber.scrub("token pw1234 and pw12") == "token *** and pw12"


def test_the_scrubber_matches_a_naive_reference() -> None:
    rng = random.Random(14)
    for _ in range(2000):
        secrets = ["".join(rng.choices("abcd", k=rng.randint(1, 20))) for _ in range(3)]
        text = "".join(rng.choices("abcdxy", k=rng.randint(0, 60)))
        if rng.random() < 0.5:
            a = rng.randint(0, len(secrets[0]))
            text = text[:10] + secrets[0][a : rng.randint(a, len(secrets[0]))] + text[10:]
        assert Scrubber(secrets).scrub(text) == _naive_scrub(text, secrets), (secrets, text)


# ------------------------------------------------- a cut key, end to end

def secrets_yaml(base: str, key: str) -> str:
    """Model ``ol`` on one Ollama provider at ``base`` whose ``api_key`` is ``key``."""
    ollama = provider_entry(
        "ol-1",
        "ollama",
        base_url=base,
        api_key=key,
        models='["mock:latest"]',
        capacity=4,
        health_interval=0.2,
    )
    return gateway_yaml(
        edge_id="edge-secrets",
        pool="provider_pool: {max_queue: 8, queue_timeout: 5}",
        models='  - id: ol\n    providers: {ol-1: "mock:latest"}',
        nodes=node_entry("node-a", ollama),
    )


@pytest.mark.parametrize("cut", [9, 12, 100])
async def test_an_error_body_cut_inside_the_key_leaks_no_piece_of_it(
    cut: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The node quotes 512 bytes of the provider's error body; the cut lands in the key."""
    caplog.set_level(logging.DEBUG)

    def leaky(req: RecordedRequest) -> MockReply | None:
        if req.path == "/api/tags":
            return None  # healthy
        echoed = (req.header("authorization") or "").removeprefix("Bearer ")
        assert echoed == LONG_KEY
        return MockReply(status=401, body=b"e" * (512 - cut) + echoed.encode())

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            mock = await nursery.start(MockOllamaServer().serve)
            mock.handler = leaky
            yaml_text = secrets_yaml(mock.base_url, LONG_KEY)
            async with running_gateway(yaml_text) as gw:
                body = {"model": "ol", "messages": [{"role": "user", "content": "hi"}]}
                r = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)
                assert r.status == 502
                message = r.json()["error"]["message"]
                assert message.endswith("e***"), message  # the cut key, scrubbed
                assert pieces_of(LONG_KEY, r.body.decode()) == []
            nursery.cancel_scope.cancel()
    assert "event=provider_error" in caplog.text
    assert pieces_of(LONG_KEY, caplog.text) == []
    assert pieces_of(LONG_KEY, json.dumps([repr(rec.args) for rec in caplog.records])) == []


# ------------------------------------------------- caller headers, end to end

HEADERS_YAML = """
edge:
  id: edge-headers
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
  forward_headers: [{forward}]
provider_pool: {{max_queue: 8, queue_timeout: 5}}
models:
  - id: pt
    providers: {{oa-1: mock-model}}
nodes:
  - id: node-a
    token_hash_sha256: {node_hash}
    providers:
      - id: oa-1
        type: openai
        base_url: {base}
        api_key: {key}
        models: [mock-model]
        capacity: 4
"""

#: What a hostile or careless caller sends along with a passthrough request.
CALLER_HEADERS = [
    ("Accept", "application/json"),
    ("OpenAI-Beta", "assistants=v2"),
    ("OpenAI-Organization", "org-1"),
    ("OpenAI-Project", "proj-1"),
    ("X-Request-Id", "caller-req-1"),
    ("Idempotency-Key", "idem-1"),
    ("User-Agent", "caller-agent/1.0"),
    ("X-Trace", "trace-1"),
    ("X-Nominated", "hop"),
    ("Connection", "close, x-nominated, user-agent"),
    ("Cookie", "session=caller-cookie"),
    ("Forwarded", "for=203.0.113.9"),
    ("X-Forwarded-For", "203.0.113.9"),
    ("X-Forwarded-Host", "internal.example"),
    ("X-Forwarded-Proto", "https"),
    ("X-Real-IP", "203.0.113.9"),
    ("X-Original-URL", "/admin"),
    ("Via", "1.1 caller-proxy"),
    ("Accept-Encoding", "gzip"),
    ("Content-Encoding", "gzip"),
    ("Proxy-Authorization", "Basic Y2FsbGVy"),
    ("Expect", "100-continue"),
    ("Authorization", "Bearer caller-token"),
    ("X-Provider-Authorization", "Bearer caller-provider-key"),
]


async def test_only_allow_listed_caller_headers_reach_the_provider() -> None:
    """Through a real edge + node: exactly which headers the provider receives."""
    received: list[RecordedRequest] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            from tests.support.mock_providers import MockOpenAIServer

            mock = await nursery.start(MockOpenAIServer().serve)

            def record(req: RecordedRequest) -> MockReply | None:
                if req.method == "POST":
                    received.append(req)
                return None

            mock.handler = record
            yaml_text = HEADERS_YAML.format(
                forward="X-Trace",
                node_hash=token_hash(node_token("node-a")),
                base=mock.base_url,
                key="sk-node-provider-key-77aa",
            )
            async with running_gateway(yaml_text) as gw:
                body = json.dumps(
                    {"model": "pt", "messages": [{"role": "user", "content": "hi"}]}
                ).encode()
                head = "POST /v1/chat/completions HTTP/1.1\r\n" + "".join(
                    f"{k}: {v}\r\n" for k, v in CALLER_HEADERS
                )
                head += f"Host: edge.example\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n"
                stream = await trio.open_tcp_stream(*gw.host_port)
                async with stream:
                    await stream.send_all(head.encode() + body)
                    reply = b""
                    while chunk := await stream.receive_some(65536):
                        reply += chunk
                # (After the 100 Continue that the caller's Expect asked for.)
                assert b"\r\n\r\nHTTP/1.1 200 " in reply, reply[:200]
            nursery.cancel_scope.cancel()
    [sent] = received
    names = sorted(k for k, _ in sent.headers)
    assert names == sorted(
        [
            "host",
            "content-length",
            "content-type",
            "authorization",
            "accept",
            "openai-beta",
            "openai-organization",
            "openai-project",
            "x-request-id",
            "idempotency-key",
            "x-trace",
        ]
    ), names
    assert sent.header("content-type") == "application/json"
    assert sent.header("authorization") == "Bearer caller-provider-key"  # provider_auth mapping
    assert sent.header("x-request-id") == "caller-req-1"
    assert sent.header("x-trace") == "trace-1"
    assert sent.header("host") != "edge.example"
    assert json.loads(sent.body)["model"] == "mock-model"  # plain JSON, not gzip


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("Cookie", "credentials"),
        ("authorization", "credentials"),
        ("Host", "host"),
        ("X-Forwarded-For", "forwarding"),
        ("Forwarded", "forwarding"),
        ("X-Original-URL", "forwarding"),
        ("Proxy-Authorization", "forwarding"),
        ("Connection", "hop-by-hop"),
        ("Transfer-Encoding", "hop-by-hop"),
        ("Content-Encoding", "framing"),
        ("Content-Length", "framing"),
        ("Accept-Encoding", "framing"),
        ("X-Provider-Authorization", "provider_auth.header"),
        ("bad header", "valid HTTP header name"),
        ("", "valid HTTP header name"),
    ],
)
def test_forward_headers_refuses_unsafe_names(name: str, reason: str) -> None:
    from iopd.config.load import ConfigError, parse_edge_config

    text = HEADERS_YAML.format(
        forward=f'"ok-header", "{name}"',
        node_hash=token_hash(node_token("node-a")),
        base="http://127.0.0.1:9",
        key="k",
    )
    with pytest.raises(ConfigError) as info:
        parse_edge_config(text, env={})
    [line] = info.value.errors
    assert line.startswith("openai.forward_headers[1]: ") and reason in line, line


def test_forward_headers_is_live_on_refresh() -> None:
    from iopd.config.load import parse_edge_config
    from iopd.config.refresh_classify import classify

    def cfg(forward: str) -> object:
        return parse_edge_config(
            HEADERS_YAML.format(
                forward=forward,
                node_hash=token_hash(node_token("node-a")),
                base="http://127.0.0.1:9",
                key="k",
            ),
            env={},
        )

    diff = classify(cfg(""), cfg("X-Trace"))  # type: ignore[arg-type]
    assert diff.restart_required == []
