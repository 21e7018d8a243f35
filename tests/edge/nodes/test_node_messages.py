"""What an authenticated node's messages can make the edge do is bounded.

The decode step refuses an absurd ``ProviderStatus`` at its array header;
the apply step touches only the node's configured providers (one entry per
id, unknown ids counted and logged once per session); every free-text
string the edge keeps, relays or logs is cut to its documented size.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import msgspec
import pytest
import trio
import trio.testing

from iopd.config.load import ConfigError, parse_edge_config
from iopd.edge.nodes.hub import NodeHub
from iopd.edge.nodes.node_session import NodeSession
from iopd.edge.nodes.node_text import (
    CUT_MARK,
    MAX_ERROR_CODE_CHARS,
    MAX_FINISH_REASON_CHARS,
    MAX_LAST_ERROR_CHARS,
    MAX_NODE_MESSAGE_CHARS,
    MODEL_TEXT_BUDGET,
    bounded,
    bounded_models,
    cut,
    needs_bounding,
    safe_node_reason,
    scrubbed_message,
)
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from iopd.edge.runtime.health_state import HEALTH_LOG_BURST, HEALTH_LOG_WINDOW
from iopd.transport.channel import WireChannel
from tests.support.gateway import node_token, token_hash
from wire.errors import MalformedFrame
from wire.framing import MAX_FRAME_BYTES, FrameDecoder, encode_frame
from wire.messages import (
    MAX_DIGEST_CHARS,
    MAX_LOAD_ENTRIES,
    MAX_MODEL_FAMILIES,
    MAX_MODEL_TEXT_CHARS,
    MAX_PROVIDER_ID_CHARS,
    MAX_STATUS_ENTRIES,
    LoadReport,
    ModelDetails,
    ModelInfo,
    NodeConfig,
    NodeConfigState,
    ProviderHealth,
    ProviderSpec,
    ProviderStatus,
    ProviderTunnelFrame,
    RunEvent,
    SlotLoad,
    node_config_digest,
)

KEY = "sk-live-0123456789abcdefghij"


def edge_yaml(*, extra_providers: str = "") -> str:
    return f"""
edge: {{id: edge-msgs, node_listen: 127.0.0.1:0, admin_listen: 127.0.0.1:0}}
openai: {{listen: 127.0.0.1:0}}
models:
  - id: m
    providers: {{p1: m, p2: m, q1: m}}
nodes:
  - id: node-a
    token_hash_sha256: {token_hash(node_token("node-a"))}
    providers:
      - {{id: p1, type: openai, base_url: "http://127.0.0.1:9", models: [m], api_key: {KEY}}}
      - {{id: p2, type: echo, models: [m]}}
{extra_providers}
  - id: node-b
    token_hash_sha256: {token_hash(node_token("node-b"))}
    providers:
      - {{id: q1, type: echo, models: [m]}}
