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

from sagaloop.client.transcript import (  # noqa: F401  (ROLES, message_parts: as before)
    ROLES,
    Part,
    _delta,
    _int,
    _list,
    _tokens,
    message_parts,
    response_parts,
)
from sagaloop.engine import history as h
from sagaloop.engine.history import Event


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
