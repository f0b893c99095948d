"""An agent run's transcript, read from its history for people: each model request with the
messages that are new in it (tool results included), the model's answer (text and tool calls)
and its tokens.

Model requests are the steps whose scheduled arguments hold a ``"transcript"`` delta
(:mod:`sagaloop.agents.transcript`): the adapters' ``agent__{agent}__model_request`` steps and
any step fed by a :class:`~sagaloop.agents.conversation.Conversation`. Messages are read in the
shapes that Pydantic AI, the OpenAI Agents SDK and Chat Completions give them; anything else
is shown as its JSON, so an unknown shape is never an error.

What :func:`requests_of` guarantees: each message is shown once (a request shows what is new
since the previous request of its conversation, less the previous answer it sends back, and
each distinct text of instructions the first time it is sent); a tool result is named by its
tool when the call it answers is in the transcript; a value that is not text (a list, an object)
is shown as its JSON; a tool call that needed an approval carries the approval's state
(:class:`ApprovalMark`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

from sagaloop.agents.transcript import strings_of
from sagaloop.engine import history as h
from sagaloop.engine.history import Event
from sagaloop.sagas.approvals import ApprovalRequest, call_id_of

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles of OpenAI's messages (Responses and Chat Completions)."""


@dataclasses.dataclass(frozen=True)
class ApprovalMark:
    """The approval a tool call needed, as the run's published approval last said."""

    status: str
    """``pending``, ``escalated``, ``approved``, ``denied`` or ``expired``."""
    by: str | None = None
    reason: str | None = None
    """The answer's reason (a denial's), or ``"deadline passed"``."""
    edited_args: Any = None
    """The arguments the approver approved in place of the call's, when edited."""

    @property
    def summary(self) -> str:
        """The mark in words: "approved by maria, with edited arguments {...}"."""
        text = f"needed approval: {self.status}"
        if self.by:
            text += f" by {self.by}"
        if self.reason:
            text += f" ({self.reason})"
        if self.edited_args is not None:
            text += ", with edited arguments " + json.dumps(
                self.edited_args, ensure_ascii=False, default=str
            )
        return text


@dataclasses.dataclass
class Part:
    kind: str
    """``system``, ``user``, ``assistant``, ``thinking``, ``tool call``, ``tool result`` or
    ``other`` (shown as JSON)."""
    text: str
    label: str = ""
    """The tool's name, for tool calls and results (a result whose call is not in the
    transcript: its call id)."""
    call_id: str = dataclasses.field(default="", compare=False)
    """The id that ties a tool result to its call, where the message says."""
    approval: ApprovalMark | None = dataclasses.field(default=None, compare=False)
    """For a tool call that needed an approval: how it was answered."""


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
    """The model requests of a run, in the order they were made, each message shown once."""
    found: dict[int, Request] = {}
    by_number: dict[tuple[str, int], Request] = {}
    """Each conversation's requests by their number (what a delta's ``prev`` names)."""
    systems: dict[str, set[str]] = {}
    """The system texts (instructions) each conversation showed already."""
    approvals: dict[str, tuple[int, Any]] = {}
    """Each approval's first position and last published value, by call id."""
    answers: dict[tuple[str, int], Any] = {}
    """Each request's recorded result (what a delta's ``refs`` name), by conversation and
    number."""
    strings: dict[str, str] = {}
    """The long strings of the step results so far, by digest (what a delta's ``values``
    names: a tool's result recorded once)."""
    for ev in events:
        if ev.pos is None:
            continue
        if ev.kind == h.STEP_COMPLETED:
            strings.update(strings_of([ev]))
        if ev.kind == h.STEP_SCHEDULED:
            args = _filled(ev.data.get("args"), strings)
            request = _scheduled(ev.pos, ev.name or "?", args, by_number, systems, answers)
            if request is not None:
                found[ev.pos] = by_number[(request.conversation, request.n)] = request
        elif ev.kind == h.PUBLISHED:
            call_id = call_id_of(ev.name or "")
            if call_id is not None:
                first = approvals.get(call_id, (ev.pos, None))[0]
                approvals[call_id] = (first, ev.data.get("value"))
        elif ev.pos in found:
            request = found[ev.pos]
            if ev.kind == h.STEP_COMPLETED:
                result = ev.data.get("result")
                answers[(request.conversation, request.n)] = result
                request.state = "completed"
                request.response = response_parts(result)
                request.input_tokens, request.output_tokens = _tokens(result)
            elif ev.kind in (h.STEP_FAILED, h.STEP_RETRYING, h.STEP_HALTED):
                error = ev.data.get("error") or {}
                request.state = {h.STEP_FAILED: "failed", h.STEP_HALTED: "halted"}.get(
                    ev.kind, "retrying"
                )
                request.error = f"{error.get('type')}: {error.get('message')}"
    requests = [found[pos] for pos in sorted(found)]
    _name_results(requests)
    _mark_approvals(requests, approvals)
    return requests


