"""The admission messages of the wire: who may send them, on which
streams, and the bounds a peer cannot push past."""

from __future__ import annotations

import msgspec
import pytest

from tests.support.wire_pairs import pair, run_req, text, xfer
from wire.connection import StreamState
from wire.errors import LocalProtocolError, MalformedFrame, RemoteProtocolError
from wire.framing import encode_frame
from wire.messages import (
    MAX_LOAD_ENTRIES,
    MAX_PROVIDER_ID_CHARS,
    Busy,
    LoadReport,
    NodeConfig,
    ProviderTunnelRequest,
    SlotLoad,
    Waiting,
    is_terminal,
)

LOAD = SlotLoad(provider_id="p", in_flight=2, offered=1)


def tunnel_req(sid: int) -> ProviderTunnelRequest:
    return ProviderTunnelRequest(stream_id=sid, provider_id="p", method="POST", path="/v1/x")


@pytest.mark.parametrize("opener", [run_req, tunnel_req])
def test_busy_ends_a_run_or_a_tunnel(opener: object) -> None:
    edge, node = pair()
    xfer(edge, node, opener(1))  # type: ignore[operator]
    busy = Busy(stream_id=1, load=LOAD)
    assert is_terminal(busy)
    assert xfer(node, edge, busy) == [busy]
    assert edge.stream_state(1) is node.stream_state(1) is StreamState.CLOSED


def test_busy_is_no_answer_to_a_config_push_nor_after_a_terminal() -> None:
    edge, node = pair()
    xfer(edge, node, NodeConfig(stream_id=1, version=1))
    with pytest.raises(LocalProtocolError):
        node.send(Busy(stream_id=1, load=LOAD))
    with pytest.raises(RemoteProtocolError):
        edge.receive_data(encode_frame(Busy(stream_id=1, load=LOAD)))
    edge, node = pair()
    xfer(edge, node, run_req(1))
    xfer(node, edge, text(1))
    xfer(node, edge, Busy(stream_id=1, load=LOAD))  # (a node may refuse late: still terminal)
    with pytest.raises(LocalProtocolError):
        node.send(Busy(stream_id=1, load=LOAD))


def test_load_reports_go_node_to_edge_and_waiting_edge_to_node() -> None:
    edge, node = pair()
    report = LoadReport(providers=[LOAD])
    assert xfer(node, edge, report) == [report]
    waiting = Waiting(provider_id="p", waiting=False)
    assert xfer(edge, node, waiting) == [waiting]
    with pytest.raises(LocalProtocolError):
        edge.send(report)
    with pytest.raises(LocalProtocolError):
        node.send(waiting)


def _raw_frame(obj: object) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize(
    "raw",
    [
        {"t": "LoadReport", "providers": [{"provider_id": "p"}] * (MAX_LOAD_ENTRIES + 1)},
        {"t": "LoadReport", "providers": [{"provider_id": "p" * (MAX_PROVIDER_ID_CHARS + 1)}]},
        {"t": "LoadReport", "providers": [{"provider_id": "p", "in_flight": -1}]},
        {"t": "LoadReport", "providers": [{"provider_id": "p", "offered": 10**12}]},
    ],
)
def test_a_load_report_past_its_bounds_is_malformed(raw: object) -> None:
    edge, _ = pair()
    with pytest.raises(MalformedFrame):
        edge.receive_data(_raw_frame(raw))


def test_a_waiting_message_past_its_bounds_is_malformed() -> None:
    _, node = pair()
    with pytest.raises(MalformedFrame):
        node.receive_data(
            _raw_frame({"t": "Waiting", "provider_id": "p" * (MAX_PROVIDER_ID_CHARS + 1)})
        )
