"""The web console's routes: ``GET /`` (the page), ``GET /events`` (live), static files.

Mounted on the admin listener's quart-trio application, which checks the
caller (Host, Origin, the admin token or session) before a request gets
here.  The page is rendered on the server from the console's document, so
it names every node and provider before any script runs; ``console.js``
then follows ``/events`` and drives the runtime controls' routes.  Nothing
is fetched from outside the edge: the template, the stylesheet and the
script ship in this package.
"""

from __future__ import annotations

import time

from quart import Blueprint, Response, render_template

from iopd.edge.console.events import StreamSlots, StreamTiming, status_events
from iopd.edge.console.view import console_view
from iopd.edge.runtime.edge_runtime import EdgeRuntime

__all__ = ["console_blueprint"]

#: Where the console's own static files are served (not ``/static``: the app may have its own).
STATIC_PATH = "/console/static"


def utc_clock(unix: float | None) -> str:
    """``2025-01-31 12:34:56Z`` (the page's times; the script writes the same form)."""
    if unix is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(unix))


def console_blueprint(
    runtime: EdgeRuntime, *, timing: StreamTiming | None = None, slots: StreamSlots | None = None
) -> Blueprint:
    """The console for ``runtime``: register it on the admin app with no URL prefix.

    ``timing`` and ``slots`` are the event streams' (tests make them short or small).
    """
    bp = Blueprint(
        "console",
        __name__,
        template_folder="templates",
        static_folder="static",
        static_url_path=STATIC_PATH,
    )
    stream_timing = timing or StreamTiming()
    stream_slots = slots or StreamSlots()
    bp.add_app_template_filter(utc_clock, "utc_clock")

    @bp.get("/")
    async def page() -> Response:
        html = await render_template("console/index.html", view=console_view(runtime))
        return Response(html, headers={"Cache-Control": "no-store"})

    @bp.get("/events")
    async def events() -> Response:
        response = Response(
            status_events(runtime, stream_slots, stream_timing),
            mimetype="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
        response.timeout = None  # a stream lives until the client or the edge ends it
        return response

    return bp
