"""The node's half of the error map: the HTTP client's failure -> the wire code.

The code says how far the request got (the edge's retry rests on it), and
the two that never reached the provider carry a fixed message: the client's
text names the provider's address, which is for the node's log only."""

from __future__ import annotations

import pytest

from iopd.http.client import (
    ProviderConnectError,
    ProviderHTTPError,
    ProviderProtocolError,
    ProviderResetError,
    ProviderTimeoutError,
)
from iopd.node.adapters.base import AdapterError
from iopd.node.adapters.http_relay import adapter_errors
from iopd.vocabulary import ERROR_CODES, NEVER_REACHED

ADDRESS = "all attempts to connect to 10.0.0.7:8000 failed"


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ProviderTimeoutError(ADDRESS), "provider_timeout"),
        (ProviderConnectError(ADDRESS), "provider_unreachable"),
        (ProviderResetError(ADDRESS), "provider_reset"),
        (ProviderProtocolError(ADDRESS), "provider_error"),
        (ProviderHTTPError(ADDRESS), "provider_error"),
    ],
)
def test_each_client_error_has_its_code(exc: ProviderHTTPError, code: str) -> None:
    with pytest.raises(AdapterError) as info, adapter_errors():
        raise exc
    error = info.value
    assert error.code == code and code in ERROR_CODES
    if code in NEVER_REACHED:
        assert error.message == NEVER_REACHED[code] and "10.0.0.7" not in error.message
        assert error.detail == ADDRESS  # the node's log keeps the address
    else:
        assert error.message == ADDRESS


def test_anything_else_passes_through() -> None:
    with pytest.raises(KeyError), adapter_errors():
        raise KeyError("not the client's")
    with adapter_errors():
        pass
