"""Scripted model servers for the coding-agent CLIs: every turn is decided by a script.

A coding agent (Claude Code, Codex CLI, opencode) sends a request holding its
tools and the conversation so far.  The script answers:

* a request with a tool result in it (the agent ran our call): a final text,
  ``FINAL_TEXT``;
* a request offering a tool that writes a file: a call of that tool writing
  ``task.content`` to ``task.path`` (the agent's own write tool where it has
  one, else its shell tool);
* any other request (a title, a summary): a short text.

Three surfaces, each on real sockets like the mocks of ``mock_providers``:

* ``AgentOpenAIServer`` -- an OpenAI-compatible server; ``speaks`` says which
  of ``chat`` (Chat Completions), ``responses`` and ``messages`` (Anthropic's
  Messages API, natively) it serves; the others are 404, as on a server that
  lacks them.  Streaming and not, each with usage;
* ``AgentOllamaServer`` -- Ollama's ``/api/chat`` (NDJSON, native tool calls).

Every reply reports ``INPUT_TOKENS`` / ``OUTPUT_TOKENS``; ``turns`` lists what
each generation request was answered with (``"tool"``, ``"final"``,
``"text"``), so a test can check the metering of every turn.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from tests.support.mock_providers import (
    MockOllamaServer,
    MockOpenAIServer,
    MockReply,
    RecordedRequest,
    sse,
)

__all__ = [
    "AgentTask",
    "AgentOpenAIServer",
    "AgentOllamaServer",
    "FINAL_TEXT",
    "INPUT_TOKENS",
    "OUTPUT_TOKENS",
]

FINAL_TEXT = "The file is written."
INPUT_TOKENS = 23
OUTPUT_TOKENS = 9


@dataclass(frozen=True)
class AgentTask:
    """Write ``content`` to ``path`` (absolute)."""

    path: str
    content: str

    def shell(self) -> str:
        return f"printf %s {shlex.quote(self.content)} > {shlex.quote(self.path)}"


def tool_call_for(task: AgentTask, tool_names: list[str]) -> tuple[str, dict[str, Any]] | None:
    """The call (name, arguments) that makes the agent write the file, or None."""
    by_name: dict[str, dict[str, Any]] = {
        "write": {"filePath": task.path, "content": task.content},  # opencode
        "Write": {"file_path": task.path, "content": task.content},  # Claude Code
        "exec_command": {"cmd": task.shell()},  # Codex (unified exec)
        "shell_command": {"command": task.shell()},  # Codex
        "shell": {"command": ["bash", "-lc", task.shell()]},  # Codex (older)
        "bash": {"command": task.shell(), "description": "Write the file"},  # opencode
        "Bash": {"command": task.shell(), "description": "Write the file"},  # Claude Code
    }
    for name, arguments in by_name.items():
        if name in tool_names:
            return name, arguments
    return None


def _chat_tool_names(body: dict[str, Any]) -> list[str]:
    return [str((t.get("function") or {}).get("name")) for t in body.get("tools") or []]


def _responses_tool_names(body: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for tool in body.get("tools") or []:
        if tool.get("type") == "function":
            names.append(str(tool.get("name")))
        elif tool.get("type") == "namespace":
            names += [str(t.get("name")) for t in tool.get("tools") or []]
    return names


def _chat_has_result(body: dict[str, Any]) -> bool:
    return any(m.get("role") == "tool" for m in body.get("messages") or [])


def _responses_has_result(body: dict[str, Any]) -> bool:
    items = body.get("input")
    if not isinstance(items, list):
        return False
    kinds = ("function_call_output", "custom_tool_call_output")
    return any(isinstance(i, dict) and i.get("type") in kinds for i in items)


def _messages_has_result(body: dict[str, Any]) -> bool:
    for message in body.get("messages") or []:
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_result" for b in content
        ):
            return True
    return False


class _Script:
    """The decision shared by every surface; records each turn's answer."""

    def __init__(self, task: AgentTask) -> None:
        self.task = task
        self.turns: list[str] = []

    def decide(self, has_result: bool, tool_names: list[str]) -> tuple[str, dict[str, Any]] | str:
        """A (tool name, arguments) call, or the text to answer."""
        if has_result:
            self.turns.append("final")
            return FINAL_TEXT
        call = tool_call_for(self.task, tool_names)
        if call is None:
            self.turns.append("text")
            return "Writing a file"
        self.turns.append("tool")
        return call


