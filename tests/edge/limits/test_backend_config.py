"""``limits.backend`` and its store keys: validation by path, restart class, secrets."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from iopd.config.load import ConfigError, parse_edge_config
from iopd.config.refresh_classify import classify
from iopd.config.schema import EdgeConfig
from iopd.edge.runtime.edge_runtime import config_secrets
from iopd.redact import Scrubber, url_secrets
from tests.support.validate_cases import BASE

PASSWORD = "s3cret-redis-passw0rd"


def load(limits: dict[str, Any], env: dict[str, str] | None = None) -> EdgeConfig:
    data = copy.deepcopy(BASE)
    data["limits"] = limits
    return parse_edge_config(yaml.safe_dump(data), env=env or {})


def errors_of(limits: dict[str, Any]) -> list[str]:
    try:
        load(limits)
    except ConfigError as exc:
        return exc.errors
    return []


def test_defaults_are_the_memory_backend() -> None:
    section = load({}).limits
    assert (section.backend, section.redis_url, section.on_backend_error) == (
        "memory",
        None,
        "local",
    )
    assert (section.backend_timeout, section.lease_ttl) == (0.5, 15.0)


def test_redis_url_takes_an_environment_reference() -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:6379/0"
    section = load(
        {"backend": "redis", "redis_url": "${IOP_REDIS_URL}"}, env={"IOP_REDIS_URL": url}
    ).limits
    assert section.redis_url == url


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({"backend": "redis"}, "limits.redis_url: required when limits.backend is redis"),
        ({"backend": "redis", "redis_url": f"http://:{PASSWORD}@h"}, "limits.redis_url: must be"),
        ({"redis_url": "redis://"}, "limits.redis_url: must be"),
        ({"backend": "valkey"}, "limits.backend"),
        ({"on_backend_error": "ignore"}, "limits.on_backend_error"),
        ({"backend_timeout": 0}, "limits.backend_timeout: must be > 0"),
        ({"lease_ttl": -1}, "limits.lease_ttl: must be > 0"),
        ({"lease_ttl": 1.2, "backend_timeout": 0.5}, "limits.backend_timeout: must be below"),
    ],
)
def test_rule(limits: dict[str, Any], expected: str) -> None:
    found = errors_of(limits)
    assert any(expected in e for e in found), found
    assert not any(PASSWORD in e for e in found)


def test_rediss_is_accepted() -> None:
    assert errors_of({"backend": "redis", "redis_url": "rediss://user:pw@store.internal:6380/2"}) == []


@pytest.mark.parametrize(
    "key, value",
    [
        ("backend", "redis"),
        ("redis_url", "redis://127.0.0.1:6380"),
        ("on_backend_error", "reject"),
        ("backend_timeout", 0.25),
        ("lease_ttl", 30),
    ],
)
def test_every_store_key_is_restart_required(key: str, value: Any) -> None:
    base = {"redis_url": "redis://127.0.0.1:6379"}
    diff = classify(load(base), load({**base, key: value}))
    assert diff.restart_required == [f"limits.{key}"]


def test_the_url_password_is_a_secret_of_the_config() -> None:
    cfg = load({"backend": "redis", "redis_url": f"redis://iop:{PASSWORD}@127.0.0.1:6379"})
    assert PASSWORD in config_secrets(cfg)
    scrubbed = Scrubber(config_secrets(cfg)).scrub(f"cannot reach {cfg.limits.redis_url}")
    assert PASSWORD not in scrubbed and "127.0.0.1:6379" in scrubbed
    assert url_secrets("redis://127.0.0.1:6379") == []
    assert url_secrets("redis://:p%40ss-word@h") == ["p%40ss-word", "p@ss-word"]
