"""A long request lands on the provider that takes long context."""

from __future__ import annotations

import trio

from tests.support.configs import WHOAMI, cli_provider, gateway_yaml, node_entry
from tests.support.gateway import http_request, running_gateway
from tests.support.replies import chat_body

CHAT = "/v1/chat/completions"


async def test_long_request_lands_on_the_long_capable_provider() -> None:
    long_prov = cli_provider(
        "cli-long", WHOAMI.format(pid="cli-long"), extra="        long_context_capacity: 1\n"
    )
    short_prov = cli_provider("cli-short", WHOAMI.format(pid="cli-short"))
    yaml_text = gateway_yaml(
        models="  - id: cli\n    providers: {cli-long: cli, cli-short: cli}\n",
        nodes=node_entry("node-a", long_prov) + node_entry("node-b", short_prov),
        openai_extra="  long_context_threshold_tokens: 20",
    )

    async def served_by(text: str) -> str:
        r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("cli", text))
        assert r.status == 200, r.body
        content: str = r.json()["choices"][0]["message"]["content"].strip()
        return content.removeprefix("served-by-")

    with trio.fail_after(60):
        async with running_gateway(yaml_text) as gw:
            long_text = "y" * 200  # 50 tokens
            assert {await served_by(long_text) for _ in range(4)} == {"cli-long"}
            # Normal requests spread over both (round-robin on equal load).
            assert {await served_by("short") for _ in range(4)} == {"cli-long", "cli-short"}
