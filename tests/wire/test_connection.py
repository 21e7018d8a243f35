"""The connection state table, exercised on both ends without any I/O."""

from __future__ import annotations

import pytest

from tests.support.wire_pairs import ACK, CHALLENGE, HELLO, PROOF, pair, run_req, text, xfer
from wire.connection import (
    CONNECTION_TRANSITIONS,
    Connection,
    ConnState,
    Role,
    StreamState,
)
from wire.errors import LocalProtocolError, RemoteProtocolError, VersionMismatch
from wire.framing import encode_frame
from wire.messages import (
    Cancel,
    Challenge,
    Credit,
    Heartbeat,
    Hello,
    HelloAck,
    Message,
    NodeConfig,
    NodeConfigAck,
    Pong,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    Refused,
    RunEvent,
)


def done(sid: int) -> RunEvent:
    return RunEvent(stream_id=sid, kind="complete")


# ------------------------------------------------------------------ handshake


def test_handshake_refused_closes() -> None:
    edge, node = Connection(Role.EDGE), Connection(Role.NODE)
    xfer(node, edge, HELLO)
    xfer(edge, node, Refused(reason="no", code="bad_token"))
    assert edge.state is node.state is ConnState.CLOSED
    assert node.refused is not None and node.refused.code == "bad_token"
    with pytest.raises(LocalProtocolError):
        node.send(Heartbeat())


def test_handshake_refused_after_a_bad_proof_closes() -> None:
    edge, node = Connection(Role.EDGE), Connection(Role.NODE)
    xfer(node, edge, HELLO)
    xfer(edge, node, CHALLENGE)
    xfer(node, edge, PROOF)
    xfer(edge, node, Refused(reason="bad proof", code="bad_token"))
    assert edge.state is node.state is ConnState.CLOSED


def test_edge_may_not_ack_before_the_proof() -> None:
    edge, node = Connection(Role.EDGE), Connection(Role.NODE)
    xfer(node, edge, HELLO)
    with pytest.raises(LocalProtocolError):
        edge.send(ACK)  # a HelloAck skipping the challenge is not legal
    with pytest.raises(RemoteProtocolError) as info:
        node.receive_data(encode_frame(ACK))
    assert "hello_sent" in info.value.reason


def test_only_a_proof_answers_a_challenge() -> None:
    edge, node = Connection(Role.EDGE), Connection(Role.NODE)
    xfer(node, edge, HELLO)
    xfer(edge, node, CHALLENGE)
    with pytest.raises(LocalProtocolError):
        edge.send(Refused(reason="x"))  # the edge waits for the proof
    with pytest.raises(RemoteProtocolError) as info:
        edge.receive_data(encode_frame(Heartbeat()))
    assert "challenged" in info.value.reason


ALL_SAMPLES: list[Message] = [
    HELLO,
    CHALLENGE,
    PROOF,
    ACK,
    Refused(reason="r"),
    Heartbeat(),
    Pong(),
    ProviderStatus(),
    NodeConfig(stream_id=1, version=1),
    NodeConfigAck(stream_id=1, version=1),
    run_req(1),
    text(1),
    ProviderTunnelRequest(stream_id=1, provider_id="p", method="GET", path="/"),
    ProviderTunnelFrame(stream_id=1, kind="head"),
    Cancel(stream_id=1),
    Credit(stream_id=1, frames=1),
]


@pytest.mark.parametrize("msg", [m for m in ALL_SAMPLES if not isinstance(m, Hello)])
def test_nothing_but_hello_first(msg: Message) -> None:
    edge = Connection(Role.EDGE)
    with pytest.raises(RemoteProtocolError) as info:
        edge.receive_data(encode_frame(msg))
    assert "await_hello" in info.value.reason and type(msg).__name__ in info.value.reason
    assert edge.state is ConnState.CLOSED
    with pytest.raises(RemoteProtocolError):  # stays broken
        edge.receive_data(encode_frame(HELLO))


@pytest.mark.parametrize("msg", [m for m in ALL_SAMPLES if not isinstance(m, Challenge | Refused)])
def test_nothing_but_challenge_or_refused_after_hello(msg: Message) -> None:
    edge, node = Connection(Role.EDGE), Connection(Role.NODE)
    xfer(node, edge, HELLO)
    with pytest.raises(RemoteProtocolError) as info:
        node.receive_data(encode_frame(msg))
    assert "hello_sent" in info.value.reason
    # and the edge cannot send it either
    with pytest.raises(LocalProtocolError):
        edge.send(msg)


