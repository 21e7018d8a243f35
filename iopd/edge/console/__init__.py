"""The web console on the admin listener: a server-rendered page, live through SSE.

``console_blueprint(runtime)`` is what the admin application mounts;
``view.py`` builds the one document the page and the event stream share,
``events.py`` streams it, ``templates/`` and ``static/`` ship in the package.
"""

from iopd.edge.console.blueprint import console_blueprint

__all__ = ["console_blueprint"]
