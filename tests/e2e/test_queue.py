"""The provider queue end to end: full at ``max_queue: 0``, a queue timeout is 503 with
``Retry-After``, a waiter is admitted when the slot frees, a legacy route's own
``queue_timeout`` wins over the root one."""

from __future__ import annotations

import trio

from tests.support.configs import echo_entry, gateway_yaml, node_entry
from tests.support.gateway import Gateway, RawResponse, http_request, running_gateway, wait_until
from tests.support.replies import assert_error, chat_body

CHAT = "/v1/chat/completions"


def queue_yaml(*, pool: str, delay_ms: int = 30) -> str:
    return gateway_yaml(
        models="  - id: echo\n    providers: {echo-1: echo}\n",
        nodes=node_entry("node-a", echo_entry(capacity=1, delay_ms=delay_ms)),
        pool=pool,
    )


SLOW_TEXT = " ".join(f"w{i}" for i in range(10))  # 10 chunks


async def _hold_slot(gw: Gateway, results: list[RawResponse]) -> None:
    results.append(
        await http_request(gw.host_port, "POST", CHAT, body=chat_body("echo", SLOW_TEXT))
    )


async def test_queue_full_when_max_queue_is_zero() -> None:
    with trio.fail_after(30):
        async with running_gateway(queue_yaml(pool="provider_pool: {max_queue: 0}")) as gw:
            pool = gw.runtime.pool
            first: list[RawResponse] = []
            async with trio.open_nursery() as n:
                n.start_soon(_hold_slot, gw, first)
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 1)
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("echo", "x"))
                assert_error(r, 429, "queue_full")
                assert r.json()["error"]["type"] == "rate_limit_error"
            assert first[0].status == 200
            assert first[0].json()["choices"][0]["message"]["content"] == SLOW_TEXT


async def test_queue_timeout_is_503_with_retry_after() -> None:
    yaml_text = queue_yaml(pool="provider_pool: {max_queue: 4, queue_timeout: 0.05}", delay_ms=60)
    with trio.fail_after(30):
        async with running_gateway(yaml_text) as gw:
            pool = gw.runtime.pool
            first: list[RawResponse] = []
            async with trio.open_nursery() as n:
                n.start_soon(_hold_slot, gw, first)
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 1)
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("echo", "x"))
                assert_error(r, 503, "queue_timeout")
                assert r.json()["error"]["type"] == "server_error"
                retry = r.header("retry-after")
                assert retry is not None and int(retry) >= 1
                assert pool.queue_depth == 0
            assert first[0].status == 200


async def test_waiter_is_admitted_when_the_slot_frees() -> None:
    yaml_text = queue_yaml(pool="provider_pool: {max_queue: 4, queue_timeout: 20}")
    with trio.fail_after(30):
        async with running_gateway(yaml_text) as gw:
            pool = gw.runtime.pool
            first: list[RawResponse] = []
            second: list[RawResponse] = []
            async with trio.open_nursery() as n:
                n.start_soon(_hold_slot, gw, first)
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 1)

                async def waiter() -> None:
                    second.append(
                        await http_request(
                            gw.host_port, "POST", CHAT, body=chat_body("echo", "queued one")
                        )
                    )

                n.start_soon(waiter)
                await wait_until(lambda: pool.queue_depth == 1)
                assert not first  # still holding the slot while the waiter queues
            assert first[0].status == 200
            assert second[0].status == 200
            assert second[0].json()["choices"][0]["message"]["content"] == "queued one"
            assert pool.queue_depth == 0
            await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 0)


async def test_legacy_route_queue_timeout_overrides_the_root_one() -> None:
    yaml_text = gateway_yaml(
        models="  - id: echo\n    providers: {echo-1: echo}\n",
        nodes=node_entry("node-a", echo_entry(capacity=1, delay_ms=60)),
        openai_extra=(
            "  model_routes:\n"
            "    - {model: quick, node: node-a, adapter: echo-1, target: echo, queue_timeout: 0.05}"
        ),
        pool="provider_pool: {max_queue: 4, queue_timeout: 60}",
    )
    with trio.fail_after(20):  # below the root queue_timeout: only the override ends the wait
        async with running_gateway(yaml_text) as gw:
            pool = gw.runtime.pool
            first: list[RawResponse] = []
            async with trio.open_nursery() as n:
                n.start_soon(_hold_slot, gw, first)
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 1)
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("quick", "x"))
                assert_error(r, 503, "queue_timeout")
            assert first[0].status == 200
