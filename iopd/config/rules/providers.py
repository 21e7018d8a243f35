"""The rules of one ``nodes[].providers[]`` entry: its type's required fields,
the API declarations only a passthrough provider takes, bounds."""

from __future__ import annotations

from iopd.config.provider_url import HTTP_PROVIDER_TYPES, base_url_problem
from iopd.config.rules.collect import Errors
from iopd.config.schema import LIFECYCLE_CAPABILITIES, ProviderConfig

__all__ = ["check_provider"]


def check_provider(err: Errors, path: str, p: ProviderConfig) -> None:
    if p.type in HTTP_PROVIDER_TYPES:
        if not p.base_url:
            err.add(
                f"{path}.base_url", f"required for type '{p.type}' (an http:// or https:// URL)"
            )
        else:
            problem = base_url_problem(p.type, p.base_url)
            if problem is not None:
                err.add(f"{path}.base_url", problem)
    if p.anthropic_messages and p.type != "openai":
        err.add(
            f"{path}.anthropic_messages",
            f"only a type 'openai' provider relays the Messages API (this one is '{p.type}')",
        )
    if not p.openai_responses and p.type != "openai":
        err.add(
            f"{path}.openai_responses",
            f"only a type 'openai' provider relays the Responses API (this one is '{p.type}')",
        )
    if p.type == "cli":
        if not p.command:
            err.add(f"{path}.command", "required for type 'cli' (a non-empty argv list)")
        elif not p.command[0].strip():
            err.add(f"{path}.command[0]", "the program must not be empty")
    if p.health_command is not None and (not p.health_command or not p.health_command[0].strip()):
        err.add(f"{path}.health_command", "must be a non-empty argv list when given")
    if not p.models:
        err.add(f"{path}.models", "must list at least one served model name")
    for i, name in enumerate(p.models):
        if not name.strip():
            err.add(f"{path}.models[{i}]", "must not be empty")
    if p.capacity < 1:
        err.add(f"{path}.capacity", f"must be >= 1 (got {p.capacity})")
    if not 0 <= p.long_context_capacity <= max(p.capacity, 0):
        err.add(
            f"{path}.long_context_capacity",
            f"must be between 0 and capacity ({p.capacity}) (got {p.long_context_capacity})",
        )
    err.non_negative(f"{path}.priority", p.priority)
    err.positive(f"{path}.connect_timeout", p.connect_timeout)
    err.positive(f"{path}.read_timeout", p.read_timeout)
    err.positive(f"{path}.first_byte_timeout", p.first_byte_timeout)
    if p.first_byte_timeout > 86400:
        err.add(f"{path}.first_byte_timeout", f"must be at most 86400 (got {p.first_byte_timeout})")
    err.positive(f"{path}.health_interval", p.health_interval)
    err.non_negative(f"{path}.kill_grace", p.kill_grace)
    err.non_negative(f"{path}.delay_ms", p.delay_ms)
    for i, cap in enumerate(p.lifecycle_capabilities):
        if cap not in LIFECYCLE_CAPABILITIES:
            known = ", ".join(sorted(LIFECYCLE_CAPABILITIES))
            err.add(
                f"{path}.lifecycle_capabilities[{i}]",
                f"unknown capability {cap[:60]!r} (known: {known})",
            )
