"""SCRAM-SHA-256 of the node handshake: RFC 7677's test vector and the verifier's properties."""

from __future__ import annotations

import base64

import pytest

from wire import scram

# RFC 7677 section 3: user "user", password "pencil".
RFC_CLIENT_NONCE = "rOprNGfwEbeRWgbNEkqO"
RFC_NONCE = "rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC_PROOF = base64.b64decode("dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
RFC_SERVER_SIGNATURE = base64.b64decode("6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")


def rfc_auth() -> bytes:
    return scram.auth_message("user", RFC_CLIENT_NONCE, RFC_NONCE, RFC_SALT, 4096)


def test_rfc7677_auth_message_is_the_rfc_text() -> None:
    assert rfc_auth() == (
        b"n=user,r=rOprNGfwEbeRWgbNEkqO,"
        b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096,"
        b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
    )


def test_rfc7677_client_proof_and_server_signature() -> None:
    salted = scram.salted_password("pencil", RFC_SALT, 4096)
    assert scram.client_proof(salted, rfc_auth()) == RFC_PROOF
    assert scram.server_signature(scram.server_key(salted), rfc_auth()) == RFC_SERVER_SIGNATURE
    assert scram.verify_server_signature(salted, rfc_auth(), RFC_SERVER_SIGNATURE)


def test_rfc7677_verifier_accepts_the_rfc_proof_and_rejects_others() -> None:
    verifier = scram.Verifier.create("pencil", iterations=4096, salt=RFC_SALT)
    assert verifier.verify_proof(rfc_auth(), RFC_PROOF)
    assert not verifier.verify_proof(rfc_auth(), bytes(32))
    assert not verifier.verify_proof(rfc_auth(), RFC_PROOF[:-1])  # wrong length
    other_auth = scram.auth_message("user", RFC_CLIENT_NONCE, RFC_NONCE + "x", RFC_SALT, 4096)
    assert not verifier.verify_proof(other_auth, RFC_PROOF)  # a replay with a new nonce


def test_verifier_cannot_make_a_proof() -> None:
    """What an edge stores (StoredKey, ServerKey) signed as if it were the password
    or the salted password does not verify: the verifier is not a login."""
    verifier = scram.Verifier.create("secret-token", iterations=4096)
    auth = scram.auth_message("n", "a" * 24, "a" * 48, verifier.salt, verifier.iterations)
    for key in (verifier.stored_key, verifier.server_key):
        assert not verifier.verify_proof(auth, scram.client_proof(key, auth))
    encoded = verifier.encode()
    forged = scram.client_proof(
        scram.salted_password(encoded, verifier.salt, verifier.iterations), auth
    )
    assert not verifier.verify_proof(auth, forged)


def test_salts_differ_per_verifier_so_proofs_do_not_transfer() -> None:
    one = scram.Verifier.create("tok", iterations=4096)
    two = scram.Verifier.create("tok", iterations=4096)
    assert one.salt != two.salt and one.stored_key != two.stored_key
    auth = scram.auth_message("n", "c" * 24, "c" * 48, one.salt, 4096)
    proof = scram.client_proof(scram.salted_password("tok", one.salt, 4096), auth)
    assert one.verify_proof(auth, proof)
    assert not two.verify_proof(auth, proof)


def test_verifier_round_trips_through_its_config_string() -> None:
    verifier = scram.Verifier.create("tok", iterations=5000)
    text = verifier.encode()
    assert text.startswith("SCRAM-SHA-256$5000:")
    assert scram.Verifier.parse(text) == verifier
    assert "tok" not in repr(verifier)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "tok",
        "SCRAM-SHA-1$4096:c2FsdA==$" + "A" * 44 + ":" + "A" * 44,
        "SCRAM-SHA-256$10:c2FsdA==$" + "A" * 43 + "=:" + "A" * 43 + "=",  # too few iterations
        "SCRAM-SHA-256$99999999:c2FsdA==$" + "A" * 43 + "=:" + "A" * 43 + "=",
        "SCRAM-SHA-256$4096:c2FsdA$" + "A" * 43 + "=:" + "A" * 43 + "=",  # bad padding
        "SCRAM-SHA-256$4096:c2FsdA==$" + "A" * 44 + ":" + "A" * 44,  # 33-byte keys
    ],
)
def test_bad_verifier_strings_are_refused(text: str) -> None:
    with pytest.raises(ValueError) as info:
        scram.Verifier.parse(text)
    assert "c2FsdA" not in str(info.value)  # never echoes the value


def test_nonces_are_fresh_and_checked() -> None:
    a, b = scram.new_nonce(), scram.new_nonce()
    assert a != b and scram.nonce_problem(a) is None
    assert scram.nonce_problem("short") is not None
    assert scram.nonce_problem("x" * 20 + ",") is not None
    assert scram.nonce_problem("x" * 200) is not None
    assert scram.nonce_problem("é" * 20) is not None
