"""The node decides what it runs: its consent to pushed providers, and the legacy proof.

Unit level: ``Consent.refusal`` (argv prefixes, origins as the provider
client parses them), the config checks of the keys, the executor applying
the rest of a push and reporting the refused providers, the handshake
refusing a ``Challenge`` keyed by ``sha256(token)``.  The same with real
processes is in ``test_consent_subprocess.py``.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import trio
import trio.testing

import iopd.node.edges.link as link_mod
from iopd.config.load import ConfigError, parse_node_config
from iopd.config.schema import NodeSection
from iopd.node.consent import REFUSED_PREFIX, Consent
from iopd.node.edges.link import NodeLink
from iopd.node.executor import NodeExecutor
from tests.support.gateway import running_gateway, wait_until
from tests.support.node_parts import ScriptedHandler
from tests.support.wire_peers import FakeEdge
from wire.messages import NodeConfig, ProviderSpec

TOKEN = "node-consent-token"


def cli(pid: str, command: list[str], health: list[str] | None = None) -> ProviderSpec:
    return ProviderSpec(id=pid, type="cli", command=command, health_command=health)


def http(pid: str, base_url: str) -> ProviderSpec:
    return ProviderSpec(id=pid, type="openai", base_url=base_url)


# ------------------------------------------------------------------ commands


def test_no_command_runs_without_consent() -> None:
    why = Consent().refusal(cli("p", ["sh", "-c", "id > /tmp/x"]))
    assert why is not None and why.startswith(REFUSED_PREFIX)
    assert "node.allowed_commands" in why and "'sh'" in why
    assert "id > /tmp/x" not in why  # the arguments never reach a log line


def test_a_command_must_start_with_an_allowed_prefix_element_by_element() -> None:
    consent = Consent(commands=(("ollama", "run"),))
    assert consent.refusal(cli("p", ["ollama", "run", "qwen3"])) is None
    assert consent.refusal(cli("p", ["ollama", "run"])) is None
    assert consent.refusal(cli("p", ["ollama", "serve"])) is not None
    assert consent.refusal(cli("p", ["ollama"])) is not None  # shorter than the prefix
    assert consent.refusal(cli("p", ["ollama", "runner"])) is not None  # no string prefix
    assert consent.refusal(cli("p", ["sh", "-c", "ollama run x"])) is not None


def test_the_health_command_needs_consent_too() -> None:
    consent = Consent(commands=(("claude", "-p"),))
    assert consent.refusal(cli("p", ["claude", "-p"], ["claude", "--version"])) is not None
    why = consent.refusal(cli("p", ["claude", "-p"], ["sh", "-c", "touch /tmp/y"]))
    assert why is not None and "health_command" in why
    both = Consent(commands=(("claude", "-p"), ("claude", "--version")))
    assert both.refusal(cli("p", ["claude", "-p", "--x"], ["claude", "--version"])) is None


# ------------------------------------------------------------------- origins


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8000", "http://127.9.9.9/v1", "http://[::1]:11434", "http://LOCALHOST:1"],
)
def test_loopback_origins_by_default(url: str) -> None:
    assert Consent().refusal(http("p", url)) is None


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.5:8000",
        "https://api.example.com",
        "http://0.0.0.0:8000",
        "http://127.0.0.1@evil.example:80",  # the client dials the host after the '@'
        "http://localhost.evil.example",
    ],
)
def test_other_origins_are_refused_by_default(url: str) -> None:
    why = Consent().refusal(http("p", url))
    assert why is not None and "node.allowed_provider_origins" in why


def test_listed_origins_replace_the_loopback_default() -> None:
    section = NodeSection(
        id="n",
        token="t",
        edge="e:1",
        allowed_provider_origins=["https://api.example.com", "http://10.0.0.5:8000"],
    )
    consent = Consent.of_node(section)
    assert consent.refusal(http("p", "https://api.example.com/v1")) is None
    assert consent.refusal(http("p", "https://API.example.com:443")) is None  # default port
    assert consent.refusal(http("p", "http://10.0.0.5:8000/x")) is None
    assert consent.refusal(http("p", "http://api.example.com")) is not None  # scheme differs
    assert consent.refusal(http("p", "http://10.0.0.5:8001")) is not None  # port differs
    assert consent.refusal(http("p", "http://127.0.0.1:8000")) is not None  # not listed


def test_a_base_url_the_client_cannot_dial_is_refused() -> None:
    for url in ("ftp://127.0.0.1", "http://127.0.0.1:99999", "not a url"):
        assert Consent().refusal(http("p", url)) is not None


def test_echo_needs_nothing() -> None:
    assert Consent().refusal(ProviderSpec(id="e", type="echo")) is None


def test_listed_consents_to_exactly_what_is_listed() -> None:
    listed = [
        cli("c", ["agent", "--print"], ["agent", "--version"]),
        http("h", "http://10.1.2.3:8000"),
    ]
    consent = Consent.listed(listed)
    assert all(consent.refusal(s) is None for s in listed)
    assert consent.refusal(cli("c", ["sh", "-c", "id"])) is not None
    assert consent.refusal(http("h", "http://10.1.2.4:8000")) is not None


# -------------------------------------------------------------------- config

NODE_YAML = """\
node:
  id: n
  token: t
  edge: 127.0.0.1:7070
  allowed_commands: {commands}
  allowed_provider_origins: {origins}