@pytest.mark.parametrize("msg", ALL_SAMPLES)
def test_node_may_not_send_first_anything_but_hello(msg: Message) -> None:
    node = Connection(Role.NODE)
    if isinstance(msg, Hello):
        node.send(msg)
        assert node.state is ConnState.HELLO_SENT
    else:
        with pytest.raises(LocalProtocolError):
            node.send(msg)
        assert node.state is ConnState.AWAIT_HELLO


@pytest.mark.parametrize("msg", [HELLO, CHALLENGE, PROOF, ACK, Refused(reason="x")])
def test_handshake_messages_illegal_in_session(msg: Message) -> None:
    for side in ("edge", "node"):
        edge, node = pair()
        target = edge if side == "edge" else node
        with pytest.raises(RemoteProtocolError) as info:
            target.receive_data(encode_frame(msg))
        assert "open" in info.value.reason


def test_version_mismatch_edge_must_refuse() -> None:
    edge, node = Connection(Role.EDGE), Connection(Role.NODE)
    xfer(node, edge, Hello(protocol_version=99, node_id="n", token="t"))
    with pytest.raises(LocalProtocolError):
        edge.send(CHALLENGE)
    edge.send(Refused(reason="version", code="version_mismatch"))
    assert edge.state is ConnState.CLOSED


def test_node_rejects_ack_with_other_version() -> None:
    node = Connection(Role.NODE)
    node.send(HELLO)
    node.receive_data(encode_frame(CHALLENGE))
    node.send(PROOF)
    with pytest.raises(VersionMismatch):
        node.receive_data(encode_frame(HelloAck(edge_id="e", protocol_version=1)))


def test_every_state_is_in_the_table() -> None:
    assert set(CONNECTION_TRANSITIONS) == set(ConnState)


# -------------------------------------------------------------------- session


def test_heartbeats_and_status_in_session() -> None:
    edge, node = pair()
    xfer(edge, node, Heartbeat(seq=1))
    xfer(node, edge, Pong(seq=1))
    xfer(node, edge, Heartbeat(seq=2))
    xfer(edge, node, Pong(seq=2))
    xfer(node, edge, ProviderStatus())


@pytest.mark.parametrize(
    "msg",
    [
        run_req(1),
        NodeConfig(stream_id=1, version=1),
        Cancel(stream_id=1),
        Credit(stream_id=1, frames=1),
    ],
)
def test_node_may_not_send_edge_messages(msg: Message) -> None:
    edge, node = pair()
    with pytest.raises(LocalProtocolError):
        node.send(msg)
    with pytest.raises(RemoteProtocolError):
        edge.receive_data(encode_frame(msg))


def test_edge_may_not_send_replies_or_status() -> None:
    edge, node = pair()
    xfer(edge, node, run_req(1))
    for msg in (text(1), ProviderStatus(), NodeConfigAck(stream_id=1, version=1)):
        with pytest.raises(LocalProtocolError):
            edge.send(msg)


def test_full_run_stream() -> None:
    edge, node = pair()
    xfer(edge, node, run_req(1, window=2))
    assert node.stream_state(1) is StreamState.OPEN
    xfer(node, edge, text(1))
    xfer(node, edge, text(1))
    assert node.stream_credit(1) == 0 and edge.stream_credit(1) == 0
    with pytest.raises(LocalProtocolError):  # window exhausted
        node.send(text(1))
    xfer(edge, node, Credit(stream_id=1, frames=1))
    assert node.stream_credit(1) == 1
    xfer(node, edge, text(1))
    xfer(node, edge, done(1))  # the terminal needs no credit
    assert edge.stream_state(1) is node.stream_state(1) is StreamState.CLOSED
    assert edge.open_stream_ids == node.open_stream_ids == []


def test_node_exceeding_window_is_remote_error() -> None:
    edge, node = pair()
    xfer(edge, node, run_req(1, window=1))
    xfer(node, edge, text(1))
    with pytest.raises(RemoteProtocolError) as info:
        edge.receive_data(encode_frame(text(1)))
    assert "credit" in info.value.reason


def test_reply_on_unopened_stream() -> None:
    edge, node = pair()
    with pytest.raises(LocalProtocolError):
        node.send(text(5))
    with pytest.raises(RemoteProtocolError) as info:
        edge.receive_data(encode_frame(text(5)))
    assert "idle stream 5" in info.value.reason


def test_reply_after_terminal() -> None:
    edge, node = pair()
    xfer(edge, node, run_req(1))
    xfer(node, edge, done(1))
    with pytest.raises(LocalProtocolError):
        node.send(done(1))
    with pytest.raises(RemoteProtocolError) as info:
        edge.receive_data(encode_frame(text(1)))
    assert "closed stream 1" in info.value.reason