class AgentOpenAIServer(MockOpenAIServer):
    """An OpenAI-compatible server scripted for ``task``, serving the APIs in ``speaks``."""

    def __init__(self, task: AgentTask, *, speaks: tuple[str, ...] = ("chat",)) -> None:
        super().__init__()
        self.script = _Script(task)
        self.speaks = speaks
        self.models = ["served"]
        self.extra_fields = {}
        self.usage = {"prompt_tokens": INPUT_TOKENS, "completion_tokens": OUTPUT_TOKENS}

    @property
    def turns(self) -> list[str]:
        return self.script.turns

    def route(self, req: RecordedRequest) -> MockReply:
        if req.method == "HEAD":  # a reachability probe (Claude Code sends one)
            return MockReply(headers=[])
        routes = {
            "/v1/chat/completions": "chat",
            "/v1/responses": "responses",
            "/v1/messages": "messages",
        }
        surface = routes.get(req.path.split("?")[0]) if req.method == "POST" else None
        if surface is None:
            return super().route(req)
        if surface not in self.speaks:
            return MockReply(status=404, body=b'{"error": {"message": "not found"}}')
        body = req.json() or {}
        if surface == "chat":
            return self._scripted_chat(body)
        if surface == "responses":
            return self._scripted_responses(body)
        return self._scripted_messages(body)

    # ------------------------------------------------------------ chat

    def _scripted_chat(self, body: dict[str, Any]) -> MockReply:
        decision = self.script.decide(_chat_has_result(body), _chat_tool_names(body))
        if isinstance(decision, str):
            self.reply_text, self.tool_calls = decision, []
        else:
            name, arguments = decision
            self.reply_text = ""
            self.tool_calls = [{"name": name, "arguments": json.dumps(arguments)}]
        return self._chat(body)

    # ------------------------------------------------------------ responses

    def _scripted_responses(self, body: dict[str, Any]) -> MockReply:
        decision = self.script.decide(_responses_has_result(body), _responses_tool_names(body))
        if isinstance(decision, str):
            item: dict[str, Any] = {
                "type": "message",
                "id": "msg_agent",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": decision, "annotations": []}],
            }
        else:
            item = {
                "type": "function_call",
                "id": "fc_agent",
                "call_id": "call_agent",
                "name": decision[0],
                "arguments": json.dumps(decision[1]),
                "status": "completed",
            }
        response = {
            "id": "resp_agent",
            "object": "response",
            "created_at": 1,
            "status": "completed",
            "model": body.get("model", ""),
            "output": [item],
            "usage": {
                "input_tokens": INPUT_TOKENS,
                "output_tokens": OUTPUT_TOKENS,
                "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }
        if not body.get("stream"):
            return MockReply(body=json.dumps(response).encode())
        started = {**response, "status": "in_progress", "output": [], "usage": None}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": started},
            {"type": "response.in_progress", "response": started},
        ]
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": []}
            where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": 0,
                    "item": {**item, "status": "in_progress", "content": []},
                },
                {"type": "response.content_part.added", **where, "part": part},
                {"type": "response.output_text.delta", **where, "delta": text},
                {"type": "response.output_text.done", **where, "text": text},
                {"type": "response.content_part.done", **where, "part": item["content"][0]},
            ]
        else:
            where = {"item_id": item["id"], "output_index": 0}
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": 0,
                    "item": {**item, "status": "in_progress", "arguments": ""},
                },
                {
                    "type": "response.function_call_arguments.delta",
                    **where,
                    "delta": item["arguments"],
                },
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "arguments": item["arguments"],
                },
            ]
        events += [
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {"type": "response.completed", "response": response},
        ]
        chunks = [
            f"event: {e['type']}\n".encode() + sse({**e, "sequence_number": n})
            for n, e in enumerate(events)
        ]
        return MockReply(headers=[("content-type", "text/event-stream")], chunks=chunks)

    # ------------------------------------------------------------ messages

    def _scripted_messages(self, body: dict[str, Any]) -> MockReply:
        names = [str(t.get("name")) for t in body.get("tools") or []]
        decision = self.script.decide(_messages_has_result(body), names)
        if isinstance(decision, str):
            block: dict[str, Any] = {"type": "text", "text": decision}
            stop = "end_turn"
        else:
            block = {
                "type": "tool_use",
                "id": "toolu_agent",
                "name": decision[0],
                "input": decision[1],
            }
            stop = "tool_use"
        usage = {"input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS}
        message = {
            "id": "msg_agent",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", ""),
            "content": [block],
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }
        if not body.get("stream"):
            return MockReply(body=json.dumps(message).encode())
        if block["type"] == "text":
            opened: dict[str, Any] = {"type": "text", "text": ""}
            delta: dict[str, Any] = {"type": "text_delta", "text": block["text"]}
        else:
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events: list[dict[str, Any]] = [
            {
                "type": "message_start",
                "message": {
                    **message,
                    "content": [],
                    "stop_reason": None,
                    "usage": {"input_tokens": INPUT_TOKENS, "output_tokens": 1},
                },
            },
            {"type": "content_block_start", "index": 0, "content_block": opened},
            {"type": "ping"},
            {"type": "content_block_delta", "index": 0, "delta": delta},
            {"type": "content_block_stop", "index": 0},
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": OUTPUT_TOKENS},
            },
            {"type": "message_stop"},
        ]
        chunks = [f"event: {e['type']}\n".encode() + sse(e) for e in events]
        return MockReply(headers=[("content-type", "text/event-stream")], chunks=chunks)


class AgentOllamaServer(MockOllamaServer):
    """An Ollama server whose ``/api/chat`` is scripted for ``task``."""

    def __init__(self, task: AgentTask) -> None:
        super().__init__()
        self.script = _Script(task)
        self.prompt_eval_count = INPUT_TOKENS
        self.eval_count = OUTPUT_TOKENS

    @property
    def turns(self) -> list[str]:
        return self.script.turns

    def route(self, req: RecordedRequest) -> MockReply:
        if req.method == "POST" and req.path == "/api/chat":
            body = req.json() or {}
            decision = self.script.decide(_chat_has_result(body), _chat_tool_names(body))
            if isinstance(decision, str):
                self.reply_text, self.tool_calls = decision, []
            else:
                self.reply_text = ""
                self.tool_calls = [{"name": decision[0], "arguments": decision[1]}]
            return self._generate(body, chat=True)
        return super().route(req)