"""


def test_config_accepts_the_keys() -> None:
    cfg = parse_node_config(
        NODE_YAML.format(commands="[[ollama, run]]", origins='["https://api.example.com"]'),
        env={},
    )
    assert cfg.node.allowed_commands == [["ollama", "run"]]
    assert cfg.node.accept_legacy_proof is False


@pytest.mark.parametrize(
    ("commands", "origins", "path"),
    [
        ("[[]]", "[]", "node.allowed_commands[0]"),
        ('[[""]]', "[]", "node.allowed_commands[0]"),
        ("[[bin/tool]]", "[]", "node.allowed_commands[0]"),
        ("[[./tool]]", "[]", "node.allowed_commands[0]"),
        ("[]", '["https://api.example.com/v1"]', "node.allowed_provider_origins[0]"),
        ("[]", '["api.example.com:443"]', "node.allowed_provider_origins[0]"),
        ("[]", '["http://user@host"]', "node.allowed_provider_origins[0]"),
        ("[]", '["http://host:99999"]', "node.allowed_provider_origins[0]"),
    ],
)
def test_config_names_the_bad_entry(commands: str, origins: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_node_config(NODE_YAML.format(commands=commands, origins=origins), env={})
    assert any(line.startswith(path + ":") for line in info.value.errors), info.value.errors


# ------------------------------------------------------------------ executor


async def test_a_refused_provider_is_never_built_and_reported_the_rest_applies() -> None:
    executor = NodeExecutor(consent=Consent(commands=(("agent",),)))
    push = NodeConfig(
        stream_id=1,
        version=1,
        providers=[
            ProviderSpec(id="echo", type="echo"),
            cli("ok", ["agent", "--print"]),
            cli("rogue", ["sh", "-c", "id > /tmp/never"]),
            http("far", "http://10.0.0.9:8000"),
        ],
    )
    ack = await executor.on_config(push)
    assert ack.ok
    assert executor.registry is not None
    assert set(executor.registry.adapters) == {"echo", "ok"}
    status = {h.provider_id: h for h in executor.current_status().providers}
    assert set(status) == {"echo", "ok", "rogue", "far"}
    for pid in ("rogue", "far"):
        assert status[pid].health == "unhealthy"
        assert status[pid].last_error.startswith(REFUSED_PREFIX)
    assert status["echo"].health == "unknown"
    # The same push again keeps the registry (nothing rebuilt, nothing restarted).
    registry = executor.registry
    await executor.on_config(push)
    assert executor.registry is registry
    await registry.aclose()


async def test_consent_is_asked_at_each_push() -> None:
    allowed: list[Consent] = [Consent()]
    executor = NodeExecutor(consent=lambda: allowed[0])
    push = NodeConfig(stream_id=1, version=1, providers=[cli("c", ["agent"])])
    await executor.on_config(push)
    assert executor.registry is not None and not executor.registry.adapters
    allowed[0] = Consent(commands=(("agent",),))
    await executor.on_config(NodeConfig(stream_id=2, version=2, providers=[cli("c", ["agent"])]))
    assert executor.registry is not None and set(executor.registry.adapters) == {"c"}
    await executor.registry.aclose()


# ----------------------------------------------------------------- handshake


async def test_the_legacy_proof_is_refused_by_default_and_retried_slowly(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    handler = ScriptedHandler()
    with trio.fail_after(1000):
        async with FakeEdge.in_memory(token=TOKEN, secret="token_sha256") as edge:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(link_mod, "dial", edge.dial)
                link = NodeLink(
                    NodeSection(
                        id="node-a",
                        edge="edge:7070",
                        token=TOKEN,
                        reconnect_initial_backoff=0.5,
                        reconnect_max_backoff=8.0,
                    ),
                    handler,
                    software_version="1",
                    rng=lambda: 1.0,
                )
                async with trio.open_nursery() as nursery:
                    await nursery.start(link.run)
                    await wait_until(lambda: len(edge.hellos) >= 3)
                    nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in zip(edge.dial_times, edge.dial_times[1:], strict=False)]
    assert gaps[:2] == pytest.approx([8.0, 8.0])
    assert not link.connected and link.sessions == 0
    assert not handler.configs
    line = next(r.getMessage() for r in caplog.records if "edge_legacy_proof_refused" in r.getMessage())
    assert "token_verifier" in line and "node.accept_legacy_proof" in line
    assert TOKEN not in caplog.text


async def test_the_legacy_proof_is_answered_when_the_node_allows_it() -> None:
    handler = ScriptedHandler()
    with trio.fail_after(10):
        async with FakeEdge.serve(token=TOKEN, secret="token_sha256") as edge:
            link = NodeLink(
                NodeSection(id="node-a", edge=edge.address, token=TOKEN, accept_legacy_proof=True),
                handler,
                software_version="1",
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run)
                await edge.accept()
                assert link.connected
                nursery.cancel_scope.cancel()


# -------------------------------------------------------------- edge status

EDGE_YAML = """\
edge: {{id: e, node_listen: 127.0.0.1:0, admin_listen: 127.0.0.1:0}}
models:
  - id: m
    providers: {{agent: m, echo-1: m}}
