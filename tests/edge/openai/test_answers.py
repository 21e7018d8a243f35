"""``/api/tags``, answered by the edge: each Ollama group with what its ollama
provider's node last reported of the served model, under the group's id."""

from __future__ import annotations

import json

from iopd.edge.openai import answers
from iopd.edge.openai.app import ROUTES, OpenAIApp
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from iopd.http.connection import Request
from tests.support.configs import OLLAMA_SERVED, ollama_yaml
from tests.support.gateway import edge_config
from wire.messages import ModelDetails, ModelInfo, ProviderHealth, ProviderStatus

PLACEHOLDER = {
    "modified_at": "1970-01-01T00:00:00Z",
    "size": 0,
    "digest": "",
    "details": {},
}


class _Recorder:
    status = 0

    async def send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status, self.body = status, body


async def tags(gate: OpenAIApp) -> list[dict[str, object]]:
    assert ROUTES["/api/tags"].handler is answers.ollama_tags  # no provider is asked
    admitted = gate.check_head("GET", "/api/tags", [])
    request = Request("GET", "/api/tags", "/api/tags", "", [], b"", None, "1.1", admitted)
    responder = _Recorder()
    await gate(request, responder)  # type: ignore[arg-type]
    assert responder.status == 200
    models: list[dict[str, object]] = json.loads(responder.body)["models"]
    return models


async def test_tags_show_the_providers_entry_renamed_or_placeholders() -> None:
    rt = EdgeRuntime.create(edge_config(ollama_yaml("http://127.0.0.1:9")))
    gate = OpenAIApp(rt)
    assert await tags(gate) == [
        {"name": g, "model": g, **PLACEHOLDER} for g in ("llama", "both")
    ]  # nothing known yet

    info = ModelInfo(
        name=OLLAMA_SERVED,
        size=4661224676,
        digest="365c0bd3c000",
        modified_at="2026-11-30T10:00:00Z",
        details=ModelDetails(format="gguf", family="llama", families=["llama"]),
    )
    other = ModelInfo(name="not-served:1b", size=1)
    rt.provider_status(
        "node-a",
        ProviderStatus(providers=[ProviderHealth(provider_id="ol-1", models=[other, info])]),
    )
    entry = {
        "modified_at": "2026-11-30T10:00:00Z",
        "size": 4661224676,
        "digest": "365c0bd3c000",
        "details": {
            "format": "gguf",
            "family": "llama",
            "families": ["llama"],
            "parameter_size": "",
            "quantization_level": "",
            "parent_model": "",
        },
    }
    assert await tags(gate) == [{"name": g, "model": g, **entry} for g in ("llama", "both")]

    # A later report without models (an older node, or a list that no longer
    # names the model) brings the placeholders back.
    rt.provider_status("node-a", ProviderStatus(providers=[ProviderHealth(provider_id="ol-1")]))
    assert await tags(gate) == [{"name": g, "model": g, **PLACEHOLDER} for g in ("llama", "both")]
