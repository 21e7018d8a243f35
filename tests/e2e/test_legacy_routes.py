"""The legacy route forms end to end: ``model_routes`` and the single-target fallback."""

from __future__ import annotations

import trio

from tests.support.configs import WHOAMI, cli_provider, gateway_yaml, node_entry
from tests.support.gateway import http_request, in_thread, running_gateway
from tests.support.replies import chat_body

CHAT = "/v1/chat/completions"


async def test_legacy_routes_and_single_target_fallback() -> None:
    providers = (
        cli_provider("cli-group", WHOAMI.format(pid="cli-group"), models="[g]")
        + cli_provider("cli-route", WHOAMI.format(pid="cli-route"), models="[r]")
        + cli_provider("cli-fallback", WHOAMI.format(pid="cli-fallback"), models="[fb]")
    )
    openai_extra = """  model_routes:
    - {model: legacy-a, node: node-a, adapter: cli-route, target: r}
    - {model: shadowed, node: node-a, adapter: cli-route, target: r}
  node: node-a
  adapter: cli-fallback
  target: fb"""
    yaml_text = gateway_yaml(
        models="  - id: group-m\n    providers: {cli-group: g}\n  - id: shadowed\n    providers: {cli-group: g}\n",
        nodes=node_entry("node-a", providers),
        openai_extra=openai_extra,
    )

    with trio.fail_after(60):
        async with running_gateway(yaml_text) as gw:
            client = gw.sdk()
            models = await in_thread(lambda: client.models.list())
            # models[], then legacy routes (a route shadowed by models[] once), then fallback
            assert [m.id for m in models.data] == ["group-m", "shadowed", "legacy-a", "fb"]

            async def served_by(model: str) -> str:
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body(model, "x"))
                assert r.status == 200, r.body
                assert r.json()["model"] == model
                return str(r.json()["choices"][0]["message"]["content"]).strip()

            assert await served_by("group-m") == "served-by-cli-group"
            assert await served_by("shadowed") == "served-by-cli-group"  # models[] first
            assert await served_by("legacy-a") == "served-by-cli-route"
            assert await served_by("anything-else") == "served-by-cli-fallback"
            assert await served_by("fb") == "served-by-cli-fallback"


# --------------------------------------------------------------------- queue
