"""An agent run's transcript, read from its history for people: each model request with the
messages that are new in it (tool results included), the model's answer (text and tool calls)
and its tokens.

Model requests are the steps whose scheduled arguments hold a ``"transcript"`` delta
(:mod:`sagaloop.agents.transcript`): the adapters' ``agent__{agent}__model_request`` steps and
any step fed by a :class:`~sagaloop.agents.conversation.Conversation`. Messages are read in the
shapes that Pydantic AI, the OpenAI Agents SDK and Chat Completions give them; anything else
is shown as its JSON, so an unknown shape is never an error.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from sagaloop.engine import history as h
from sagaloop.engine.history import Event

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles of OpenAI's messages (Responses and Chat Completions)."""


@dataclasses.dataclass
class Part:
    kind: str
    """``system``, ``user``, ``assistant``, ``thinking``, ``tool call``, ``tool result`` or
    ``other`` (shown as JSON)."""
    text: str
    label: str = ""
    """The tool's name or call id, for tool calls and results."""


@dataclasses.dataclass
class Request:
    position: int
    step: str
    conversation: str
    n: int
    kept: int
    """How many messages of the previous request it sent again (not shown again)."""
    new: list[Part]
    """Its new messages, less what the page shows above them: the previous answer and
    instructions sent again."""
    after_answer: bool = False
    """Whether it sends the previous request's answer back first (not shown again)."""
    state: str = "scheduled"
    response: list[Part] = dataclasses.field(default_factory=list)
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None


def requests_of(events: list[Event]) -> list[Request]:
    """The model requests of a run, in the order they were made."""
    found: dict[int, Request] = {}
    systems: dict[str, set[str]] = {}
    """The system texts (instructions) each conversation showed already."""
    for ev in events:
        if ev.pos is None:
            continue
        if ev.kind == h.STEP_SCHEDULED:
            delta = _delta(ev.data.get("args"))
            if delta is not None:
                conversation = str(delta.get("conversation") or "")
                new = [p for m in _list(delta.get("append")) for p in message_parts(m)]
                prev = found.get(delta["prev"]) if isinstance(delta.get("prev"), int) else None
                after_answer = prev is not None and _starts_with(new, prev.response)
                if after_answer:
                    assert prev is not None
                    new = new[len(prev.response) :]
                found[ev.pos] = Request(
                    position=ev.pos,
                    step=ev.name or "?",
                    conversation=conversation,
                    n=_int(delta.get("n")),
                    kept=_int(delta.get("keep")),
                    new=_new_systems(new, systems.setdefault(conversation, set())),
                    after_answer=after_answer,
                )
        elif ev.pos in found:
            request = found[ev.pos]
            if ev.kind == h.STEP_COMPLETED:
                result = ev.data.get("result")
                request.state = "completed"
                request.response = response_parts(result)
                request.input_tokens, request.output_tokens = _tokens(result)
            elif ev.kind in (h.STEP_FAILED, h.STEP_RETRYING, h.STEP_HALTED):
                error = ev.data.get("error") or {}
                request.state = {h.STEP_FAILED: "failed", h.STEP_HALTED: "halted"}.get(
                    ev.kind, "retrying"
                )
                request.error = f"{error.get('type')}: {error.get('message')}"
    return [found[pos] for pos in sorted(found)]


def _starts_with(new: list[Part], answer: list[Part]) -> bool:
    return bool(answer) and new[: len(answer)] == answer


def _new_systems(new: list[Part], systems: set[str]) -> list[Part]:
    """``new`` less the instructions that the conversation showed already (some frameworks
    send them with every request)."""
    out = []
    for part in new:
        if part.kind == "system":
            if part.text in systems:
                continue
            systems.add(part.text)
        out.append(part)
    return out


def _delta(args: Any) -> dict[str, Any] | None:
    """The transcript delta among a step's arguments, if any."""
    if not isinstance(args, dict):
        return None
    for value in args.values():
        found = value.get("transcript") if isinstance(value, dict) else None
        if isinstance(found, dict) and isinstance(found.get("append"), list):
            return found
    return None


