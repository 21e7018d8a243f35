"""GatewayMetrics: exact counter values read back from the text exposition."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from iopd.edge.metering.metrics import (
    GatewayMetrics,
    GatewayStatus,
    PrincipalLabels,
    ProviderGaugeRow,
    RequestLabels,
    expected_response_mode,
)
from iopd.edge.metering.usage import run_event_usage, tunnel_frame_usage, tunnel_usage
from iopd.edge.principals.authenticator import LEGACY_BEARER, OPEN, Principal
from iopd.tokens import estimate_input_tokens
from iopd.vocabulary import UNKNOWN_GROUP, UNMAPPED
from tests.support.paths import ROOT
from wire.messages import ProviderTunnelFrame, Usage

EDGE = "edge-1"
ALICE = PrincipalLabels.from_config("user-1", "alice", "app-1")


def samples(m: GatewayMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the exposition, keyed by (sample name, label items)."""
    body, ctype = m.exposition()
    assert ctype.startswith("text/plain")
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def series(m: GatewayMetrics, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """The samples of one sample name."""
    return {lbl: v for (n, lbl), v in samples(m).items() if n == name}


def value(m: GatewayMetrics, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    want = set(labels.items())
    return sum(v for lbl, v in series(m, name).items() if want <= lbl)


def req_labels(**over: str) -> RequestLabels:
    base = {
        "model_group": "echo",
        "endpoint": "chat_completions",
        "response_mode": "normalized",
    }
    base.update(over)
    return RequestLabels.build(ALICE, **base)


def unauthenticated(endpoint: str) -> RequestLabels:
    """Labels of a request rejected before auth succeeded (unmapped, model unknown)."""
    return RequestLabels.build(
        None, model_group=UNKNOWN_GROUP, endpoint=endpoint, response_mode="normalized"
    )


def full(labels: RequestLabels, status: str) -> dict[str, str]:
    return {
        "edge_id": EDGE,
        "principal_ref": labels.principal_ref,
        "principal_alias": labels.principal_alias,
        "token_ref": labels.token_ref,
        "model_group": labels.model_group,
        "endpoint": labels.endpoint,
        "response_mode": labels.response_mode,
        "status": status,
    }


@pytest.fixture
def m() -> GatewayMetrics:
    metrics = GatewayMetrics(EDGE)
    metrics.allow_ids(model_groups=["echo", "qwen"], principals=[ALICE])
    return metrics


# ------------------------------------------------------------------ requests


def test_normalized_echo_request_counts_run_event_usage(m: GatewayMetrics) -> None:
    messages = [{"role": "user", "content": "hello there echo"}]
    input_tokens = estimate_input_tokens(messages)  # 16 chars -> 4
    output_chunks = 3  # "hello ", "there ", "echo"
    labels = req_labels()
    m.record_request(
        labels,
        status="ok",
        duration=0.02,
        usage=run_event_usage(Usage(input_tokens=input_tokens, output_tokens=output_chunks)),
    )
    assert series(m, "iop_openai_requests_total") == {frozenset(full(labels, "ok").items()): 1.0}
    tokens = series(m, "iop_openai_usage_tokens_total")
    base = full(labels, "ok")
    assert tokens == {
        frozenset({**base, "usage_source": "run_event", "token_type": "input"}.items()): 4.0,
        frozenset({**base, "usage_source": "run_event", "token_type": "output"}.items()): 3.0,
    }
    assert series(m, "iop_openai_reasoning_observed_total") == {}
    assert value(m, "iop_request_duration_seconds_count", endpoint="chat_completions") == 1
    assert value(m, "iop_request_duration_seconds_sum") == pytest.approx(0.02)


def test_passthrough_non_stream_with_body_usage(m: GatewayMetrics) -> None:
    labels = req_labels(model_group="qwen", response_mode="passthrough")
    frame = ProviderTunnelFrame(
        stream_id=1, kind="usage", body_usage=Usage(input_tokens=120, output_tokens=30)
    )
    m.record_request(labels, status="ok", duration=1.5, usage=tunnel_frame_usage(frame))
    assert (
        value(m, "iop_openai_requests_total", model_group="qwen", response_mode="passthrough") == 1
    )
    assert (
        value(m, "iop_openai_usage_tokens_total", token_type="input", usage_source="provider_body")
        == 120
    )
    assert (
        value(m, "iop_openai_usage_tokens_total", token_type="output", usage_source="provider_body")
        == 30
    )
    assert value(m, "iop_openai_usage_tokens_total", usage_source="tunnel_frame") == 0


def test_passthrough_sse_body_and_frame_usage_no_double_count(m: GatewayMetrics) -> None:
    labels = req_labels(model_group="qwen", response_mode="passthrough")
    frame = ProviderTunnelFrame(
        stream_id=1,
        kind="usage",
        body_usage=Usage(input_tokens=50, output_tokens=20),
        usage=Usage(input_tokens=51, output_tokens=21, reasoning_tokens=7, cached_input_tokens=16),
    )
    m.record_request(labels, status="ok", duration=3.0, usage=tunnel_frame_usage(frame))
    assert value(m, "iop_openai_usage_tokens_total", token_type="input") == 50
    assert value(m, "iop_openai_usage_tokens_total", token_type="output") == 20
    assert (
        value(
            m, "iop_openai_usage_tokens_total", token_type="reasoning", usage_source="tunnel_frame"
        )
        == 7
    )
    assert (
        value(
            m,
            "iop_openai_usage_tokens_total",
            token_type="cached_input",
            usage_source="tunnel_frame",
        )
        == 16
    )
    assert value(m, "iop_openai_usage_tokens_total") == 50 + 20 + 7 + 16
    assert value(m, "iop_openai_requests_total") == 1


def test_provider_reported_reasoning_goes_to_token_type_and_is_not_estimated(
    m: GatewayMetrics,
) -> None:
    labels = req_labels(model_group="qwen", response_mode="passthrough")
    usage = tunnel_usage(Usage(input_tokens=10, output_tokens=90, reasoning_tokens=60), None)
    m.record_request(labels, status="ok", duration=2.0, usage=usage, reasoning_chars=250)
    assert value(m, "iop_openai_usage_tokens_total", token_type="reasoning") == 60
    assert value(m, "iop_openai_usage_tokens_total", token_type="output") == 90  # not reduced
    assert series(m, "iop_openai_reasoning_estimated_tokens_total") == {}
    # what the edge saw is still counted, for calibrating the estimate
    assert value(m, "iop_openai_reasoning_observed_total") == 1
    assert value(m, "iop_openai_reasoning_chars_total") == 250


def test_reasoning_reported_flag_alone_suppresses_the_estimate(m: GatewayMetrics) -> None:
    m.record_request(
        req_labels(), status="ok", duration=0.1, reasoning_chars=8, reasoning_reported=True
    )
    assert series(m, "iop_openai_reasoning_estimated_tokens_total") == {}
    assert value(m, "iop_openai_reasoning_chars_total") == 8


def test_reasoning_text_only_is_observed_and_estimated_never_a_token_type(
    m: GatewayMetrics,
) -> None:
    labels = req_labels()
    usage = run_event_usage(Usage(input_tokens=5, output_tokens=9))
    m.record_request(labels, status="ok", duration=0.5, usage=usage, reasoning_chars=10)
    m.record_request(labels, status="ok", duration=0.5, usage=usage, reasoning_chars=1)
    r = {
        "edge_id": EDGE,
        "principal_ref": "user-1",
        "token_ref": "app-1",
        "model_group": "echo",
        "endpoint": "chat_completions",
    }
    assert series(m, "iop_openai_reasoning_observed_total") == {frozenset(r.items()): 2}
    assert series(m, "iop_openai_reasoning_chars_total") == {frozenset(r.items()): 11}
    est = {**r, "estimation_method": "chars_div_4"}
    assert series(m, "iop_openai_reasoning_estimated_tokens_total") == {
        frozenset(est.items()): 3 + 1
    }
    assert value(m, "iop_openai_usage_tokens_total", token_type="reasoning") == 0


def test_cancelled_request_with_partial_usage_counted_once(m: GatewayMetrics) -> None:
    labels = req_labels()
    # echo cancelled after 2 chunks: the node reports usage for chunks already sent
    m.record_request(
        labels,
        status="cancelled",
        duration=0.3,
        usage=run_event_usage(Usage(input_tokens=4, output_tokens=2)),
    )
    assert series(m, "iop_openai_requests_total") == {
        frozenset(full(labels, "cancelled").items()): 1
    }
    assert value(m, "iop_openai_usage_tokens_total", status="cancelled", token_type="output") == 2
    assert value(m, "iop_openai_usage_tokens_total", status="ok") == 0


def test_labels_built_from_an_authenticated_caller() -> None:
    """``build`` takes the caller as auth found it: a principal token's ids, else unmapped."""
    kw: dict[str, str] = {
        "model_group": "echo",
        "endpoint": "responses",
        "response_mode": "normalized",
    }
    mapped = Principal("user-1", "alice", "app-1", "principal_token")
    assert RequestLabels.build(mapped, **kw) == RequestLabels.build(ALICE, **kw)
    no_alias = Principal("user-1", "", "app-1", "principal_token")
    assert RequestLabels.build(no_alias, **kw).principal_alias == "user-1"
    for caller in (LEGACY_BEARER, OPEN, None):
        labels = RequestLabels.build(caller, **kw)
        assert labels.principal == PrincipalLabels(UNMAPPED, UNMAPPED, UNMAPPED)


def test_auth_failure_is_unmapped_with_unknown_group(m: GatewayMetrics) -> None:
    labels = unauthenticated("chat_completions")
    m.record_request(labels, status="auth_error", duration=0.001)
    want = {
        "edge_id": EDGE,
        "principal_ref": UNMAPPED,
        "principal_alias": UNMAPPED,
        "token_ref": UNMAPPED,
        "model_group": UNKNOWN_GROUP,
        "endpoint": "chat_completions",
        "response_mode": "normalized",
        "status": "auth_error",
    }
    assert series(m, "iop_openai_requests_total") == {frozenset(want.items()): 1}
    assert series(m, "iop_openai_usage_tokens_total") == {}


def test_queue_timeout(m: GatewayMetrics) -> None:
    labels = req_labels(
        model_group="qwen", response_mode=expected_response_mode("chat_completions", ["openai"])
    )
    m.observe_dispatch_wait("qwen", 30.0, "queue_timeout")  # also counts the timed-out waiter
    m.record_request(labels, status="queue_timeout", duration=30.01)
    assert (
        value(m, "iop_openai_requests_total", status="queue_timeout", response_mode="passthrough")
        == 1
    )
    assert value(m, "iop_queue_waiters_timed_out_total", edge_id=EDGE) == 1
    assert (
        value(m, "iop_dispatch_wait_seconds_count", model_group="qwen", outcome="queue_timeout")
        == 1
    )
    assert value(m, "iop_dispatch_wait_seconds_bucket", outcome="queue_timeout", le="10.0") == 0
    assert value(m, "iop_dispatch_wait_seconds_bucket", outcome="queue_timeout", le="60.0") == 1


def test_counts_accumulate_per_label_set(m: GatewayMetrics) -> None:
    for _ in range(3):
        m.record_request(req_labels(), status="ok", duration=0.1, usage=[("run_event", "input", 2)])
    m.record_request(req_labels(endpoint="responses"), status="client_error", duration=0.1)
    assert value(m, "iop_openai_requests_total", endpoint="chat_completions", status="ok") == 3
    assert value(m, "iop_openai_requests_total", endpoint="responses", status="client_error") == 1
    assert value(m, "iop_openai_usage_tokens_total") == 6


def test_expected_response_mode_convention() -> None:
    assert expected_response_mode("chat_completions", ["openai", "openai"]) == "passthrough"
    assert expected_response_mode("chat_completions", ["openai", "echo"]) == "normalized"
    assert expected_response_mode("responses", []) == "normalized"
    assert expected_response_mode("api", ["ollama"]) == "passthrough"
    assert expected_response_mode("embeddings", ["echo"]) == "passthrough"  # only ever relayed
    assert expected_response_mode("completions", []) == "passthrough"
    with pytest.raises(ValueError):
        expected_response_mode("images", [])


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "over",
    [
        {"endpoint": "images"},
        {"response_mode": "raw"},
        {"model_group": ""},
        {"model_group": "a\nb"},
    ],
)
def test_bad_request_labels_raise(over: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        req_labels(**over)


def test_bad_values_raise_and_count_nothing(m: GatewayMetrics) -> None:
    good = req_labels()
    bad_calls: list[Callable[[], None]] = [
        lambda: m.record_request(good, status="teapot", duration=0.1),
        lambda: m.record_request(good, status="ok", duration=-1),
        lambda: m.record_request(good, status="ok", duration=0.1, reasoning_chars=-1),
        lambda: m.record_request(good, status="ok", duration=0.1, usage=[("guess", "input", 1)]),
        lambda: m.record_request(
            good, status="ok", duration=0.1, usage=[("run_event", "total", 1)]
        ),
        lambda: m.record_request(
            good, status="ok", duration=0.1, usage=[("run_event", "input", -1)]
        ),
        lambda: m.record_request(
            good,
            status="ok",
            duration=0.1,
            usage=[("provider_body", "input", 1), ("tunnel_frame", "input", 1)],
        ),
        lambda: m.record_request(
            req_labels(model_group="gpt-4-caller-string"), status="ok", duration=0.1
        ),
        lambda: m.record_request(
            RequestLabels.build(
                PrincipalLabels("someone", "x", "y"),
                model_group="echo",
                endpoint="api",
                response_mode="passthrough",
            ),
            status="ok",
            duration=0.1,
        ),
        lambda: m.observe_dispatch_wait("echo", 0.1, "maybe"),
        lambda: m.observe_dispatch_wait("not-a-group", 0.1, "admitted"),
        lambda: m.count_refresh("partial"),
        lambda: m.count_wire_frames("sideways"),
        lambda: m.count_wire_error("bad vibes"),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    assert series(m, "iop_openai_requests_total") == {}
    assert series(m, "iop_openai_usage_tokens_total") == {}
    assert series(m, "iop_request_duration_seconds_count") == {}
    assert series(m, "iop_dispatch_wait_seconds_count") == {}


def test_a_dispatch_wait_series_once_made_still_refuses_bad_values(m: GatewayMetrics) -> None:
    """Labels are checked when a series is first made; a made series does not
    let another group, outcome or a negative wait through."""
    m.observe_dispatch_wait("echo", 0.1, "admitted")
    bad_calls: list[Callable[[], None]] = [
        lambda: m.observe_dispatch_wait("echo", -1.0, "admitted"),
        lambda: m.observe_dispatch_wait("echo", 0.1, "maybe"),
        lambda: m.observe_dispatch_wait("not-a-group", 0.1, "admitted"),
    ]
    for bad in bad_calls:
        with pytest.raises(ValueError):
            bad()
    m.observe_dispatch_wait("echo", 0.2, "admitted")
    assert series(m, "iop_dispatch_wait_seconds_count") == {
        frozenset({("edge_id", EDGE), ("model_group", "echo"), ("outcome", "admitted")}): 2.0
    }


def test_without_registered_ids_any_well_shaped_id_is_accepted() -> None:
    m = GatewayMetrics(EDGE)
    m.record_request(req_labels(model_group="qwen3.6:35b"), status="ok", duration=0.1)
    assert value(m, "iop_openai_requests_total", model_group="qwen3.6:35b") == 1


def test_a_label_set_checked_before_registration_is_checked_again() -> None:
    # record_request checks a label set once; registering ids makes it check anew.
    m = GatewayMetrics(EDGE)
    m.record_request(req_labels(model_group="x"), status="ok", duration=0.1)
    m.record_request(req_labels(model_group="x"), status="ok", duration=0.1)
    m.allow_ids(model_groups=["y"])
    with pytest.raises(ValueError):
        m.record_request(req_labels(model_group="x"), status="ok", duration=0.1)
    with pytest.raises(ValueError):
        m.record_request(req_labels(model_group="y"), status="bogus", duration=0.1)
    assert value(m, "iop_openai_requests_total", model_group="x") == 2


def test_labels_are_built_once_per_set_and_bad_ones_raise_every_time() -> None:
    a = req_labels(model_group="same")
    assert req_labels(model_group="same") is a
    for _ in range(2):
        with pytest.raises(ValueError):
            req_labels(endpoint="not-an-endpoint")


def test_ids_accumulate_across_refreshes(m: GatewayMetrics) -> None:
    m.allow_ids(model_groups=["new-group"])
    m.record_request(req_labels(model_group="new-group"), status="ok", duration=0.1)
    m.record_request(req_labels(model_group="echo"), status="ok", duration=0.1)  # still allowed
    assert value(m, "iop_openai_requests_total") == 2


def test_empty_alias_shows_principal_ref() -> None:
    p = PrincipalLabels.from_config("user-2", "", "app-2")
    assert p.principal_alias == "user-2"


# ------------------------------------------------------------------ gateway health


def test_status_gauges_are_read_at_scrape_time(m: GatewayMetrics) -> None:
    state = {"in_flight": 1}

    def status() -> GatewayStatus:
        return GatewayStatus(
            queue_depth=2,
            max_queue=256,
            queued_bytes=4096,
            connected_nodes=1,
            providers=[
                ProviderGaugeRow(
                    "node-a",
                    "vllm-a",
                    in_flight=state["in_flight"],
                    capacity=4,
                    long_in_flight=1,
                    long_capacity=2,
                    health="healthy",
                ),
                ProviderGaugeRow(
                    "node-a", "idle", in_flight=0, capacity=2, health="unhealthy", enabled=False
                ),
            ],
        )

    assert series(m, "iop_queue_depth") == {}  # no source yet: nothing, and no error
    m.set_status_source(status)
    a = {"edge_id": EDGE, "node_id": "node-a", "provider_id": "vllm-a"}
    idle = {"edge_id": EDGE, "node_id": "node-a", "provider_id": "idle"}
    assert value(m, "iop_queue_depth") == 2
    assert value(m, "iop_queue_max") == 256
    assert value(m, "iop_queue_bytes") == 4096
    assert value(m, "iop_connected_nodes") == 1
    assert value(m, "iop_provider_in_flight", **a) == 1
    assert value(m, "iop_provider_capacity", **a) == 4
    assert value(m, "iop_provider_load_ratio", **a) == 0.25
    assert value(m, "iop_provider_long_in_flight", **a) == 1
    assert value(m, "iop_provider_long_capacity", **a) == 2
    assert value(m, "iop_provider_health", **a) == 2
    assert value(m, "iop_provider_health", **idle) == 0
    assert value(m, "iop_provider_enabled", **idle) == 0
    assert frozenset(idle.items()) in series(m, "iop_provider_load_ratio")  # 0 kept, not dropped
    for lbl in series(m, "iop_provider_in_flight"):
        assert {k for k, _ in lbl} == {"edge_id", "node_id", "provider_id"}
    state["in_flight"] = 3
    assert value(m, "iop_provider_load_ratio", **a) == 0.75


def test_failing_status_source_does_not_break_the_scrape(m: GatewayMetrics) -> None:
    def broken() -> GatewayStatus:
        raise RuntimeError("pool exploded")

    m.set_status_source(broken)
    m.count_refresh("applied")
    assert value(m, "iop_config_refresh_total", outcome="applied") == 1
    assert series(m, "iop_queue_depth") == {}


def test_queue_timeouts_counted_once_each(m: GatewayMetrics) -> None:
    m.observe_dispatch_wait("echo", 0.5, "admitted")
    m.observe_dispatch_wait("echo", 30.0, "queue_timeout")
    m.observe_dispatch_wait("echo", 30.0, "queue_timeout")
    assert value(m, "iop_queue_waiters_timed_out_total") == 2


def test_refresh_wire_counters(m: GatewayMetrics) -> None:
    m.count_refresh("dry_run")
    m.count_refresh("refused")
    m.count_refresh("refused")
    m.count_wire_frames("in", 5)
    m.count_wire_frames("out")
    m.count_wire_error("frame_too_large")
    m.count_wire_error("heartbeat_timeout")
    assert value(m, "iop_config_refresh_total", outcome="refused") == 2
    assert value(m, "iop_config_refresh_total", outcome="dry_run") == 1
    assert value(m, "iop_wire_frames_total", direction="in") == 5
    assert value(m, "iop_wire_frames_total", direction="out") == 1
    assert value(m, "iop_wire_protocol_errors_total", reason="frame_too_large") == 1
    assert value(m, "iop_wire_protocol_errors_total") == 2


def test_dispatch_wait_histogram_labels(m: GatewayMetrics) -> None:
    m.observe_dispatch_wait("echo", 0.0, "admitted")
    m.observe_dispatch_wait(UNKNOWN_GROUP, 0.0, "dispatch_error")
    counts = series(m, "iop_dispatch_wait_seconds_count")
    assert counts == {
        frozenset({"edge_id": EDGE, "model_group": "echo", "outcome": "admitted"}.items()): 1,
        frozenset(
            {"edge_id": EDGE, "model_group": "unknown", "outcome": "dispatch_error"}.items()
        ): 1,
    }


# ------------------------------------------------------------------ isolation and secrets


def test_two_instances_do_not_share_state() -> None:
    one, two = GatewayMetrics("edge-1"), GatewayMetrics("edge-2")
    one.record_request(req_labels(), status="ok", duration=0.1, usage=[("run_event", "input", 3)])
    assert value(one, "iop_openai_requests_total") == 1
    assert series(two, "iop_openai_requests_total") == {}
    assert series(two, "iop_openai_usage_tokens_total") == {}
    assert one.registry is not two.registry


def test_explicit_registry_is_used() -> None:
    reg = CollectorRegistry()
    m = GatewayMetrics(EDGE, registry=reg)
    m.count_wire_frames("in")
    assert reg.get_sample_value("iop_wire_frames_total", {"edge_id": EDGE, "direction": "in"}) == 1


def test_canary_secrets_never_reach_the_exposition(m: GatewayMetrics) -> None:
    raw_token = "sk-CANARY-TOKEN-0123456789"
    request_id = "req-CANARY-ID-42"
    session_id = "sess-CANARY-99"
    prompt = "CANARY-PROMPT tell me a secret"
    response = "CANARY-RESPONSE here it is"
    caller_model = "CANARY-MODEL-from-caller"
    canaries = [raw_token, request_id, session_id, prompt, response, caller_model]

    # Every place a careless caller might try to smuggle one in is refused.
    for c in canaries:
        for over in ({"endpoint": c}, {"response_mode": c}):
            with pytest.raises(ValueError):
                req_labels(**over)
        with pytest.raises(ValueError):  # a caller string as model_group
            m.record_request(req_labels(model_group=c), status="ok", duration=0.1)
        with pytest.raises(ValueError):  # a token as principal labels
            m.record_request(
                RequestLabels.build(
                    PrincipalLabels(c, c, c),
                    model_group="echo",
                    endpoint="chat_completions",
                    response_mode="normalized",
                ),
                status="ok",
                duration=0.1,
            )
        smuggle: list[Callable[[str], None]] = [
            lambda c: m.record_request(req_labels(), status=c, duration=0.1),
            lambda c: m.record_request(
                req_labels(), status="ok", duration=0.1, usage=[(c, "input", 1)]
            ),
            lambda c: m.record_request(
                req_labels(), status="ok", duration=0.1, usage=[("run_event", c, 1)]
            ),
            lambda c: m.observe_dispatch_wait(c, 0.1, "admitted"),
            lambda c: m.count_refresh(c),
            lambda c: m.count_wire_error(c),
        ]
        for bad in smuggle:
            with pytest.raises(ValueError) as info:
                bad(c)
            assert c not in str(info.value)  # not echoed into error messages either

    # The legitimate flow of a request that carried all of them.
    m.record_request(
        req_labels(),
        status="ok",
        duration=0.2,
        usage=run_event_usage(Usage(input_tokens=len(prompt) // 4, output_tokens=5)),
        reasoning_chars=len(response),
    )
    m.record_request(unauthenticated("responses"), status="auth_error", duration=0.0)
    m.set_status_source(
        lambda: GatewayStatus(providers=[ProviderGaugeRow("node-a", "echo-1", 0, 1)])
    )
    body, _ = m.exposition()
    text = body.decode()
    assert "iop_openai_requests_total" in text
    for c in canaries:
        assert c not in text
        assert "CANARY" not in text


# ------------------------------------------------------------------ docs stay in sync


def test_guide_and_dashboard_use_only_exposed_metric_names(m: GatewayMetrics) -> None:
    """A metric renamed here but not in the docs (or a typo there) fails this test."""
    docs = ROOT / "docs"
    guide = (docs / "openai-usage-grafana.md").read_text(encoding="utf-8")
    queries = re.findall(r"```promql\n(.*?)\n```", guide, re.S)
    dashboard = json.loads((docs / "grafana-dashboard.json").read_text(encoding="utf-8"))
    queries += [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(queries) > 40

    m.record_request(
        req_labels(),
        status="ok",
        duration=0.1,
        usage=[("run_event", "input", 1)],
        reasoning_chars=4,
    )
    m.observe_dispatch_wait("echo", 0.1, "queue_timeout")
    m.count_refresh("applied")
    m.count_wire_frames("in")
    m.count_wire_error("malformed")
    m.count_http_rejected(400)
    m.count_attempt_failure("echo", "p", "connect")
    m.count_retry("echo")
    m.count_ejection("p")
    m.count_fallback("echo", "qwen")
    m.count_limit_rejection("unmapped", "tokens_per_minute")
    m.set_status_source(
        lambda: GatewayStatus(
            providers=[ProviderGaugeRow("n", "p", 0, 1)], principals_in_flight={"unmapped": 0}
        )
    )
    exposed = {name for name, _ in samples(m)}
    rule_series = {"iop_price_per_million_tokens", "iop_infra_cost_per_month"}
    used = {name for q in queries for name in re.findall(r"\biop_[a-z_]+", q)}
    assert used - rule_series <= exposed, sorted(used - rule_series - exposed)
    assert rule_series <= used  # the cost/ROI queries are there


def test_http_rejected_statuses_are_a_fixed_label_set(m: GatewayMetrics) -> None:
    for status in (400, 404, 405, 408, 413, 431, 501, 503, 418, 502):
        m.count_http_rejected(status)
    got = {dict(lbl)["status"]: v for lbl, v in series(m, "iop_http_requests_rejected_total").items()}
    assert got == {
        **{s: 1 for s in ("400", "404", "405", "408", "413", "431", "501", "503")},
        "other": 2,
    }


def test_routing_counters_take_only_fixed_reasons_and_config_groups(m: GatewayMetrics) -> None:
    """The counters of routing around failures: ``reason`` from FailureReason,
    groups from the config."""
    m.count_attempt_failure("echo", "p", "status_429")
    assert series(m, "iop_provider_attempt_failures_total") == {
        frozenset(
            {"edge_id": EDGE, "model_group": "echo", "provider": "p", "reason": "status_429"}.items()
        ): 1.0
    }
    with pytest.raises(ValueError):
        m.count_attempt_failure("echo", "p", "caller said so")
    with pytest.raises(ValueError):
        m.count_fallback("echo", "not-a-configured-group")


def test_limit_rejections_take_config_ids_and_fixed_limit_names_only(m: GatewayMetrics) -> None:
    m.allow_ids(principals=[PrincipalLabels.from_config("team-a", "", "a-1")])
    m.count_limit_rejection("team-a", "requests_per_minute")
    m.count_limit_rejection("unmapped", "tokens_per_day")
    with pytest.raises(ValueError):
        m.count_limit_rejection("caller-chosen", "requests_per_minute")
    with pytest.raises(ValueError):
        m.count_limit_rejection("team-a", "bogus")
    got = {tuple(sorted(dict(lbl).items())): v for lbl, v in series(m, "iop_limit_rejections_total").items()}
    assert len(got) == 2 and set(got.values()) == {1}
    m.set_status_source(
        lambda: GatewayStatus(principals_in_flight={"team-a": 2, "not-configured": 5})
    )
    in_flight = series(m, "iop_principal_in_flight")
    assert [dict(lbl)["principal_ref"] for lbl in in_flight] == ["team-a"]
