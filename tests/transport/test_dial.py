"""dial (a refused connection, a TLS handshake that never ends) and Backoff (full jitter, the cap)."""

from __future__ import annotations

import ssl

import pytest
import trio
import trio.testing

from iopd.transport import Backoff, DialError, dial


async def test_dial_refused_is_dial_error() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    with trio.fail_after(5), pytest.raises(DialError) as info:
        await dial("127.0.0.1", port, connect_timeout=2)
    assert f"127.0.0.1:{port}" in info.value.reason


async def test_dial_tls_handshake_timeout(autojump_clock: trio.testing.MockClock) -> None:
    # A TCP listener that never speaks TLS: the handshake times out.
    async def silent(stream: trio.abc.Stream) -> None:
        await trio.sleep_forever()

    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, silent, 0)
            port = listeners[0].socket.getsockname()[1]
            ctx = ssl.create_default_context()
            with pytest.raises(DialError, match="timed out"):
                await dial("127.0.0.1", port, ssl_context=ctx, connect_timeout=3)
            nursery.cancel_scope.cancel()


def test_backoff_full_jitter_and_cap() -> None:
    values = iter([1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0])
    b = Backoff(0.5, 4.0, rng=lambda: next(values))
    assert [b.next() for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert b.next() == 2.0  # jitter: half of the capped ceiling
    assert b.next() == 0.0
    b.reset()
    assert b.ceiling() == 0.5
    with pytest.raises(ValueError):
        Backoff(0, 1)


def test_backoff_random_delays_within_bounds() -> None:
    b = Backoff(0.5, 30.0)
    for attempt in range(200):
        ceiling = b.ceiling()
        assert ceiling == min(30.0, 0.5 * 2**attempt)
        assert 0.0 <= next(b) <= ceiling
    assert 15.0 <= b.max_delay() <= 30.0
