"""The admin API is not reachable from the public listener by any path trick (``/../status``,
``//status``, an absolute-form target at the admin port, ``%2Fstatus``, a ``Host`` naming the
admin listener)."""

from __future__ import annotations

import trio

from tests.support.security_env import security_env


async def test_public_listener_never_reaches_the_admin_api() -> None:
    with trio.fail_after(60):
        async with security_env() as env:
            ahost, aport = env.gw.handle.admin
            admin = f"{ahost}:{aport}"
            targets = [
                "/status",
                "/metrics",
                "/../status",
                "//status",
                "/v1/../status",
                "/%2Fstatus",
                "%2Fstatus",
                "/%2e%2e/status",
                "/v1/%2e%2e/metrics",
                "/./status",
                "/status?x=1",
                f"http://{admin}/status",
                f"http://{admin}/metrics",
                f"http://{admin}//status",
            ]
            for target in targets:
                for method in ("GET", "POST"):
                    for hdrs in ([], [("host", admin)], [("x-forwarded-host", admin)]):
                        body = b'{"mode": "apply"}' if method == "POST" else None
                        r = await env.call(target, body, method=method, headers=hdrs)
                        assert 400 <= r.status < 500, (target, method, r.status)
                        text = r.body.decode()
                        assert "edge_id" not in text and "# HELP" not in text, target
                        assert r.json()["error"]["code"] in (
                            "not_found",
                            "method_not_allowed",
                            "invalid_request_error",
                        )
            for target in ("/refresh", f"http://{admin}/refresh", "/../refresh"):
                r = await env.call(target, {"mode": "apply"})
                assert 400 <= r.status < 500
                assert "applied" not in r.body.decode()