def message_parts(message: Any) -> list[Part]:
    """The readable parts of one message, whatever the framework that made it."""
    if not isinstance(message, dict):
        return [_other(message)]
    if isinstance(message.get("parts"), list):  # Pydantic AI: ModelRequest, ModelResponse
        parts = [_pydantic_ai_part(p) for p in message["parts"]]
        if isinstance(message.get("instructions"), str) and message["instructions"]:
            parts.insert(0, Part("system", message["instructions"]))
        return parts
    kind = message.get("type")
    if kind == "function_call":  # OpenAI Responses items (the Agents SDK)
        return [Part("tool call", _args(message.get("arguments")), _name(message, "name"))]
    if kind == "function_call_output":
        return [Part("tool result", _text(message.get("output")), _name(message, "call_id"))]
    if kind == "reasoning":
        return [Part("thinking", _text(message.get("summary") or message.get("content")))]
    role = message.get("role")
    if isinstance(role, str) and role in ROLES and kind in (None, "message"):
        parts = []
        content = message.get("content")
        if content not in (None, "", []):
            label = _name(message, "tool_call_id") if role == "tool" else ""
            who = {"developer": "system", "tool": "tool result"}.get(role, role)
            parts.append(Part(who, _text(content), label))
        for call in _list(message.get("tool_calls")):  # Chat Completions
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                parts.append(
                    Part("tool call", _args(function.get("arguments")), _name(function, "name"))
                )
            else:
                parts.append(_other(call))
        return parts or [_other(message)]
    return [_other(message)]


def response_parts(result: Any) -> list[Part]:
    """The readable parts of a model step's recorded result."""
    if not isinstance(result, dict):
        return [_other(result)] if result is not None else []
    response = result.get("response", result.get("message", result))
    if isinstance(response, dict) and isinstance(response.get("output"), list):
        return [p for item in response["output"] for p in message_parts(item)]
    return message_parts(response)


def _pydantic_ai_part(part: Any) -> Part:
    if not isinstance(part, dict):
        return _other(part)
    kind = part.get("part_kind")
    if kind == "system-prompt":
        return Part("system", _text(part.get("content")))
    if kind == "user-prompt":
        return Part("user", _text(part.get("content")))
    if kind == "text":
        return Part("assistant", _text(part.get("content")))
    if kind == "thinking":
        return Part("thinking", _text(part.get("content")))
    if kind == "tool-call":
        return Part("tool call", _args(part.get("args")), _name(part, "tool_name"))
    if kind in ("tool-return", "retry-prompt"):
        label = _name(part, "tool_name") or ("retry" if kind == "retry-prompt" else "")
        return Part("tool result", _text(part.get("content")), label)
    return _other(part)


def _tokens(result: Any) -> tuple[int | None, int | None]:
    """(input, output) tokens of a model step's result, where it says."""
    usage = None
    if isinstance(result, dict):
        response = result.get("response")
        if isinstance(response, dict) and isinstance(response.get("usage"), dict):
            usage = response["usage"]
        elif isinstance(result.get("usage"), dict):
            usage = result["usage"]
    if usage is None:
        return None, None

    def first(*names: str) -> int | None:
        for name in names:
            if isinstance(usage.get(name), int):
                return int(usage[name])
        return None

    return first("input_tokens", "prompt_tokens"), first("output_tokens", "completion_tokens")


def _text(content: Any) -> str:
    """Text content as it reads: a string, the text pieces of a list, else JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for item in content:
            if isinstance(item, str):
                pieces.append(item)
            elif isinstance(item, dict) and isinstance(item.get("text"), str):
                pieces.append(item["text"])
            else:
                pieces.append(_json(item))
        return "\n".join(pieces)
    return _json(content)


def _args(args: Any) -> str:
    """A tool call's arguments as JSON (given as a JSON string or as a value)."""
    if isinstance(args, str):
        try:
            return _json(json.loads(args))
        except ValueError:
            return args
    return _json(args)


def _name(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    return value if isinstance(value, str) else ""


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _other(value: Any) -> Part:
    return Part("other", _json(value))


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)
