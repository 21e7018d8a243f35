"""The label records of ``iop_openai_*`` metrics, checked on construction.

Why a module of its own: these records are how a request handler names what
it counts, and the only door through which a string reaches a label value.
Labels with a fixed vocabulary (``endpoint``, ``response_mode``, ...) must be
members of the sets in :mod:`iopd.vocabulary`; identity labels
(``model_group``, ``principal_ref``, ...) must have the shape of a config id.
A wrong value raises ``ValueError`` -- a programming error in the caller,
caught by tests.  ``iopd.edge.metering.metrics`` re-exports what the request path uses.

Label conventions (also in ``docs/openai-usage-grafana.md``):

* ``principal_ref``/``principal_alias``/``token_ref`` are ``unmapped`` for
  legacy-bearer and open callers and for requests that failed authentication.
* ``model_group`` is the catalog id the request resolved to, or ``unknown``
  (unknown model, failed before the body was parsed, failed auth).
* ``response_mode`` names the execution path actually used: ``passthrough``
  (raw tunnel to a ``type: openai`` provider, and the raw ``/api/*`` relay) or
  ``normalized`` (``RunRequest``).  A request that failed before a provider was
  chosen uses :func:`expected_response_mode`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Protocol

from iopd.vocabulary import (
    ENDPOINTS,
    RELAY_ONLY_ENDPOINTS,
    RESPONSE_MODES,
    UNMAPPED,
    ResponseMode,
    all_passthrough,
)

__all__ = [
    "UNMAPPED_PRINCIPAL",
    "LabelledPrincipal",
    "PrincipalLabels",
    "RequestLabels",
    "check_id_shape",
    "check_member",
    "expected_response_mode",
]

MAX_ID_LEN: Final = 128


def check_member(kind: str, value: str, allowed: frozenset[str]) -> None:
    """``ValueError`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        # The value itself is left out of the message: it may be anything.
        raise ValueError(f"{kind} must be one of {sorted(allowed)}")


def check_id_shape(kind: str, value: str) -> None:
    """A config id: a non-empty printable string without whitespace breaks, bounded."""
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN:
        raise ValueError(f"{kind} must be a non-empty string of at most {MAX_ID_LEN} chars")
    if not value.isprintable():
        raise ValueError(f"{kind} must be printable")


def expected_response_mode(endpoint: str, provider_types: Iterable[str]) -> ResponseMode:
    """The ``response_mode`` of a request before (or without) a provider being chosen.

    ``provider_types`` are the ``type`` values of the resolved group's providers
    (empty when the group is unknown).  ``/api/*``, ``/v1/embeddings`` and
    ``/v1/completions`` are only ever relayed raw, so ``passthrough``; a group made only of passthrough providers always
    tunnels, so ``passthrough``; anything else (mixed, normalized-only, unknown
    group) is ``normalized``.
    """
    check_member("endpoint", endpoint, ENDPOINTS)
    if endpoint in RELAY_ONLY_ENDPOINTS or all_passthrough(provider_types):
        return "passthrough"
    return "normalized"


class LabelledPrincipal(Protocol):
    """An authenticated caller as labels see it (``iopd.edge.principals.authenticator.Principal``)."""

    @property
    def label_principal_ref(self) -> str: ...

    @property
    def label_principal_alias(self) -> str: ...

    @property
    def label_token_ref(self) -> str: ...


@dataclass(frozen=True)
class PrincipalLabels:
    """The identity labels of a matched ``openai.principal_tokens[]`` entry."""

    principal_ref: str
    principal_alias: str
    token_ref: str

    def __post_init__(self) -> None:
        check_id_shape("principal_ref", self.principal_ref)
        check_id_shape("principal_alias", self.principal_alias)
        check_id_shape("token_ref", self.token_ref)

    @classmethod
    def from_config(cls, principal_ref: str, alias: str, token_ref: str) -> PrincipalLabels:
        """Labels of a configured principal token; an empty alias shows the principal_ref."""
        return cls(
            principal_ref=principal_ref, principal_alias=alias or principal_ref, token_ref=token_ref
        )


UNMAPPED_PRINCIPAL: Final = PrincipalLabels(UNMAPPED, UNMAPPED, UNMAPPED)


@dataclass(frozen=True)
class RequestLabels:
    """Everything that labels one finished OpenAI-surface request except ``status``.

    Fixed-vocabulary fields are checked on construction (``ValueError``).
    Use :meth:`build` rather than spelling out the identity fields.
    """

    principal_ref: str
    principal_alias: str
    token_ref: str
    model_group: str
    endpoint: str
    response_mode: str

    def __post_init__(self) -> None:
        check_member("endpoint", self.endpoint, ENDPOINTS)
        check_member("response_mode", self.response_mode, RESPONSE_MODES)
        check_id_shape("principal_ref", self.principal_ref)
        check_id_shape("principal_alias", self.principal_alias)
        check_id_shape("token_ref", self.token_ref)
        check_id_shape("model_group", self.model_group)

    @classmethod
    def build(
        cls,
        principal: PrincipalLabels | LabelledPrincipal | None,
        *,
        model_group: str,
        endpoint: str,
        response_mode: str,
    ) -> RequestLabels:
        """Labels of a finished request; ``principal=None`` means an unmapped caller.

        ``principal`` is the caller as authentication found it (its
        ``label_*`` properties) or its :class:`PrincipalLabels`.
        ``model_group`` must be the resolved catalog id or
        :data:`~iopd.vocabulary.UNKNOWN_GROUP` -- never the caller's ``model``
        string.
        """
        if principal is None:
            ref = alias = token = UNMAPPED
        elif isinstance(principal, PrincipalLabels):
            ref, alias, token = principal.principal_ref, principal.principal_alias, principal.token_ref
        else:
            ref = principal.label_principal_ref
            alias = principal.label_principal_alias
            token = principal.label_token_ref
        return _request_labels(ref, alias, token, model_group, endpoint, response_mode)

    @property
    def principal(self) -> PrincipalLabels:
        """The identity part of these labels."""
        return PrincipalLabels(self.principal_ref, self.principal_alias, self.token_ref)


@functools.lru_cache(maxsize=1024)
def _request_labels(
    ref: str, alias: str, token: str, model_group: str, endpoint: str, response_mode: str
) -> RequestLabels:
    """One checked, immutable :class:`RequestLabels` per distinct set (a request
    finishing with the labels of an earlier one neither builds nor checks them
    again; a set that fails its checks raises every time, it is not kept)."""
    return RequestLabels(ref, alias, token, model_group, endpoint, response_mode)
