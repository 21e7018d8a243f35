"""The ``ollama`` adapter: Ollama's native API.

* ``run()`` — normalized: streaming ``POST /api/chat``; each NDJSON line's
  ``message.content`` is text, ``message.thinking`` reasoning, and
  ``message.tool_calls`` become OpenAI-shaped calls (generated ids, arguments
  as a JSON string).  The final object (``done: true``) gives usage
  (``prompt_eval_count`` / ``eval_count``) and ``done_reason``.
  Generation params map into ``options``: temperature, top_p, seed, stop,
  presence/frequency penalties, top_k, min_p, repeat_penalty, and
  ``max_tokens`` -> ``num_predict``; ``reasoning_effort`` (or
  ``chat_template_kwargs.enable_thinking``) -> ``think`` (:func:`ollama_think`);
  the rest of ``chat_template_kwargs`` has no place in Ollama's API.  ``response_format`` maps to
  ``format`` (``json_object`` -> ``"json"``, ``json_schema`` -> the schema
  object).  Image parts (``image_url`` / ``input_image`` with a ``data:``
  URL, base64) go to the message's ``images``; a remote image URL is a
  ``bad_request``, because the node never fetches a URL a caller chose, and
  so is any other part without text that Ollama cannot take: nothing a
  caller sent is dropped silently.
* ``tunnel()`` — raw relay for the edge's ``/api/*`` routes; usage from the
  ``done: true`` object.  The one exception is ``/v1/embeddings``, which the
  edge sends an ollama provider of a group without an OpenAI-compatible one:
  translated to Ollama's own ``POST /api/embed`` (``input`` a string or
  strings, ``dimensions``) and its answer back to OpenAI's list of
  ``embedding`` objects (``encoding_format: base64`` as float32
  little-endian, as OpenAI sends it), usage from ``prompt_eval_count``
  (:func:`openai_embeddings`).
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import struct

import msgspec

from iopd.http.client import EarlyStart
from iopd.json_types import JSONArray, JSONObject, JSONValue, json_list
from iopd.node.adapters.base import AdapterError, RunOutput, TunnelOutput
from iopd.node.adapters.http_relay import HTTPAdapter, iter_lines
from iopd.node.usage_extract import usage_from_ollama
from iopd.tokens import content_text
from wire.messages import ProviderTunnelRequest, RunRequest, Usage

_decode_json = msgspec.json.Decoder().decode  # faster than json.loads per chunk

# OpenAI param -> Ollama option.
_OPTION_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "max_tokens": "num_predict",
    "max_completion_tokens": "num_predict",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
}
#: ``reasoning_effort`` -> Ollama's ``think`` (a level where the model takes
#: one, gpt-oss; any level turns thinking on for the others).
_THINK_LEVELS: dict[str, bool | str] = {
    "none": False,
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
}


def ollama_think(params: JSONObject) -> bool | str | None:
    """Ollama's ``think`` from the run's params: ``reasoning_effort`` (chat's
    field, Responses' ``reasoning.effort``), else ``chat_template_kwargs.enable_thinking``
    (the Qwen-style switch); None: the model's default."""
    effort = params.get("reasoning_effort")
    if isinstance(effort, str) and effort in _THINK_LEVELS:
        return _THINK_LEVELS[effort]
    kwargs = params.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and isinstance(kwargs.get("enable_thinking"), bool):
        return bool(kwargs["enable_thinking"])
    return None


#: Content part types whose image goes to Ollama's ``images`` (chat; responses).
_IMAGE_PARTS = frozenset({"image_url", "input_image"})


def _image_url(part: JSONObject) -> JSONValue:
    """The URL of an image part: ``image_url.url`` (chat) or ``image_url`` (responses)."""
    ref = part.get("image_url")
    return ref.get("url") if isinstance(ref, dict) else ref


def image_base64(part: JSONObject, where: str) -> str:
    """The base64 payload of an image part with a ``data:`` URL; ``bad_request`` otherwise."""
    url = _image_url(part)
    if not isinstance(url, str) or not url:
        raise AdapterError("bad_request", f"{where}: an image part needs a URL")
    if url[:5].lower() != "data:":
        raise AdapterError(
            "bad_request",
            f"{where}: ollama providers take images as data: URLs with base64 content"
            " (data:image/png;base64,...); the node does not fetch image URLs",
        )
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise AdapterError("bad_request", f"{where}: the data: URL must be base64 (;base64,)")
    # Line breaks (``base64`` wraps at 76 columns) are ignored, as Ollama does;
    # anything else outside the alphabet is an error here, not a 502 there.
    payload = payload.replace("\r", "").replace("\n", "")
    try:
        binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError):
        raise AdapterError("bad_request", f"{where}: the image is not valid base64") from None
    return payload