"""


def runtime() -> EdgeRuntime:
    return EdgeRuntime.create(parse_edge_config(edge_yaml(), env={}))


# ------------------------------------------------------------------ decode


def test_status_with_too_many_entries_is_refused_at_decode() -> None:
    entries = [ProviderHealth(provider_id=f"x{i}") for i in range(MAX_STATUS_ENTRIES + 1)]
    raw = encode_frame(ProviderStatus(providers=entries))
    # As the edge's connection decodes it: a MalformedFrame closes the session.
    with pytest.raises(MalformedFrame, match=f"length <= {MAX_STATUS_ENTRIES}"):
        FrameDecoder(MAX_FRAME_BYTES).feed(raw)


def test_status_at_the_cap_decodes() -> None:
    entries = [ProviderHealth(provider_id=f"x{i}") for i in range(MAX_STATUS_ENTRIES)]
    raw = encode_frame(ProviderStatus(providers=entries))
    assert len(msgspec.msgpack.decode(raw[4:], type=ProviderStatus).providers) == MAX_STATUS_ENTRIES


def test_status_with_an_absurd_provider_id_is_refused_at_decode() -> None:
    raw = encode_frame(
        ProviderStatus(providers=[ProviderHealth(provider_id="p" * (MAX_PROVIDER_ID_CHARS + 1))])
    )
    with pytest.raises(msgspec.ValidationError, match="length <= 256"):
        msgspec.msgpack.decode(raw[4:], type=ProviderStatus)


def test_a_long_last_error_is_not_a_reason_to_refuse() -> None:
    msg = ProviderStatus(providers=[ProviderHealth(provider_id="p1", last_error="e" * 100_000)])
    raw = encode_frame(msg)
    assert msgspec.msgpack.decode(raw[4:], type=ProviderStatus) == msg


# ------------------------------------------------------------------- apply


async def test_apply_touches_only_the_nodes_own_providers() -> None:
    rt = runtime()
    msg = ProviderStatus(
        providers=[
            *[ProviderHealth(provider_id=f"ghost-{i}", health="unhealthy") for i in range(1000)],
            ProviderHealth(provider_id="q1", health="unhealthy"),  # node-b's
            ProviderHealth(provider_id="p2", health="healthy"),
        ]
    )
    assert rt.provider_status("node-a", msg) == 1001
    assert set(rt.health) == {"p2"}
    assert rt.health["p2"].health == "healthy"


async def test_apply_keeps_the_last_entry_per_id_and_logs_a_change_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = runtime()
    flips = [
        ProviderHealth(provider_id="p2", health="unhealthy" if i % 2 else "healthy")
        for i in range(MAX_STATUS_ENTRIES)
    ]
    with caplog.at_level(logging.INFO, logger="iopd.edge"):
        assert rt.provider_status("node-a", ProviderStatus(providers=flips)) == 0
    assert rt.health["p2"].health == "unhealthy"  # the last entry
    changes = [r for r in caplog.records if "event=provider_health" in r.getMessage()]
    assert len(changes) == 1


async def test_apply_cuts_and_scrubs_last_error() -> None:
    rt = runtime()
    text = f"upstream said: Bearer {KEY} " + "x" * 1_000_000
    rt.provider_status(
        "node-a",
        ProviderStatus(
            providers=[ProviderHealth(provider_id="p1", health="unhealthy", last_error=text)]
        ),
    )
    kept = rt.health["p1"].last_error
    assert len(kept) <= MAX_LAST_ERROR_CHARS
    assert kept.endswith(CUT_MARK)
    assert KEY[:8] not in kept and "***" in kept
    doc = msgspec.json.encode(rt.status())
    assert len(doc) < 16_000  # /status stays small


async def test_a_secret_split_by_the_cut_is_still_masked() -> None:
    rt = runtime()
    # The cut falls inside the key: its kept part (8+ characters) is masked.
    text = "e" * (MAX_LAST_ERROR_CHARS - len(CUT_MARK) - 12) + KEY
    rt.provider_status(
        "node-a",
        ProviderStatus(
            providers=[ProviderHealth(provider_id="p1", health="unhealthy", last_error=text)]
        ),
    )
    kept = rt.health["p1"].last_error
    assert KEY[:12] not in kept and KEY[:8] not in kept


async def test_apply_keeps_the_served_models_only_cut_and_scrubbed() -> None:
    rt = runtime()
    near_cap = "d" * (MAX_MODEL_TEXT_CHARS - len(KEY)) + KEY
    served = ModelInfo(
        name="m", size=5, digest=near_cap, details=ModelDetails(families=["llama", near_cap])
    )
    elsewhere = ModelInfo(name="not-in-the-config")
    entries = [ProviderHealth(provider_id="p1", models=[elsewhere, served, ModelInfo(name="m")])]
    rt.provider_status("node-a", ProviderStatus(providers=entries))
    (kept,) = rt.health["p1"].models.values()  # the first entry of a served name
    assert kept.name == "m" and kept.size == 5
    assert KEY[:8] not in kept.digest and "***" in kept.digest
    assert kept.details.families[0] == "llama" and KEY[:8] not in kept.details.families[1]
    # Another node's report of p1 changes nothing.
    rt.provider_status("node-b", ProviderStatus(providers=[ProviderHealth(provider_id="p1")]))
    assert list(rt.health["p1"].models) == ["m"]


def test_bounded_models_cuts_every_string() -> None:
    long = "x" * 10_000  # past the wire's bound: the edge's own cut still holds
    info = ModelInfo(name="m", modified_at=long, details=ModelDetails(family=long))
    kept_models, left = bounded_models([info], ["m"], lambda t: t)
    (kept,) = kept_models.values()
    assert len(kept.modified_at) == MAX_MODEL_TEXT_CHARS and kept.modified_at.endswith(CUT_MARK)
    assert len(kept.details.family) == MAX_MODEL_TEXT_CHARS
    assert left == MODEL_TEXT_BUDGET - 2 * MAX_MODEL_TEXT_CHARS


def test_a_status_keeps_at_most_its_budget_of_model_text() -> None:
    text = "t" * MAX_MODEL_TEXT_CHARS
    per_model = 15 * MAX_MODEL_TEXT_CHARS  # 7 strings and 8 families
    info = ModelDetails(
        format=text,
        family=text,
        families=[text] * MAX_MODEL_FAMILIES,
        parameter_size=text,
        quantization_level=text,
        parent_model=text,
    )
    models = [
        ModelInfo(name=f"m{i}", digest=text, modified_at=text, details=info) for i in range(64)
    ]
    kept, left = bounded_models(models, [m.name for m in models], lambda t: t)
    assert len(kept) == MODEL_TEXT_BUDGET // per_model < len(models)
    assert left == MODEL_TEXT_BUDGET % per_model
    scrubbed: list[str] = []
    later, _ = bounded_models(models, ["m0"], lambda t: scrubbed.append(t) or t, budget=left)
    assert later == {} and scrubbed == []  # nothing past the budget is scrubbed


async def test_refused_by_node_status_still_applies() -> None:
    rt = runtime()
    reason = "refused by node: type openai is not allowed here"
    rt.provider_status(
        "node-a",
        ProviderStatus(
            providers=[ProviderHealth(provider_id="p1", health="unhealthy", last_error=reason)]
        ),
    )
    assert (rt.health["p1"].health, rt.health["p1"].last_error) == ("unhealthy", reason)


# -------------------------------------------------------------- the hub side


class _CountingOwner:
    def __init__(self, ignored: int) -> None:
        self.ignored = ignored
        self.calls = 0

    def provider_status(self, node_id: str, msg: ProviderStatus) -> int:
        self.calls += 1
        return self.ignored


def test_ignored_entries_are_logged_once_per_session(caplog: pytest.LogCaptureFixture) -> None:
    owner = _CountingOwner(ignored=400)
    hub = NodeHub(cast(Any, None), cast(Any, owner))
    channel = cast(WireChannel, None)
    first, second = NodeSession("node-a", channel, "p:1"), NodeSession("node-a", channel, "p:2")
    with caplog.at_level(logging.INFO, logger="iopd.edge.nodes"):
        for _ in range(50):
            hub._provider_status(first, ProviderStatus())
        hub._provider_status(second, ProviderStatus())
    lines = [r for r in caplog.records if "event=provider_status_ignored" in r.getMessage()]
    assert len(lines) == 2  # one per session
    assert "entries=400" in lines[0].getMessage()
    assert (first.status_ignored, second.status_ignored, owner.calls) == (20_000, 400, 51)


def test_hub_counts_nothing_when_nothing_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    hub = NodeHub(cast(Any, None), cast(Any, _CountingOwner(ignored=0)))
    session = NodeSession("node-a", cast(WireChannel, None), "p:1")
    with caplog.at_level(logging.INFO, logger="iopd.edge.nodes"):
        hub._provider_status(session, ProviderStatus())
    assert session.status_ignored == 0
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]


# ----------------------------------------------------------- relayed strings


def _scrub(text: str) -> str:
    return text.replace(KEY, "***")


@pytest.mark.parametrize("kind", ["run", "tunnel"])
def test_relayed_error_message_and_code_are_cut(kind: str) -> None:
    message, code = f"{KEY} " + "m" * 5_000_000, "c" * 10_000
    msg: RunEvent | ProviderTunnelFrame = (
        RunEvent(stream_id=1, kind="error", code=code, message=message)
        if kind == "run"
        else ProviderTunnelFrame(stream_id=1, kind="error", code=code, message=message)
    )
    out = scrubbed_message(msg, _scrub)
    assert len(out.message) == MAX_NODE_MESSAGE_CHARS - len(KEY) + 3
    assert out.message.startswith("*** m") and KEY not in out.message
    assert len(out.code) == MAX_ERROR_CODE_CHARS


def test_a_finish_reason_is_cut() -> None:
    msg = RunEvent(stream_id=1, kind="complete", finish_reason="f" * 1_000_000)
    assert needs_bounding(msg)
    out = scrubbed_message(msg, _scrub)
    assert isinstance(out, RunEvent) and out.finish_reason is not None
    assert len(out.finish_reason) == MAX_FINISH_REASON_CHARS
    plain = RunEvent(stream_id=1, kind="complete", finish_reason="stop")
    text = RunEvent(stream_id=1, kind="text", text="t" * 100_000)
    assert not needs_bounding(plain) and not needs_bounding(text)


def test_a_short_error_is_kept_as_it_is() -> None:
    msg = RunEvent(stream_id=1, kind="error", code="provider_timeout", message="read timed out")
    assert scrubbed_message(msg, _scrub) is msg


def test_config_ack_reason_is_cut_before_it_is_scanned() -> None:
    pushed = NodeConfig(
        stream_id=1, version=1, providers=[ProviderSpec(id="p1", type="openai", api_key=KEY)]
    )
    reason = safe_node_reason(f"bad key {KEY}\n" + "r" * 8_000_000, pushed)
    assert len(reason) <= 200 and KEY[:8] not in reason and "<redacted>" in reason


def test_cut_and_bounded() -> None:
    assert cut("short", 10) == "short"
    s = "x" * 11
    assert cut(s, 10) == "x" * 7 + CUT_MARK
    same = "abc"
    assert cut(same, 3) is same
    assert bounded("y" * 50, 10, str.upper) == "YYYYYYY..."


# ------------------------------------------------------------------ config


def _problems(yaml_text: str) -> list[str]:
    """The config errors of ``yaml_text`` ("path: reason"), none when it loads."""
    try:
        parse_edge_config(yaml_text, env={})
    except ConfigError as exc:
        return exc.errors
    return []


def test_config_refuses_more_providers_than_one_status_carries() -> None:
    extra = "\n".join(
        f"      - {{id: e{i}, type: echo, models: [m]}}" for i in range(MAX_STATUS_ENTRIES)
    )
    assert [p.split(":")[0] for p in _problems(edge_yaml(extra_providers=extra))] == [
        "nodes[0].providers"
    ]


def test_config_refuses_a_provider_id_longer_than_the_wire_carries() -> None:
    extra = f"      - {{id: {'l' * (MAX_PROVIDER_ID_CHARS + 1)}, type: echo, models: [m]}}"
    assert [p.split(":")[0] for p in _problems(edge_yaml(extra_providers=extra))] == [
        "nodes[0].providers[2].id"
    ]
    assert _problems(edge_yaml()) == []


async def test_health_flapping_is_logged_at_most_a_burst_per_window(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    rt = runtime()

    def flip(i: int) -> None:
        health = "unhealthy" if i % 2 else "healthy"
        rt.provider_status(
            "node-a", ProviderStatus(providers=[ProviderHealth(provider_id="p2", health=health)])
        )

    with caplog.at_level(logging.INFO, logger="iopd.edge"):
        for i in range(1000):  # a node flipping p2 with every message
            flip(i)
        await trio.sleep(HEALTH_LOG_WINDOW)
        flip(1000)
    lines = [r.getMessage() for r in caplog.records if "event=provider_health" in r.getMessage()]
    assert len(lines) == HEALTH_LOG_BURST + 1
    assert "unlogged=0" in lines[0]
    assert f"unlogged={1000 - HEALTH_LOG_BURST}" in lines[-1]
    assert rt.health["p2"].health == "healthy"  # every change applied, logged or not


async def test_a_load_report_looks_at_each_provider_once() -> None:
    rt = runtime()
    seen: list[tuple[str, str, int]] = []
    rt.pool.set_remote_load = lambda node, pid, running, long, offered: seen.append(  # type: ignore[method-assign]
        (node, pid, running)
    )
    loads = [SlotLoad(provider_id="p1", in_flight=i % 3) for i in range(MAX_LOAD_ENTRIES - 1)]
    rt.provider_load("node-a", LoadReport(providers=[*loads, SlotLoad(provider_id="p2")]))
    assert seen == [("node-a", "p1", (MAX_LOAD_ENTRIES - 2) % 3), ("node-a", "p2", 0)]


def test_an_absurd_config_digest_is_refused_at_decode() -> None:
    raw = encode_frame(NodeConfigState(revision=1, digest="d" * (MAX_DIGEST_CHARS + 1)))
    with pytest.raises(msgspec.ValidationError, match="length <= 128"):
        msgspec.msgpack.decode(raw[4:], type=NodeConfigState)
    ok = NodeConfigState(revision=1, digest=node_config_digest([]))
    assert msgspec.msgpack.decode(encode_frame(ok)[4:], type=NodeConfigState) == ok
