"""The ``openai`` adapter: any OpenAI-compatible server (vLLM, SGLang, llama.cpp, hosted APIs).

Two paths:

* ``tunnel()`` — passthrough: the edge's request is relayed as it
  is (see ``http_relay.HTTPAdapter.tunnel``) and usage is read from the body.
* ``run()`` — normalized: one streaming ``POST /v1/chat/completions`` whose
  SSE deltas become text / reasoning (``reasoning_content`` or ``reasoning``)
  / tool calls (deltas assembled by ``index``, emitted whole at the end) and
  whose final chunk gives usage.

``api_key`` (if set) goes out as ``Authorization: Bearer``; a forwarded
Authorization header from the edge (provider auth forwarding) wins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import msgspec

from iopd.json_types import JSONObject, JSONValue, json_list
from iopd.node.adapters.base import AdapterError, RunOutput
from iopd.node.adapters.http_relay import HTTPAdapter, iter_lines
from iopd.node.usage_extract import usage_from_openai
from wire.messages import RunRequest

_decode_json = msgspec.json.Decoder().decode  # faster than json.loads per chunk

# Request fields the adapter owns; caller params never override them.
_OWNED_FIELDS = frozenset({"model", "messages", "stream", "stream_options", "tools"})


class _ToolCallAssembler:
    """Joins streamed ``tool_calls`` deltas (by ``index``) into whole calls."""

    def __init__(self) -> None:
        self._calls: dict[int, _PartialCall] = {}

    def add(self, delta: JSONObject) -> None:
        index = delta.get("index", len(self._calls))
        if not isinstance(index, int):
            return
        call = self._calls.setdefault(index, _PartialCall())
        call_id = delta.get("id")
        if isinstance(call_id, str) and call_id:
            call.id = call_id
        function = delta.get("function")
        if isinstance(function, dict):
            name, arguments = function.get("name"), function.get("arguments")
            if isinstance(name, str) and name:
                call.name = name
            if isinstance(arguments, str):
                call.arguments.append(arguments)

    def calls(self) -> list[JSONObject]:
        return [
            {
                "id": c.id or f"call_{index}",
                "type": "function",
                "function": {"name": c.name, "arguments": "".join(c.arguments)},
            }
            for index, c in sorted(self._calls.items())
        ]


@dataclass(slots=True)
class _PartialCall:
    """One tool call as its deltas arrive: the latest id and name, the argument pieces."""

    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class OpenAIAdapter(HTTPAdapter):
    """Passthrough relay plus a normalized path over Chat Completions."""

    usage_flavour = "openai"
    probe_path = "/v1/models"

    def chat_body(self, req: RunRequest) -> JSONObject:
        """The upstream Chat Completions request for a normalized run."""
        body: JSONObject = {k: v for k, v in req.params.items() if k not in _OWNED_FIELDS}
        body.update(
            model=req.target,
            messages=json_list(req.messages),
            stream=True,
            stream_options={"include_usage": True},
        )
        if req.tools:
            body["tools"] = json_list(req.tools)
        return body

    async def run(self, req: RunRequest, out: RunOutput) -> None:
        payload = json.dumps(self.chat_body(req)).encode()
        tools = _ToolCallAssembler()
        finished = done = False
        async with self.post_json(
            "/v1/chat/completions", payload, accept="text/event-stream"
        ) as resp:
            async for line in iter_lines(resp.aiter_bytes()):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    # keep reading to the end so the connection can be reused
                    finished = done = True
                if not data or done:
                    continue
                try:
                    chunk = _decode_json(data)
                except ValueError:
                    raise AdapterError(
                        "provider_error", "provider sent invalid JSON in its stream"
                    ) from None
                if await self._chunk(chunk, out, tools):
                    finished = True
        for call in tools.calls():
            await out.tool_call(call)
        if not finished:
            raise AdapterError("provider_error", "provider stream ended before it finished")

    async def _chunk(self, chunk: JSONValue, out: RunOutput, tools: _ToolCallAssembler) -> bool:
        """Handle one chunk; True when it carried a finish_reason."""
        if not isinstance(chunk, dict):
            return False
        if isinstance(chunk.get("error"), dict | str):
            err = chunk["error"]
            message = err.get("message", "") if isinstance(err, dict) else err
            raise AdapterError("provider_error", f"provider error: {str(message)[:512]}")
        usage = usage_from_openai(chunk.get("usage"))
        if usage is not None:
            out.usage = usage
        finished = False
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                # One text under two names (vLLM sent both for a while): relay it once.
                for field in ("reasoning_content", "reasoning"):
                    text = delta.get(field)
                    if isinstance(text, str) and text:
                        await out.reasoning(text)
                        break
                content = delta.get("content")
                if isinstance(content, str) and content:
                    await out.text(content)
                calls = delta.get("tool_calls")
                for call in calls if isinstance(calls, list) else []:
                    if isinstance(call, dict):
                        tools.add(call)
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                out.finish_reason = reason
                finished = True
        return finished
