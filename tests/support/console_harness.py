"""Where the tests reach the web console of a running edge.

The console is a blueprint (``iopd.edge.console.console_blueprint``) that
the admin listener mounts: ``serving_console`` is that listener's URL, so the
browser tests run against the real thing.  ``console_app`` and
``serving_app`` put the blueprint alone on a minimal QuartTrio app on
hypercorn's trio worker, for tests that give it their own timings or stubs.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart_trio import QuartTrio

from iopd.edge.console import console_blueprint
from iopd.edge.console.events import StreamSlots, StreamTiming
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from tests.support.gateway import Gateway

#: Short ticks: the browser sees a change within a fraction of a second.
FAST_STREAMS = StreamTiming(tick=0.1, heartbeat=5.0, max_age=600.0)


def console_app(
    runtime: EdgeRuntime, timing: StreamTiming = FAST_STREAMS, slots: StreamSlots | None = None
) -> QuartTrio:
    """A bare QuartTrio app with just the console (no auth: the admin app adds it)."""
    app = QuartTrio(__name__)
    app.register_blueprint(console_blueprint(runtime, timing=timing, slots=slots))
    return app


@asynccontextmanager
async def serving_console(gw: Gateway) -> AsyncIterator[str]:
    """The base URL (``http://127.0.0.1:PORT``) of the console of ``gw``'s edge."""
    yield gw.admin_url


@asynccontextmanager
async def serving_app(app: QuartTrio) -> AsyncIterator[str]:
    """Serve ``app`` on hypercorn's trio worker on a loopback port; its base URL."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 1.0
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            functools.partial(serve, app, config, shutdown_trigger=trio.sleep_forever)
        )
        try:
            yield str(binds[0])
        finally:
            nursery.cancel_scope.cancel()
