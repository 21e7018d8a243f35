"""The node's side of its edges: one session per edge it dials (``sessions``,
``link``, the SCRAM handshake in ``handshake``), and what those sessions
share: the providers' slots across edges (``admission``) and what every edge
must agree on (``shared_state``: the config in force, the runtime controls).
The twin of the edge's ``iopd/edge/nodes/``."""