def test_reply_of_wrong_kind() -> None:
    edge, node = pair()
    xfer(edge, node, run_req(1))
    bad = ProviderTunnelFrame(stream_id=1, kind="end")
    with pytest.raises(LocalProtocolError):
        node.send(bad)
    with pytest.raises(RemoteProtocolError):
        edge.receive_data(encode_frame(bad))


def test_stream_ids_must_increase() -> None:
    edge, node = pair()
    xfer(edge, node, run_req(3))
    with pytest.raises(LocalProtocolError):
        edge.send(run_req(3))
    with pytest.raises(LocalProtocolError):
        edge.send(run_req(2))
    fresh_edge, fresh_node = pair()
    xfer(fresh_edge, fresh_node, run_req(3))
    with pytest.raises(RemoteProtocolError):
        fresh_node.receive_data(encode_frame(run_req(2)))


def test_zero_window_is_illegal() -> None:
    edge, node = pair()
    with pytest.raises(LocalProtocolError):
        edge.send(run_req(1, window=0))
    with pytest.raises(RemoteProtocolError):
        node.receive_data(encode_frame(run_req(1, window=0)))


def test_cancel_then_replies_until_terminal() -> None:
    edge, node = pair()
    xfer(edge, node, run_req(1, window=4))
    xfer(edge, node, Cancel(stream_id=1, reason="gone"))
    assert node.stream_state(1) is edge.stream_state(1) is StreamState.CANCELLED
    xfer(node, edge, text(1))  # in flight when the cancel crossed
    xfer(edge, node, Cancel(stream_id=1))  # duplicate: harmless
    xfer(node, edge, RunEvent(stream_id=1, kind="error", code="cancelled"))
    assert edge.stream_state(1) is StreamState.CLOSED


def test_cancel_and_credit_racing_the_terminal_are_ignored() -> None:
    edge, node = pair()
    xfer(edge, node, run_req(1))
    terminal = node.send(done(1))
    cancel = edge.send(Cancel(stream_id=1))
    credit = edge.send(Credit(stream_id=1, frames=1))
    node.receive_data(cancel + credit)
    edge.receive_data(terminal)
    assert edge.stream_state(1) is node.stream_state(1) is StreamState.CLOSED


def test_cancel_or_credit_on_never_opened_stream() -> None:
    for msg in (Cancel(stream_id=4), Credit(stream_id=4, frames=1)):
        edge, node = pair()
        with pytest.raises(LocalProtocolError):
            edge.send(msg)
        with pytest.raises(RemoteProtocolError):
            node.receive_data(encode_frame(msg))


def test_credit_must_be_positive() -> None:
    edge, node = pair()
    xfer(edge, node, run_req(1))
    with pytest.raises(LocalProtocolError):
        edge.send(Credit(stream_id=1, frames=0))


def test_config_stream_takes_only_its_ack() -> None:
    edge, node = pair()
    xfer(edge, node, NodeConfig(stream_id=1, version=1))
    with pytest.raises(LocalProtocolError):
        node.send(text(1))
    xfer(node, edge, NodeConfigAck(stream_id=1, version=1))
    assert edge.stream_state(1) is StreamState.CLOSED


def test_tunnel_stream() -> None:
    edge, node = pair()
    xfer(
        edge,
        node,
        ProviderTunnelRequest(stream_id=1, provider_id="p", method="POST", path="/v1/x", window=3),
    )
    for kind in ("head", "body", "usage"):
        xfer(node, edge, ProviderTunnelFrame(stream_id=1, kind=kind))
    xfer(node, edge, ProviderTunnelFrame(stream_id=1, kind="end"))
    assert edge.open_stream_ids == []


def test_many_streams_interleaved() -> None:
    edge, node = pair()
    for sid in (1, 2, 3):
        xfer(edge, node, run_req(sid))
    data = node.send(text(2)) + node.send(done(1)) + node.send(done(3)) + node.send(done(2))
    assert len(edge.receive_data(data)) == 4
    assert edge.open_stream_ids == [] and edge.last_stream_id == 3


def test_truncated_then_eof() -> None:
    edge, node = pair()
    frame = node.send(Heartbeat())
    edge.receive_data(frame[:3])
    with pytest.raises(RemoteProtocolError):
        edge.receive_eof()


def test_clean_eof_closes() -> None:
    edge, _node = pair()
    edge.receive_eof()
    assert edge.state is ConnState.CLOSED


def test_local_error_changes_nothing() -> None:
    edge, node = pair()
    xfer(edge, node, run_req(1, window=1))
    xfer(node, edge, text(1))
    with pytest.raises(LocalProtocolError):
        node.send(text(1))
    assert node.state is ConnState.OPEN and node.stream_credit(1) == 0
    xfer(node, edge, done(1))
