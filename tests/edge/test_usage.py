"""The usage merge (docs/openai-usage-grafana.md): each token type counted once, with its source."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from iopd.edge.metering.usage import run_event_usage, tunnel_frame_usage, tunnel_usage
from wire.messages import ProviderTunnelFrame, Usage


def test_run_event_usage_maps_every_field_with_run_event_source() -> None:
    u = Usage(input_tokens=12, output_tokens=5, reasoning_tokens=3, cached_input_tokens=4)
    assert run_event_usage(u) == [
        ("run_event", "input", 12),
        ("run_event", "output", 5),
        ("run_event", "reasoning", 3),
        ("run_event", "cached_input", 4),
    ]


def test_run_event_usage_none_and_zero_and_negative_are_omitted() -> None:
    assert run_event_usage(None) == []
    assert run_event_usage(Usage()) == []
    assert run_event_usage(Usage(input_tokens=0, output_tokens=-2)) == []


def test_body_only() -> None:
    body = Usage(input_tokens=10, output_tokens=7)
    assert tunnel_usage(body, None) == [
        ("provider_body", "input", 10),
        ("provider_body", "output", 7),
    ]


def test_frame_only() -> None:
    frame = Usage(input_tokens=10, output_tokens=7, cached_input_tokens=2)
    assert tunnel_usage(None, frame) == [
        ("tunnel_frame", "input", 10),
        ("tunnel_frame", "output", 7),
        ("tunnel_frame", "cached_input", 2),
    ]


def test_body_input_output_win_and_frame_supplements_reasoning_and_cached() -> None:
    body = Usage(input_tokens=100, output_tokens=40)
    frame = Usage(input_tokens=999, output_tokens=999, reasoning_tokens=25, cached_input_tokens=60)
    assert tunnel_usage(body, frame) == [
        ("provider_body", "input", 100),
        ("provider_body", "output", 40),
        ("tunnel_frame", "reasoning", 25),
        ("tunnel_frame", "cached_input", 60),
    ]


def test_body_reasoning_beats_frame_reasoning() -> None:
    body = Usage(input_tokens=1, output_tokens=2, reasoning_tokens=9)
    frame = Usage(reasoning_tokens=50)
    assert ("provider_body", "reasoning", 9) in tunnel_usage(body, frame)
    assert not [i for i in tunnel_usage(body, frame) if i[0] == "tunnel_frame"]


def test_frame_fills_only_what_the_body_lacks() -> None:
    body = Usage(output_tokens=8)  # e.g. a stream whose final chunk had no prompt count
    frame = Usage(input_tokens=30, output_tokens=1)
    assert tunnel_usage(body, frame) == [
        ("tunnel_frame", "input", 30),
        ("provider_body", "output", 8),
    ]


def test_body_explicit_zero_is_present_and_not_replaced() -> None:
    body = Usage(input_tokens=5, output_tokens=0)
    frame = Usage(output_tokens=3)
    assert tunnel_usage(body, frame) == [("provider_body", "input", 5)]


def test_negative_body_value_counts_as_missing() -> None:
    body = Usage(input_tokens=-1, output_tokens=4)
    frame = Usage(input_tokens=6)
    assert tunnel_usage(body, frame) == [
        ("tunnel_frame", "input", 6),
        ("provider_body", "output", 4),
    ]


def test_output_is_passed_through_without_subtracting_reasoning() -> None:
    body = Usage(input_tokens=10, output_tokens=50, reasoning_tokens=30)
    assert dict((t, n) for _, t, n in tunnel_usage(body, None)) == {
        "input": 10,
        "output": 50,
        "reasoning": 30,
    }


def test_tunnel_frame_usage_reads_both_fields_of_a_usage_frame() -> None:
    frame = ProviderTunnelFrame(
        stream_id=3,
        kind="usage",
        body_usage=Usage(input_tokens=4, output_tokens=2),
        usage=Usage(input_tokens=100, reasoning_tokens=1),
        reasoning_chars=12,
    )
    assert tunnel_frame_usage(frame) == [
        ("provider_body", "input", 4),
        ("provider_body", "output", 2),
        ("tunnel_frame", "reasoning", 1),
    ]
    assert tunnel_frame_usage(None) == []


_count = st.one_of(st.none(), st.integers(min_value=-3, max_value=10_000))
_usage = st.one_of(
    st.none(),
    st.builds(
        Usage,
        input_tokens=_count,
        output_tokens=_count,
        reasoning_tokens=_count,
        cached_input_tokens=_count,
    ),
)


@given(_usage, _usage)
def test_merge_properties(body: Usage | None, frame: Usage | None) -> None:
    items = tunnel_usage(body, frame)
    types = [t for _, t, _ in items]
    assert len(types) == len(set(types)), "a token type counted twice"
    for source, token_type, count in items:
        assert count > 0
        attr = f"{token_type}_tokens"
        body_value = getattr(body, attr) if body is not None else None
        body_has = body_value is not None and body_value >= 0
        if source == "provider_body":
            assert count == body_value
        else:
            assert source == "tunnel_frame"
            assert not body_has
            assert frame is not None and count == getattr(frame, attr)
