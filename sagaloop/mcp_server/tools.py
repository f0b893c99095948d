"""The tools' declarations: a start tool per saga (name, description, input schema, validation)
and the fixed tools' arguments. Pure pydantic: no ``mcp`` import."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
from collections.abc import Mapping
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from sagaloop.agents.schemas import accepts_none, clean_schema, explain, ordered
from sagaloop.errors import DeclarationError
from sagaloop.sagas.app import App, SagaDef

IDEMPOTENCY_KEY = "idempotency_key"
"""The optional argument of every start tool that names the run to start or find."""
META_KEY = "sagaloop/idempotency_key"
"""The same, in a request's ``_meta``, for clients that stamp their calls (the argument wins)."""
MAX_TOOL_NAME = 64
"""What OpenAI and Anthropic accept (MCP allows 128): hosts hand the tools to such models."""
_NOT_TOOL_NAME = re.compile(r"[^A-Za-z0-9_-]")


class Key(BaseModel):
    idempotency_key: str = Field(
        min_length=1,
        max_length=200,
        description=(
            "Names this start: a call with a key used before returns that run instead of "
            "starting another. Leave it out to start the saga once per distinct input; pass a "
            "new key to start it again with the same input."
        ),
    )


# --- the tools of an app's sagas -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SagaTool:
    """The start tool of one saga."""

    name: str
    saga: SagaDef[Any, Any]
    description: str
    input_schema: dict[str, Any]
    arguments: pydantic.TypeAdapter[Any]
    """Validates the arguments other than the idempotency key."""
    flat: bool
    """True when the input's fields are the arguments; else the input is ``input`` (if any)."""

    def input_of(self, arguments: Mapping[str, Any]) -> Any:
        """The saga's input in ``arguments`` (checked already, without the key)."""
        if self.flat:
            return dict(arguments)
        return arguments.get("input") if self.saga.has_input else None


def tool_name(name: str, taken: set[str] | frozenset[str] = frozenset()) -> str:
    """The tool name of the saga ``name``: its characters outside letters, digits, ``_`` and
    ``-`` become ``_``, cut to 64; a name in ``taken`` gets ``_`` and 8 hex of the saga name's
    SHA-256 (stable across restarts)."""
    plain = _NOT_TOOL_NAME.sub("_", name)[:MAX_TOOL_NAME]
    if plain not in taken:
        return plain
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{plain[: MAX_TOOL_NAME - 9]}_{digest}"


def saga_tools(app: App, taken: set[str] | frozenset[str] = frozenset()) -> list[SagaTool]:
    """One start tool per saga of ``app``, by saga name, with names unique among themselves and
    ``taken`` (the names of the other tools)."""
    used = set(taken)
    tools = []
    for name in sorted(app.sagas):
        tool = _saga_tool(app.sagas[name], tool_name(name, used))
        used.add(tool.name)
        tools.append(tool)
    return tools


def _saga_tool(saga: SagaDef[Any, Any], name: str) -> SagaTool:
    what = f"saga {saga.name!r}"
    annotation = saga.input.annotation
    try:
        arguments: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(annotation)
        raw = arguments.json_schema()
        flat = saga.has_input and _closed_object(raw)
        if not flat:
            fields: dict[str, Any] = {}
            if saga.has_input:
                fields["input"] = (annotation, None) if accepts_none(annotation) else annotation
            model = pydantic.create_model(
                f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields
            )
            arguments = pydantic.TypeAdapter(model)
            raw = arguments.json_schema()
    except pydantic.PydanticUserError as e:
        raise DeclarationError(f"{what}: its input has no JSON Schema: {e}") from e
    raw.setdefault("properties", {})[IDEMPOTENCY_KEY] = _KEY_SCHEMA
    schema = ordered(clean_schema(raw, what=what))
    doc = inspect.cleandoc(saga.__doc__ or "") or f"Start a run of the saga {saga.name!r}."
    how = (
        "Starts a run and returns at once with its run_id (read it later with run_status). "
        "Calling again with the same arguments returns the same run and starts nothing."
    )
    return SagaTool(name, saga, f"{doc}\n\n{how}", schema, arguments, flat)


