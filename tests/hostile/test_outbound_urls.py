"""No client-chosen outbound URL: ``base_url``/``api_base`` fields, an absolute-form request
target or a crafted ``Host`` never make the node connect anywhere but the configured provider
(a decoy server counts its connections: zero)."""

from __future__ import annotations

import trio

from tests.support.security_env import PROVIDER_AUTH, chat, security_env


async def test_client_supplied_urls_never_cause_an_outbound_connection() -> None:
    with trio.fail_after(60):
        async with security_env() as env:
            decoy = env.decoy
            decoy_hostport = decoy.base_url.removeprefix("http://")
            before = len(env.oa.requests)
            pa = [("x-provider-authorization", f"Bearer {PROVIDER_AUTH}")]
            for model in ("pt", "echo", "ol"):
                for field_name in ("base_url", "api_base", "url", "endpoint"):
                    body = chat(model, **{field_name: decoy.base_url + "/v1"})
                    r = await env.call("/v1/chat/completions", body, headers=pa)
                    assert r.status in (200, 400, 502), r.body
                r = await env.call(
                    "/v1/responses",
                    {"model": model, "input": "hi", "base_url": decoy.base_url},
                    headers=pa,
                )
                assert r.status < 500 or model == "ol"
            # Absolute-form targets and Host headers naming the decoy.
            for target in (
                f"{decoy.base_url}/v1/chat/completions",
                f"http://{decoy_hostport}/v1/responses",
            ):
                r = await env.call(target, chat("pt"), headers=pa)
                assert r.status in (200, 400, 404)
            r = await env.call(
                "/v1/chat/completions",
                chat("pt"),
                headers=[("host", decoy_hostport), *pa],
            )
            assert r.status in (200, 400)
            assert len(env.oa.requests) > before, "the configured provider was used"
            for req in env.oa.requests[before:]:
                assert req.path.startswith("/v1/")
            assert decoy.connections_opened == 0
            assert decoy.requests == []