def _content_and_images(content: JSONValue, where: str) -> tuple[str, list[str]]:
    """A message's text and its images (base64); ``bad_request`` for a part Ollama cannot take."""
    if not isinstance(content, list):
        return content_text(content), []
    images = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or isinstance(part.get("text"), str):
            continue
        here = f"{where}.content[{j}]"
        kind = part.get("type")
        if kind in _IMAGE_PARTS:
            images.append(image_base64(part, here))
        else:
            shown = str(kind)[:40]
            raise AdapterError(
                "bad_request", f"{here}: content part type {shown!r} is not supported by ollama"
            )
    return content_text(content), images


def to_ollama_format(response_format: JSONValue) -> str | JSONObject | None:
    """OpenAI ``response_format`` -> Ollama ``format`` (None: free text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise AdapterError("bad_request", "response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise AdapterError(
                "bad_request", "response_format.json_schema.schema must be a JSON Schema object"
            )
        return schema
    raise AdapterError(
        "bad_request",
        f"response_format.type {str(kind)[:40]!r} is not supported by ollama"
        " (text, json_object or json_schema)",
    )


def to_ollama_messages(messages: list[JSONObject]) -> list[JSONObject]:
    """OpenAI chat messages -> Ollama ``/api/chat`` messages (images as base64 ``images``)."""
    out: list[JSONObject] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            continue
        role = msg.get("role", "user")
        if role == "developer":
            role = "system"
        text, images = _content_and_images(msg.get("content"), f"messages[{i}]")
        converted: JSONObject = {"role": role, "content": text}
        if images:
            converted["images"] = json_list(images)
        calls = msg.get("tool_calls")
        if isinstance(calls, list):
            converted_calls: JSONArray = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict):
                    function = {}
                args = function.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args else {}
                    except ValueError:
                        args = {}
                converted_calls.append(
                    {"function": {"name": function.get("name", ""), "arguments": args}}
                )
            converted["tool_calls"] = converted_calls
        if role == "tool" and isinstance(msg.get("name"), str):
            converted["tool_name"] = msg["name"]
        out.append(converted)
    return out


def to_openai_tool_call(call: JSONValue) -> JSONObject | None:
    """One Ollama tool call -> OpenAI ``{id, type, function{name, arguments(str)}}``."""
    if not isinstance(call, dict):
        return None
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    args = function.get("arguments", {})
    arguments = args if isinstance(args, str) else json.dumps(args, separators=(",", ":"))
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


#: The OpenAI route an ollama provider serves through its own API.
OPENAI_EMBEDDINGS = "/v1/embeddings"
#: Largest ``/api/embed`` answer read (a list of float vectors).
MAX_EMBED_BYTES = 64 * 1024 * 1024
#: The translated answer goes to the edge in pieces of this size, as a relayed body does.
EMBED_CHUNK_BYTES = 64 * 1024


def ollama_embed_body(body: JSONValue) -> JSONObject:
    """An OpenAI embeddings body -> Ollama's ``/api/embed`` body (``bad_request``
    for what Ollama cannot take: token arrays, a non-integer ``dimensions``)."""
    if not isinstance(body, dict):
        raise AdapterError("bad_request", "the embeddings body must be a JSON object")
    inputs = body.get("input")
    if not isinstance(inputs, str) and not (
        isinstance(inputs, list) and inputs and all(isinstance(t, str) for t in inputs)
    ):
        raise AdapterError(
            "bad_request",
            "input: ollama providers embed a string or a non-empty array of strings"
            " (not token arrays)",
        )
    out: JSONObject = {"model": body.get("model"), "input": inputs}
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
            raise AdapterError("bad_request", "dimensions must be a positive integer")
        out["dimensions"] = dimensions
    return out


def openai_embeddings(answer: JSONValue, model: str, encoding: JSONValue) -> tuple[JSONObject, int]:
    """Ollama's ``/api/embed`` answer -> OpenAI's embeddings list, and its input tokens."""
    vectors = answer.get("embeddings") if isinstance(answer, dict) else None
    if not isinstance(vectors, list) or not all(isinstance(v, list) for v in vectors):
        raise AdapterError("provider_error", "provider sent no embeddings")
    data: JSONArray = []
    for i, vector in enumerate(vectors):
        if not isinstance(vector, list):  # (each is: checked above)
            continue
        if encoding == "base64":  # what the openai SDK asks for by default
            try:
                packed = struct.pack(f"<{len(vector)}f", *vector)
            except (struct.error, OverflowError):
                raise AdapterError(
                    "provider_error", "provider sent a non-numeric embedding"
                ) from None
            value: JSONValue = base64.b64encode(packed).decode()
        else:
            value = vector
        data.append({"object": "embedding", "index": i, "embedding": value})
    count = answer.get("prompt_eval_count") if isinstance(answer, dict) else None
    tokens = count if isinstance(count, int) and not isinstance(count, bool) else 0
    doc: JSONObject = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return doc, tokens


class OllamaAdapter(HTTPAdapter):
    """Normalized runs over ``/api/chat`` plus a raw relay of ``/api/*``."""

    usage_flavour = "ollama"
    probe_path = "/api/tags"

    def chat_body(self, req: RunRequest) -> JSONObject:
        """The upstream ``/api/chat`` request for a normalized run."""
        options: JSONObject = {}
        for name, value in req.params.items():
            option = _OPTION_NAMES.get(name)
            if option is not None and value is not None:
                options[option] = value
        body: JSONObject = {
            "model": req.target,
            "messages": json_list(to_ollama_messages(req.messages)),
            "stream": True,
        }
        if options:
            body["options"] = options
        fmt = to_ollama_format(req.params.get("response_format"))
        if fmt is not None:
            body["format"] = fmt
        think = ollama_think(req.params)
        if think is not None:
            body["think"] = think
        if req.tools:
            body["tools"] = json_list(req.tools)
        return body

    def start_early(self, req: ProviderTunnelRequest) -> EarlyStart | None:
        if req.path == OPENAI_EMBEDDINGS:
            return None  # translated first: nothing to start as it is
        return super().start_early(req)

    async def tunnel(
        self, req: ProviderTunnelRequest, out: TunnelOutput, early: EarlyStart | None = None
    ) -> None:
        if req.path != OPENAI_EMBEDDINGS:
            await super().tunnel(req, out, early)
            return
        try:
            body = _decode_json(req.body)
        except ValueError:
            raise AdapterError("bad_request", "the embeddings body is not JSON") from None
        payload = json.dumps(ollama_embed_body(body)).encode()
        async with self.post_json("/api/embed", payload) as resp:
            raw = await resp.read(MAX_EMBED_BYTES + 1)
        if len(raw) > MAX_EMBED_BYTES:
            raise AdapterError("provider_error", "provider sent an oversized embeddings answer")
        try:
            answer = _decode_json(raw)
        except ValueError:
            raise AdapterError("provider_error", "provider sent invalid JSON") from None
        doc, tokens = openai_embeddings(answer, str(body.get("model")), body.get("encoding_format"))
        await out.head(200, [("content-type", "application/json")], body_follows=True)
        data = json.dumps(doc, separators=(",", ":")).encode()
        for start in range(0, len(data), EMBED_CHUNK_BYTES):  # frames stay under the link's cap
            await out.body(data[start : start + EMBED_CHUNK_BYTES])
        out.usage = Usage(input_tokens=tokens)

    async def run(self, req: RunRequest, out: RunOutput) -> None:
        payload = json.dumps(self.chat_body(req)).encode()
        saw_tool_call = False
        done = False
        async with self.post_json("/api/chat", payload) as resp:
            async for line in iter_lines(resp.aiter_bytes()):
                line = line.strip()
                if not line or done:  # read to the end so the connection is reused
                    continue
                try:
                    obj = _decode_json(line)
                except ValueError:
                    raise AdapterError(
                        "provider_error", "provider sent invalid JSON in its stream"
                    ) from None
                if not isinstance(obj, dict):
                    continue
                if "error" in obj:
                    raise AdapterError(
                        "provider_error", f"provider error: {str(obj['error'])[:512]}"
                    )
                message = obj.get("message")
                if isinstance(message, dict):
                    thinking = message.get("thinking")
                    if isinstance(thinking, str) and thinking:
                        await out.reasoning(thinking)
                    content = message.get("content")
                    if isinstance(content, str) and content:
                        await out.text(content)
                    for raw_call in message.get("tool_calls") or []:
                        call = to_openai_tool_call(raw_call)
                        if call is not None:
                            saw_tool_call = True
                            await out.tool_call(call)
                if obj.get("done") is True:
                    usage = usage_from_ollama(obj)
                    if usage is not None:
                        out.usage = usage
                    reason = obj.get("done_reason")
                    out.finish_reason = reason if isinstance(reason, str) and reason else "stop"
                    done = True
        if not done:
            raise AdapterError("provider_error", "provider stream ended before it finished")
        if saw_tool_call and out.finish_reason == "stop":
            out.finish_reason = "tool_calls"