def _closed_object(schema: dict[str, Any]) -> bool:
    """True for an object with named fields and no others, without a field named like the
    idempotency key: those fields can be the tool's arguments."""
    return (
        schema.get("type") == "object"
        and isinstance(schema.get("properties"), dict)
        and IDEMPOTENCY_KEY not in schema["properties"]
        and schema.get("additionalProperties") in (None, False)
    )


_KEY_SCHEMA = clean_schema(Key.model_json_schema())["properties"][IDEMPOTENCY_KEY]


# --- the other tools -----------------------------------------------------------------------

_RUN_ID = Field(description="The run's id, as the start tool returned it.")


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunStatusArgs(Args):
    run_id: str = _RUN_ID


class SendEventArgs(Args):
    run_id: str = _RUN_ID
    name: str = Field(description="The event's name, as the run waits for it.")
    data: Any = Field(default=None, description="The event's data (any JSON).")
    event_id: str | None = Field(
        default=None,
        description=(
            "Sends with the same event_id are delivered once. Default: derived from the name "
            "and data, so the same event sent again to the same run delivers nothing new."
        ),
    )


class ListApprovalsArgs(Args):
    run_id: str | None = Field(
        default=None, description="Only this run's approvals (default: every unfinished run's)."
    )
    after: str | None = Field(
        default=None, description="The page after this one: the `next` of the page before."
    )
    limit: int = Field(default=50, ge=1, le=200, description="How many approvals a page holds.")


class ApproveArgs(Args):
    run_id: str = _RUN_ID
    call_id: str = Field(description="The approval's call_id, as list_approvals shows it.")
    args: Any = Field(
        default=None, description="Approve these arguments instead of those asked about."
    )
    by: str | None = Field(default=None, description="Who approves (recorded with the answer).")


class DenyArgs(Args):
    run_id: str = _RUN_ID
    call_id: str = Field(description="The approval's call_id, as list_approvals shows it.")
    reason: str = Field(min_length=1, description="Why (the run receives it).")
    by: str | None = Field(default=None, description="Who denies (recorded with the answer).")


@dataclasses.dataclass(frozen=True)
class Fixed:
    name: str
    args: type[Args]
    description: str
    read_only: bool


FIXED = (
    Fixed(
        "run_status",
        RunStatusArgs,
        "A run's status, what it waits for and asks, the values it published, its steps, and "
        "its result or error once it finished.",
        True,
    ),
    Fixed(
        "send_event",
        SendEventArgs,
        "Deliver an event to a run (kept until the run waits for it if it comes early). "
        "Refused, with nothing sent, if the run would refuse it: a name its saga does not "
        "declare, or data that does not fit the event's model; run_status says what the run "
        "waits for, the events it keeps and why it refused one.",
        False,
    ),
    Fixed(
        "list_approvals",
        ListApprovalsArgs,
        "The approvals that runs wait for (pending or escalated), oldest first: the action, "
        "its arguments and the call_id to answer with approve or deny.",
        True,
    ),
    Fixed(
        "approve",
        ApproveArgs,
        "Approve an approval a run waits for (answered once; the run goes on).",
        False,
    ),
    Fixed("deny", DenyArgs, "Deny an approval a run waits for, saying why (answered once).", False),
)
FIXED_NAMES = frozenset(f.name for f in FIXED)


def schema_of(model: type[BaseModel]) -> dict[str, Any]:
    """The input schema of a fixed tool."""
    schema = ordered(clean_schema(model.model_json_schema()))
    schema.setdefault("required", [])
    return schema


class ToolError(Exception):
    """A call that is refused: its message is the tool error's text."""


def check(
    model: type[BaseModel] | pydantic.TypeAdapter[Any], arguments: dict[str, Any], tool: str
) -> Any:
    """``arguments`` validated by ``model``; a tool error naming the fields otherwise."""
    try:
        if isinstance(model, pydantic.TypeAdapter):
            return model.validate_python(arguments)
        return model.model_validate(arguments)
    except pydantic.ValidationError as e:
        problems, _ = explain(e)
        raise ToolError(f"tool {tool!r}: {problems}; nothing was done") from None
