"""What the node lets an edge make it do: the node's consent to a pushed provider.

Why on the node: an edge pushes every provider a node runs, with its
``command`` and ``base_url``.  Without a check of the node's own, whoever
owns one edge (or its address) runs any program as the node's user and sends
requests anywhere the node can reach, on every node of the fleet.  So the
node's config names what any edge may make it run:

* ``node.allowed_commands``: argv prefixes.  A pushed ``command`` and a
  pushed ``health_command`` must each start with one of them, element by
  element (``["ollama", "run"]`` admits ``["ollama", "run", "qwen3"]``, not
  ``["ollama", "serve"]`` nor ``["sh", "-c", ...]``).  Empty: no command.
* ``node.allowed_provider_origins``: ``scheme://host[:port]``.  A pushed
  ``base_url`` must reach one of them (compared as the provider client
  parses it: scheme, host, port with the scheme's default).  Empty: loopback
  hosts only (127.0.0.0/8, ::1, localhost).

A provider outside that consent is refused: never built, never probed (a
health probe of a cli provider runs its ``health_command``), reported to the
edge as unhealthy with the reason.  The rest of the push applies.

Pure: ``Consent.refusal`` says why a spec is refused, or None.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from iopd.config.addresses import Origin, is_loopback_host, parse_provider_origin, url_origin
from iopd.config.schema import NodeSection
from wire.messages import ProviderSpec

__all__ = ["REFUSED_PREFIX", "Consent"]

#: How a refusal's ``last_error`` starts, on the node's log and the edge's ``/status``.
REFUSED_PREFIX = "refused by node: "


@dataclass(frozen=True)
class Consent:
    """The commands and provider origins a node lets any edge use."""

    commands: tuple[tuple[str, ...], ...] = ()
    #: None: loopback hosts only (no ``node.allowed_provider_origins``).
    origins: frozenset[Origin] | None = None

    @classmethod
    def of_node(cls, node: NodeSection) -> Consent:
        """The consent a node's own config gives (its entries validated at load)."""
        origins = frozenset(parse_provider_origin(o) for o in node.allowed_provider_origins)
        return cls(
            commands=tuple(tuple(c) for c in node.allowed_commands),
            origins=origins if node.allowed_provider_origins else None,
        )

    @classmethod
    def listed(cls, providers: Iterable[ProviderSpec]) -> Consent:
        """Exactly what ``providers`` use: for a node whose providers its operator
        listed in the same file (the edge's embedded node)."""
        commands: list[tuple[str, ...]] = []
        origins: set[Origin] = set()
        for spec in providers:
            for argv in (spec.command, spec.health_command):
                if argv:
                    commands.append(tuple(argv))
            if spec.base_url:
                try:
                    origins.add(url_origin(spec.base_url))
                except ValueError:
                    pass  # not a URL: the registry refuses it anyway
        return cls(commands=tuple(commands), origins=frozenset(origins))

    def refusal(self, spec: ProviderSpec) -> str | None:
        """Why ``spec`` is outside this consent (``REFUSED_PREFIX`` + the reason), or None."""
        for field, argv in (("command", spec.command), ("health_command", spec.health_command)):
            if argv is not None and not self._command_allowed(argv):
                return (
                    f"{REFUSED_PREFIX}its {field} (program {_program(argv)}) starts with no "
                    f"entry of node.allowed_commands; add its argv prefix there to run it"
                )
        if spec.base_url is not None:
            problem = self._origin_problem(spec.base_url)
            if problem is not None:
                return f"{REFUSED_PREFIX}{problem}"
        return None

    def _command_allowed(self, argv: Sequence[str]) -> bool:
        if not argv:
            return True  # nothing to run: the registry refuses an empty command
        return any(len(p) <= len(argv) and tuple(argv[: len(p)]) == p for p in self.commands)

    def _origin_problem(self, base_url: str) -> str | None:
        try:
            scheme, host, port = url_origin(base_url)
        except ValueError as exc:
            return f"its base_url {exc}"
        shown = f"{scheme}://{_host_text(host)}:{port}"
        if self.origins is None:
            if is_loopback_host(host):
                return None
            return (
                f"its base_url reaches {shown}, not a loopback host; list that origin "
                f"in node.allowed_provider_origins to allow it"
            )
        if (scheme, host, port) in self.origins:
            return None
        return (
            f"its base_url reaches {shown}, which is not in node.allowed_provider_origins; "
            f"add it there to allow it"
        )


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _program(argv: Sequence[str]) -> str:
    """The program of ``argv`` for a log line: bounded, and never its arguments
    (an argument may carry a secret)."""
    return repr(argv[0][:120])