def _scheduled(
    position: int,
    step: str,
    args: Any,
    by_number: dict[tuple[str, int], Request],
    systems: dict[str, set[str]],
    answers: dict[tuple[str, int], Any],
) -> Request | None:
    """The request a scheduled step makes, if its arguments hold a transcript delta."""
    found = _delta(args)
    if found is None:
        return None
    delta, system = found
    conversation = str(delta.get("conversation") or "")
    found_refs = delta.get("refs")
    refs: dict[str, Any] = found_refs if isinstance(found_refs, dict) else {}
    new = []
    for i, message in enumerate(_list(delta.get("append"))):
        ref = refs.get(str(i))
        if isinstance(ref, dict):  # a response recorded once, as its step's result
            new += message_parts(_referred(answers.get((conversation, _int(ref.get("n")))), ref))
        else:
            new += message_parts(message)
    prev = (
        by_number.get((conversation, delta["prev"])) if isinstance(delta.get("prev"), int) else None
    )
    after_answer = prev is not None and _starts_with(new, prev.response)
    if after_answer:
        assert prev is not None
        new = new[len(prev.response) :]
    if system:  # the instructions sent beside the messages (the OpenAI Agents SDK)
        new.insert(0, Part("system", system))
    return Request(
        position=position,
        step=step,
        conversation=conversation,
        n=_int(delta.get("n")),
        kept=_int(delta.get("keep")),
        new=_new_systems(new, systems.setdefault(conversation, set())),
        after_answer=after_answer,
    )


def _filled(args: Any, strings: dict[str, str]) -> Any:
    """A model request's arguments with the strings its delta names by digest in place."""
    found = _delta(args)
    if found is None or not isinstance(found[0].get("values"), list):
        return args
    delta = found[0]
    append = copy.deepcopy(_list(delta.get("append")))
    for value in delta["values"]:
        try:
            *path, last = value["at"]
            node: Any = append
            for key in path:
                node = node[key]
            node[last] = strings.get(value["sha"], "(a step's result not in the history)")
        except (KeyError, IndexError, TypeError, ValueError):
            continue
    filled = {k: v for k, v in delta.items() if k != "values"}
    filled["append"] = append
    return {"request": {"transcript": filled, "system": found[1]}}


def _referred(result: Any, ref: dict[str, Any]) -> Any:
    """The message a delta's ``refs`` entry stands for: the value at its ``path`` of the
    recorded result, with its ``set`` keys set and its ``drop`` keys removed."""
    value = result
    for key in _list(ref.get("path")):
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    if not isinstance(value, dict):
        return value
    drop = set(_list(ref.get("drop")))
    message = {k: v for k, v in value.items() if k not in drop}
    found = ref.get("set")
    message.update(found if isinstance(found, dict) else {})
    return message


