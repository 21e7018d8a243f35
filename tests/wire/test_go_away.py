"""``GoAway`` and ``Hello.features``: what an edge handing over tells its nodes,
and that neither breaks a peer of an earlier release."""

from __future__ import annotations

import msgspec
import pytest

from wire.connection import CONNECTION_TRANSITIONS, ConnState, Role
from wire.messages import FEATURE_GO_AWAY, PROTOCOL_VERSION, GoAway, Hello, Message

_decode = msgspec.msgpack.Decoder(Message).decode
_encode = msgspec.msgpack.Encoder().encode


class _OldHello(msgspec.Struct, tag_field="t", tag="Hello", omit_defaults=True, kw_only=True):
    """``Hello`` as a release before ``features`` declares it."""

    protocol_version: int
    node_id: str
    token: str
    software_version: str = ""
    nonce: str = ""


def test_a_hello_without_features_is_the_bytes_of_an_older_release() -> None:
    old = _OldHello(protocol_version=PROTOCOL_VERSION, node_id="n", token="", nonce="x")
    new = Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="", nonce="x")
    assert _encode(new) == _encode(old)
    assert _decode(_encode(old)) == new  # and an old node's Hello has no features


def test_an_older_edge_decodes_a_hello_with_features() -> None:
    hello = Hello(
        protocol_version=PROTOCOL_VERSION, node_id="n", token="", features=[FEATURE_GO_AWAY]
    )
    old = msgspec.msgpack.decode(_encode(hello), type=_OldHello)  # unknown fields skipped
    assert old.node_id == "n"


def test_features_are_bounded() -> None:
    too_many = Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="", features=["f"] * 17)
    with pytest.raises(msgspec.ValidationError):
        _decode(_encode(too_many))
    too_long = Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="", features=["f" * 33])
    with pytest.raises(msgspec.ValidationError):
        _decode(_encode(too_long))


def test_go_away_is_the_edges_to_send_in_a_session() -> None:
    assert _decode(_encode(GoAway(reason="handing over"))) == GoAway(reason="handing over")
    open_state = CONNECTION_TRANSITIONS[ConnState.OPEN]
    assert (Role.EDGE, GoAway) in open_state
    assert (Role.NODE, GoAway) not in open_state
