"""Provider-auth forwarding end to end: the forwarded header reaches the provider and the
caller's ``Authorization`` does not; a group that requires it refuses before queueing."""

from __future__ import annotations

import trio

from tests.support.configs import echo_entry, gateway_yaml, http_provider, node_entry
from tests.support.gateway import http_request, running_gateway, wait_until
from tests.support.mock_providers import MockOpenAIServer
from tests.support.replies import assert_error, chat_body

CHAT = "/v1/chat/completions"


def mixed_auth_yaml(base_url: str, *, required: bool, capacity: int = 4, pool: str = "") -> str:
    return gateway_yaml(
        models=(
            "  - id: remote\n    providers: {oa-1: mock-model}\n"
            "  - id: echo\n    providers: {echo-1: echo}\n"
        ),
        nodes=node_entry(
            "node-a",
            http_provider("oa-1", "openai", base_url, models="[mock-model]", capacity=capacity)
            + echo_entry(delay_ms=0),
        ),
        openai_extra=(
            "  provider_auth: {header: X-Provider-Authorization, target_header: Authorization,"
            f" required: {'true' if required else 'false'}}}"
        ),
        pool=pool,
    )


async def test_provider_auth_forwarded_and_caller_authorization_dropped() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            async with running_gateway(mixed_auth_yaml(mock.base_url, required=False)) as gw:
                r = await http_request(
                    gw.host_port,
                    "POST",
                    CHAT,
                    body=chat_body("remote", "hi"),
                    headers=[
                        ("authorization", "Bearer caller-secret-1"),
                        ("x-provider-authorization", "Bearer provider-key-9"),
                    ],
                )
                assert r.status == 200, r.body
                sent = mock.requests[-1]
                assert sent.header("authorization") == "Bearer provider-key-9"
                assert sent.header("x-provider-authorization") is None
                assert b"caller-secret-1" not in repr(sent.headers).encode()
                # Without the header: the caller's Authorization is still not forwarded.
                r = await http_request(
                    gw.host_port,
                    "POST",
                    CHAT,
                    body=chat_body("remote", "hi"),
                    headers=[("authorization", "Bearer caller-secret-1")],
                )
                assert r.status == 200
                assert mock.requests[-1].header("authorization") is None
            n.cancel_scope.cancel()


async def test_provider_auth_required_rejects_before_queueing() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            mock.chunk_delay = 0.05
            yaml_text = mixed_auth_yaml(
                mock.base_url, required=True, capacity=1, pool="provider_pool: {max_queue: 0}"
            )
            async with running_gateway(yaml_text) as gw:
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("remote", "hi"))
                assert_error(r, 401, "provider_auth_required")
                assert r.json()["error"]["type"] == "authentication_error"
                assert mock.requests == [] or all(q.method == "GET" for q in mock.requests)
                # Normalized groups do not need it.
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("echo", "hi"))
                assert r.status == 200
                # With the only slot busy (max_queue 0), a request without the header is
                # still a 401, not a 429: the check comes before the queue.
                pool = gw.runtime.pool
                done = trio.Event()

                async def busy() -> None:
                    await http_request(
                        gw.host_port,
                        "POST",
                        CHAT,
                        body=chat_body("remote", "hi", stream=True),
                        headers=[("x-provider-authorization", "Bearer k")],
                    )
                    done.set()

                n.start_soon(busy)
                await wait_until(lambda: pool.provider_loads()["oa-1"].in_flight == 1)
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("remote", "hi"))
                assert_error(r, 401, "provider_auth_required")
                r = await http_request(
                    gw.host_port,
                    "POST",
                    CHAT,
                    body=chat_body("remote", "hi"),
                    headers=[("x-provider-authorization", "Bearer k")],
                )
                assert_error(r, 429, "queue_full")
                await done.wait()
            n.cancel_scope.cancel()
