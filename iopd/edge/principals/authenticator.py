"""Caller authentication on the OpenAI surface and provider-auth lookup.

Tokens are never compared or stored in the clear: the caller's bearer token is
hashed once (SHA-256) and compared with ``hmac.compare_digest`` against *every*
configured principal hash — no early exit, so timing does not reveal which
principal (or whether any) matched — and then against the pre-hashed legacy
``bearer_token``.  With neither configured, the API is open.  No message or
log line here ever contains a token.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

from iopd.config.schema import OpenAISection, ProviderAuth
from iopd.errors import AuthenticationError
from iopd.vocabulary import UNMAPPED

PrincipalSource = Literal["principal_token", "bearer_token", "open"]

#: Run-metadata keys owned by the gateway: callers can never set them.
PRINCIPAL_METADATA_KEYS = (
    "iop_principal_ref",
    "iop_principal_alias",
    "iop_token_ref",
    "iop_principal_source",
)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from, as far as the gateway knows."""

    principal_ref: str
    alias: str
    token_ref: str
    source: PrincipalSource

    @property
    def mapped(self) -> bool:
        """True when a configured principal token matched."""
        return self.source == "principal_token"

    @property
    def label_principal_ref(self) -> str:
        """``principal_ref`` metric label (``unmapped`` unless a principal matched)."""
        return self.principal_ref if self.mapped else UNMAPPED

    @property
    def label_principal_alias(self) -> str:
        """``principal_alias`` metric label: the alias, or the principal_ref when the
        alias is empty; ``unmapped`` unless a principal matched."""
        return (self.alias or self.principal_ref) if self.mapped else UNMAPPED

    @property
    def label_token_ref(self) -> str:
        """``token_ref`` metric label (``unmapped`` unless a principal matched)."""
        return self.token_ref if self.mapped else UNMAPPED


LEGACY_BEARER = Principal(UNMAPPED, UNMAPPED, UNMAPPED, "bearer_token")
OPEN = Principal(UNMAPPED, UNMAPPED, UNMAPPED, "open")


def _sha256(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8")).digest()


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class Authenticator:
    """Authenticates callers against one config snapshot (build once per snapshot)."""

    def __init__(self, openai: OpenAISection) -> None:
        self._principals: list[tuple[bytes, Principal]] = [
            (
                bytes.fromhex(p.token_hash_sha256),
                Principal(p.principal_ref, p.alias, p.token_ref, "principal_token"),
            )
            for p in openai.principal_tokens
        ]
        self._legacy_hash: bytes | None = (
            _sha256(openai.bearer_token) if openai.bearer_token else None
        )

    @property
    def is_open(self) -> bool:
        """True when neither principal tokens nor a bearer token are configured."""
        return not self._principals and self._legacy_hash is None

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> Principal:
        """The caller's :class:`Principal` from its ``Authorization`` header,
        or, without one, from ``x-api-key`` (``api_key``: how Anthropic's
        clients send the same token).

        Raises :class:`iopd.errors.AuthenticationError` (message never echoes
        the token) when auth is configured and the token is missing or wrong.
        """
        if self.is_open:
            return OPEN
        if authorization is None and api_key:
            token: str | None = api_key.strip() or None
        else:
            token = bearer_token(authorization)
        if token is None:
            raise AuthenticationError(
                "Missing or malformed bearer token in Authorization header (or x-api-key)"
            )
        digest = _sha256(token)
        matched: Principal | None = None
        for expected, principal in self._principals:
            # Every hash is compared, match or not: constant work per request.
            if hmac.compare_digest(digest, expected) and matched is None:
                matched = principal
        if matched is not None:
            return matched
        if self._legacy_hash is not None and hmac.compare_digest(digest, self._legacy_hash):
            return LEGACY_BEARER
        raise AuthenticationError("Invalid API key")

    def apply_principal_metadata(
        self, metadata: dict[str, str], principal: Principal
    ) -> dict[str, str]:
        """Same as the module-level :func:`apply_principal_metadata`."""
        return apply_principal_metadata(metadata, principal)


def run_metadata(principal: Principal) -> dict[str, str]:
    """The gateway-owned run metadata describing ``principal``."""
    return {
        "iop_principal_ref": principal.label_principal_ref,
        "iop_principal_alias": principal.label_principal_alias,
        "iop_token_ref": principal.label_token_ref,
        "iop_principal_source": principal.source,
    }


def apply_principal_metadata(metadata: dict[str, str], principal: Principal) -> dict[str, str]:
    """A copy of caller ``metadata`` with every ``iop_principal_*``/``iop_token_ref``
    key dropped and the gateway's own values set."""
    out = {
        key: value
        for key, value in metadata.items()
        if not key.startswith("iop_principal_") and key != "iop_token_ref"
    }
    out.update(run_metadata(principal))
    return out


def provider_auth_value(headers: list[tuple[str, str]], provider_auth: ProviderAuth) -> str | None:
    """The caller's provider token from the configured header (names lower-case), or None."""
    name = provider_auth.header.lower()
    for key, value in headers:
        if key == name:
            value = value.strip()
            return value or None
    return None
