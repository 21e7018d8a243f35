"""The loopback admin side: a quart-trio app on hypercorn.

- ``routes.py``: ``create_admin_app(runtime)``, the routes and the per-request checks;
- ``auth.py``: the peer, Host, Origin, JSON-body, token and session checks;
- ``serve.py``: ``AdminServer``, hypercorn's trio worker inside the edge's nursery;
- ``streaming.py``: ``streaming_response``, for routes that stream (the console's events).

The public listener has no route to any of this.
"""

from iopd.edge.admin.auth import bearer_matches, is_loopback_host_header, is_loopback_peer
from iopd.edge.admin.routes import create_admin_app, register_console
from iopd.edge.admin.serve import AdminLimits, AdminServer

__all__ = [
    "AdminLimits",
    "AdminServer",
    "bearer_matches",
    "create_admin_app",
    "is_loopback_host_header",
    "is_loopback_peer",
    "register_console",
]
