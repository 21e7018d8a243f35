"""Caller authentication, run metadata and provider-auth lookup."""

from __future__ import annotations

import hashlib

import pytest

from iopd.config.schema import OpenAISection, PrincipalToken, ProviderAuth
from iopd.edge.principals.authenticator import (
    Authenticator,
    Principal,
    apply_principal_metadata,
    bearer_token,
    provider_auth_value,
    run_metadata,
)
from iopd.errors import AuthenticationError


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def section(bearer: str | None = None, *principals: tuple[str, str, str, str]) -> OpenAISection:
    return OpenAISection(
        bearer_token=bearer,
        principal_tokens=[
            PrincipalToken(
                token_ref=ref, token_hash_sha256=sha(token), principal_ref=principal, alias=alias
            )
            for token, ref, principal, alias in principals
        ],
    )


ALICE = ("tok-alice", "app-1", "user-1", "alice")
ALICE_CLI = ("tok-alice-cli", "app-2", "user-1", "alice")
BOB = ("tok-bob", "app-3", "user-2", "bob")


def test_principal_token_matches() -> None:
    auth = Authenticator(section(None, ALICE, BOB))
    principal = auth.authenticate("Bearer tok-bob")
    assert principal == Principal("user-2", "bob", "app-3", "principal_token")
    assert run_metadata(principal) == {
        "iop_principal_ref": "user-2",
        "iop_principal_alias": "bob",
        "iop_token_ref": "app-3",
        "iop_principal_source": "principal_token",
    }
    assert principal.label_principal_ref == "user-2"
    assert principal.label_token_ref == "app-3"
    assert principal.label_principal_alias == "bob"


def test_empty_alias_labels_show_the_principal_ref() -> None:
    auth = Authenticator(section(None, ("tok-carol", "app-9", "user-9", "")))
    principal = auth.authenticate("Bearer tok-carol")
    assert principal.label_principal_alias == "user-9"
    assert run_metadata(principal)["iop_principal_alias"] == "user-9"


def test_several_tokens_share_one_principal_ref() -> None:
    auth = Authenticator(section(None, ALICE, ALICE_CLI, BOB))
    first = auth.authenticate("Bearer tok-alice")
    second = auth.authenticate("bearer  tok-alice-cli ")
    assert first.principal_ref == second.principal_ref == "user-1"
    assert (first.token_ref, second.token_ref) == ("app-1", "app-2")


def test_legacy_bearer_is_an_unmapped_caller() -> None:
    auth = Authenticator(section("legacy-secret", ALICE))
    principal = auth.authenticate("Bearer legacy-secret")
    assert principal.source == "bearer_token"
    assert run_metadata(principal) == {
        "iop_principal_ref": "unmapped",
        "iop_principal_alias": "unmapped",
        "iop_token_ref": "unmapped",
        "iop_principal_source": "bearer_token",
    }
    # principal tokens still win over the legacy token
    assert auth.authenticate("Bearer tok-alice").source == "principal_token"


def test_legacy_bearer_alone() -> None:
    auth = Authenticator(section("legacy-secret"))
    assert auth.authenticate("Bearer legacy-secret").source == "bearer_token"
    with pytest.raises(AuthenticationError):
        auth.authenticate("Bearer other")


@pytest.mark.parametrize(
    "header",
    [
        "Bearer wrong-token",
        None,
        "",
        "Basic dG9rLWFsaWNlOg==",
        "Basic tok-alice",
        "Bearer",
        "Bearer ",
        "tok-alice",
        "Token tok-alice",
    ],
)
def test_rejected_callers(header: str | None) -> None:
    auth = Authenticator(section("legacy-secret", ALICE))
    with pytest.raises(AuthenticationError) as info:
        auth.authenticate(header)
    error = info.value
    assert error.status == 401 and error.code == "invalid_api_key"
    for secret in ("tok-alice", "legacy-secret", "wrong-token", "dG9rLWFsaWNlOg=="):
        assert secret not in error.message


def test_open_api_when_nothing_configured() -> None:
    auth = Authenticator(section())
    assert auth.is_open
    for header in (None, "Bearer anything", "Basic x"):
        principal = auth.authenticate(header)
        assert principal.source == "open"
        assert run_metadata(principal)["iop_principal_source"] == "open"
        assert principal.label_principal_ref == "unmapped"


def test_empty_bearer_token_config_means_not_set() -> None:
    assert Authenticator(section("")).is_open


def test_apply_principal_metadata_overwrites_caller_keys() -> None:
    auth = Authenticator(section(None, ALICE))
    principal = auth.authenticate("Bearer tok-alice")
    caller = {
        "iop_principal_ref": "admin",
        "iop_principal_alias": "root",
        "iop_principal_source": "principal_token",
        "iop_principal_extra": "spoof",
        "iop_token_ref": "forged",
        "user": "someone-else",
        "workspace": "/srv/ws",
    }
    out = apply_principal_metadata(caller, principal)
    assert auth.apply_principal_metadata(caller, principal) == out
    assert out == {
        "iop_principal_ref": "user-1",
        "iop_principal_alias": "alice",
        "iop_token_ref": "app-1",
        "iop_principal_source": "principal_token",
        "user": "someone-else",
        "workspace": "/srv/ws",
    }
    assert caller["iop_principal_ref"] == "admin"  # the input is not mutated


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("BEARER abc") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token(None) is None


def test_provider_auth_value() -> None:
    cfg = ProviderAuth(header="X-Provider-Authorization")
    headers = [("content-type", "application/json"), ("x-provider-authorization", " Bearer p ")]
    assert provider_auth_value(headers, cfg) == "Bearer p"
    assert provider_auth_value([("x-provider-authorization", "  ")], cfg) is None
    assert provider_auth_value([("authorization", "Bearer x")], cfg) is None


def test_x_api_key_carries_the_same_tokens() -> None:
    """Anthropic's clients send the token as ``x-api-key``; ``Authorization`` wins when both come."""
    auth = Authenticator(section("legacy-bearer", ALICE, BOB))
    assert auth.authenticate(None, "tok-bob").principal_ref == "user-2"
    assert auth.authenticate(None, "legacy-bearer").source == "bearer_token"
    assert auth.authenticate("Bearer tok-alice", "tok-bob").principal_ref == "user-1"
    for key in ("tok-nobody", "", "   "):
        with pytest.raises(AuthenticationError):
            auth.authenticate(None, key)
    with pytest.raises(AuthenticationError):  # a bad Authorization is not rescued by the key
        auth.authenticate("Bearer wrong", "tok-bob")