def _name_results(requests: list[Request]) -> None:
    """Labels the tool results known only by their call id with the name of their call."""
    names: dict[str, str] = {}
    for request in requests:
        for part in (*request.new, *request.response):
            if part.kind == "tool call" and part.call_id and part.label:
                names.setdefault(part.call_id, part.label)
            elif part.kind == "tool result" and part.label in ("", part.call_id):
                part.label = names.get(part.call_id, part.label)


def _mark_approvals(requests: list[Request], approvals: dict[str, tuple[int, Any]]) -> None:
    """Marks each approval on the tool call it asked about: a call to the approval's action in
    the answer of the last request made before the approval was asked, the one with the same
    arguments if several."""
    for first, value in sorted(approvals.values(), key=lambda found: found[0]):
        try:
            approval = ApprovalRequest.model_validate(value)
        except ValueError:
            continue
        before = [r for r in requests if r.position < first]
        if not before:
            continue
        candidates = [
            p
            for p in before[-1].response
            if p.kind == "tool call" and p.label == approval.action and p.approval is None
        ]
        same = [p for p in candidates if _loads(p.text) == approval.args]
        for part in same[:1] or candidates[:1]:
            part.approval = ApprovalMark(
                status=approval.status,
                by=approval.by,
                reason=approval.answer_reason,
                edited_args=approval.edited_args if approval.edited else None,
            )


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


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


def _delta(args: Any) -> tuple[dict[str, Any], str] | None:
    """The transcript delta among a step's arguments, if any, and the instructions sent beside
    it (the ``system`` of the same argument, "" if none)."""
    if not isinstance(args, dict):
        return None
    for value in args.values():
        found = value.get("transcript") if isinstance(value, dict) else None
        if isinstance(found, dict) and isinstance(found.get("append"), list):
            assert isinstance(value, dict)
            system = value.get("system")
            return found, system if isinstance(system, str) else ""
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
        call_id = _name(message, "call_id")
        return [Part("tool call", _args(message.get("arguments")), _name(message, "name"), call_id)]
    if kind == "function_call_output":
        call_id = _name(message, "call_id")
        return [Part("tool result", _text(message.get("output")), call_id, call_id)]
    if kind == "reasoning":
        return [Part("thinking", _text(message.get("summary") or message.get("content")))]
    role = message.get("role")
    if isinstance(role, str) and role in ROLES and kind in (None, "message"):
        parts = []
        content = message.get("content")
        if content not in (None, "", []):
            label = _name(message, "tool_call_id") if role == "tool" else ""
            who = {"developer": "system", "tool": "tool result"}.get(role, role)
            parts.append(Part(who, _text(content), label, label))
        for call in _list(message.get("tool_calls")):  # Chat Completions
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                call_id = _name(call, "id")
                arguments = _args(function.get("arguments"))
                parts.append(Part("tool call", arguments, _name(function, "name"), call_id))
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
    call_id = _name(part, "tool_call_id")
    if kind == "tool-call":
        return Part("tool call", _args(part.get("args")), _name(part, "tool_name"), call_id)
    if kind in ("tool-return", "retry-prompt"):
        label = _name(part, "tool_name") or ("retry" if kind == "retry-prompt" else "")
        content = part.get("content")  # a tool's return value: JSON unless it is text
        text = content if isinstance(content, str) else _json(content)
        return Part("tool result", text, label, call_id)
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
    """Text content as it reads: a string; a list of content parts (strings, and objects with a
    ``type`` or ``kind``: ``{"type": "input_text", "text": ...}``, an image), one under the
    other, text as text; anything else (a list of values) as its JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(_is_content(i) for i in content):
        return "\n".join(_piece(i) for i in content)
    return _json(content)


def _is_content(item: Any) -> bool:
    return isinstance(item, str) or (
        isinstance(item, dict)
        and any(isinstance(item.get(k), str) for k in ("type", "kind", "part_kind"))
    )


def _piece(item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("text"), str):
        return str(item["text"])
    return _json(item)


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