nodes:
  - id: node-1
    token_hash_sha256: {hash}
    providers:
      - {{id: agent, type: cli, models: [m], command: [sh, -c, "touch {marker}"]}}
      - {{id: echo-1, type: echo, models: [m]}}
"""


async def test_the_edge_shows_the_refusal_in_status(tmp_path: Path) -> None:
    from tests.support.gateway import get_json, node_token, token_hash

    marker = tmp_path / "ran"
    yaml_text = EDGE_YAML.format(hash=token_hash(node_token("node-1")), marker=marker)
    with trio.fail_after(30):
        async with running_gateway(yaml_text, nodes=[]) as gw:
            # The node's operator allows no command; the legacy proof for this edge.
            await gw.start_node("node-1", allowed_commands=[], accept_legacy_proof=True)

            async def rows() -> dict[str, dict[str, str]]:
                doc = await get_json(gw.handle.admin, "/status")
                return {p["id"]: p for p in doc["providers"]}

            while (await rows())["agent"]["health"] != "unhealthy":  # noqa: ASYNC110
                await trio.sleep(0.02)
            agent = (await rows())["agent"]
            assert agent["last_error"].startswith(REFUSED_PREFIX)
            assert "node.allowed_commands" in agent["last_error"]
            assert not marker.exists()


async def test_the_edge_says_why_a_node_hangs_up_on_its_legacy_challenge(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.support.gateway import _run_node_scoped, node_token, token_hash

    caplog.set_level(logging.INFO)
    yaml_text = EDGE_YAML.format(hash=token_hash(node_token("node-1")), marker=tmp_path / "ran")
    with trio.fail_after(30):
        async with running_gateway(yaml_text, nodes=[]) as gw:
            cfg = gw.node_config("node-1", accept_legacy_proof=False)
            await gw.nursery.start(functools.partial(_run_node_scoped, cfg))
            await wait_until(lambda: "node_left_legacy_handshake" in caplog.text)
            assert gw.runtime.hub.connected_since("node-1") is None
    edge_line = next(
        r.getMessage() for r in caplog.records if "node_left_legacy_handshake" in r.getMessage()
    )
    assert "token_verifier" in edge_line and "node.accept_legacy_proof" in edge_line
    assert "edge_legacy_proof_refused" in caplog.text  # the node's own line
