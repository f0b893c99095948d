"""Steps as tools for a tool-calling loop written without a framework: :class:`StepTools`.

Many teams call a model's API directly in a ``while`` loop. Inside a saga, such a loop is
durable when the model request is a step and every tool the model calls is a step too::

    tools = StepTools(lookup_order, refund)

    @app.saga(name="support")
    async def support(ctx: SagaContext, question: str) -> str:
        conversation = Conversation(ctx)
        messages = [{"role": "user", "content": question}]
        while True:
            # a step that calls the model with Conversation.messages(ctx, request)
            reply = await ctx.call(chat, conversation.request(messages))
            messages.append(reply)
            if not reply.get("tool_calls"):
                return reply["content"]
            results = await tools.dispatch(ctx, reply["tool_calls"])
            messages.extend(r.reply() for r in results)

- :class:`StepTools` turns ``@app.step`` declarations into tool definitions: the JSON Schema of
  the parameters after ``ctx`` (from the annotations, through pydantic), the description from
  the docstring, in the OpenAI (Chat Completions and Responses) and Anthropic formats. With
  ``strict=True`` the schema follows OpenAI's strict mode.
- :meth:`StepTools.dispatch` validates a model's tool calls against the steps' signatures and
  runs them with ``ctx.call`` (each step with its own queue, retry, timeout, reconcile,
  compensation and approval); a bad call comes back as an error result for the model.
- :class:`Conversation` (from :mod:`sagaloop.agents.conversation`) records each model request's
  new messages only, so the history grows with the loop's length, not with its square.

No agent framework is imported: the tool calls are the plain dicts (or the SDK objects) that the
providers' APIs return.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from typing import Any, Literal, NotRequired, Required

import pydantic
import typing_extensions

from sagaloop.agents import _core
from sagaloop.agents.budgets import Budget
from sagaloop.agents.conversation import Conversation
from sagaloop.agents.schemas import accepts_none, clean_schema, explain, ordered
from sagaloop.errors import ApprovalDenied, DeclarationError, StepFailedError, ValidationError
from sagaloop.sagas.app import StepDef
from sagaloop.sagas.context import SagaContext

__all__ = ["Conversation", "StepTool", "StepTools", "ToolCallError", "ToolResult"]

JSON = Any
Format = Literal["openai", "openai_responses", "anthropic"]

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
"""What OpenAI and Anthropic accept as a tool's name."""
_ARGS_SECTIONS = ("Args", "Arguments", "Parameters", "Params")
_SECTION = re.compile(r"^([A-Z][A-Za-z ]*):\s*$")
_ARG_LINE = re.compile(r"^(\s+)\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_TypedDict: Any = typing_extensions.TypedDict  # pydantic needs it on Python < 3.12
_NULL = {"type": "null"}


class ToolCallError(ValidationError):
    """A model's tool call that cannot run: an unknown tool, arguments that are not a JSON
    object, or that do not fit the step's signature. ``tool`` names the tool, ``fields`` the
    arguments at fault (``"items.0.qty"`` for a nested one)."""

    def __init__(self, message: str, *, tool: str, fields: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tool = tool
        self.fields = tuple(fields)


@dataclasses.dataclass(frozen=True)
class StepTool:
    """A step offered under another ``name`` or ``description`` than its own:
    ``StepTools(StepTool(billing_refund, name="refund"))``. A step's name may hold ``.`` and
    ``:``, a tool's name may not."""

    step: StepDef[Any, Any]
    name: str | None = None
    description: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call: ``value`` (JSON) or ``error`` (text for the model)."""

    call_id: str
    name: str
    value: JSON = None
    error: str | None = None
    format: Format = "openai"
    """The format of the call it answers, and so of :meth:`reply`."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def content(self) -> str:
        """The text the model reads: a string result as it is, any other value as JSON text,
        an error as ``{"error": "..."}``."""
        return _content(self.value, self.error)

    def reply(self) -> dict[str, Any]:
        """What answers the call, in its format: an OpenAI ``tool`` message, a Responses
        ``function_call_output`` item, or an Anthropic ``tool_result`` block (send those
        together in one ``user`` message)."""
        if self.format == "anthropic":
            return StepTools.anthropic_result(
                self.call_id, self.value, is_error=not self.ok, error=self.error
            )
        if self.format == "openai_responses":
            return StepTools.openai_responses_result(self.call_id, self.value, error=self.error)
        return StepTools.openai_result(self.call_id, self.value, error=self.error)


@dataclasses.dataclass(frozen=True)
class _Tool:
    name: str
    step: StepDef[Any, Any]
    description: str | None
    parameters: dict[str, Any]
    adapter: pydantic.TypeAdapter[Any]
    null_means_default: frozenset[str]


class StepTools:
    """Steps offered to a model as tools, and the dispatch of its calls in saga code.

    ``StepTools(*steps, strict=True)``: each step (or :class:`StepTool`) becomes a tool named
    after the step. Its parameters' JSON Schema comes from the annotations after ``ctx``
    (pydantic models, enums, ``Literal``, ``Annotated[..., Field(description=...)]``), its
    description from the first paragraph of the docstring, and each parameter's from a
    Google-style ``Args:`` section. With ``strict`` (OpenAI's strict mode) every object has
    ``additionalProperties: false`` and lists all its properties as required: a parameter with a
    default becomes nullable (null means the default), a field of a nested model with a default
    is simply required; a free-form ``dict`` or ``Any`` parameter is refused (use a model, or
    ``strict=False``).

    A step name that is not a valid tool name (``^[a-zA-Z0-9_-]{1,64}$``) is refused with the
    fix: ``StepTool(step, name=...)``.
    """

    def __init__(self, *steps: StepDef[Any, Any] | StepTool, strict: bool = True) -> None:
        self.strict = strict
        self._tools: dict[str, _Tool] = {}
        for given in steps:
            spec = given if isinstance(given, StepTool) else StepTool(given)
            if not isinstance(spec.step, StepDef):
                raise DeclarationError(
                    f"StepTools takes steps declared with @app.step, not {spec.step!r}"
                )
            tool = _build(spec, strict=strict)
            if tool.name in self._tools:
                raise DeclarationError(
                    f"two tools are named {tool.name!r}: rename one with StepTool(step, name=...)"
                )
            self._tools[tool.name] = tool

    def __repr__(self) -> str:
        return f"StepTools({', '.join(self._tools)}, strict={self.strict})"

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    @property
    def names(self) -> list[str]:
        """The tool names, in the order given."""
        return list(self._tools)

    def step(self, name: str) -> StepDef[Any, Any]:
        """The step behind the tool ``name``."""
        return self._get(name).step

    def parameters(self, name: str) -> dict[str, Any]:
        """The JSON Schema of the tool's arguments (a copy)."""
        return _copy(self._get(name).parameters)

    # --- definitions -------------------------------------------------------------------------

    def _definitions(self, schema_key: str, **extra: Any) -> list[dict[str, Any]]:
        """Each tool as ``{"name", "description"?, schema_key: <its parameters>, **extra}``."""
        out = []
        for t in self._tools.values():
            tool: dict[str, Any] = {"name": t.name}
            if t.description:
                tool["description"] = t.description
            tool[schema_key] = _copy(t.parameters)
            out.append({**tool, **extra})
        return out

    def openai(self) -> list[dict[str, Any]]:
        """The tools for OpenAI's Chat Completions API (``tools=``)."""
        functions = self._definitions("parameters", strict=self.strict)
        return [{"type": "function", "function": function} for function in functions]

    def openai_responses(self) -> list[dict[str, Any]]:
        """The tools for OpenAI's Responses API (``tools=``)."""
        return [{"type": "function", **x["function"]} for x in self.openai()]

    def anthropic(self) -> list[dict[str, Any]]:
        """The tools for Anthropic's Messages API (``tools=``)."""
        return self._definitions("input_schema")

    # --- calls -------------------------------------------------------------------------------

    def validate(
        self, name: str, arguments: str | bytes | Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """The arguments of a call to ``name`` as the step takes them (pydantic models built,
        null dropped where it means the default); else :class:`ToolCallError`."""
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            raise ToolCallError(f"unknown tool {name!r}; the tools are: {known}", tool=name)
        data = _arguments(name, arguments)
        data = {k: v for k, v in data.items() if not (v is None and k in tool.null_means_default)}
        try:
            checked: dict[str, Any] = tool.adapter.validate_python(data)
        except pydantic.ValidationError as e:
            problems, fields = explain(e)
            raise ToolCallError(f"tool {name!r}: {problems}", tool=name, fields=fields) from e
        return checked

    async def call(
        self, ctx: SagaContext, name: str, arguments: str | bytes | Mapping[str, Any] | None
    ) -> JSON:
        """Validate the call (arguments as a JSON string or a dict, as providers return them)
        and run the tool's step with ``ctx.call``, under the step's own policy. Returns the
        result as JSON (a pydantic model dumped). A bad call raises :class:`ToolCallError`;
        a step that failed for good raises ``StepFailedError``; a denied approval
        ``ApprovalDenied``.

        The step's idempotency key is the one sagaloop derives from the run and the call's
        position in it, never from the model's tool call id: two calls with the same id are
        two steps with two keys, and a replay of the run finds the same key for the same
        call."""
        args = self.validate(name, arguments)
        return await self._run(ctx, name, args)

    async def dispatch(
        self,
        ctx: SagaContext,
        tool_calls: Sequence[Any],
        *,
        step_failures: Literal["raise", "return"] = "raise",
        budget: Budget | None = None,
    ) -> list[ToolResult]:
        """Run a model's tool calls concurrently (in one ``ctx.gather``, started in the order
        given) and return their results in that order, each in the format of its call.

        ``tool_calls`` are OpenAI Chat Completions tool calls, Responses ``function_call``
        items or Anthropic ``tool_use`` blocks, as dicts or as the SDKs' objects; other items
        (text, reasoning) are skipped, so a response's whole ``output`` or ``content`` may be
        given. A call that cannot run (unknown tool, bad arguments) and a denied approval
        become error results for the model, and its step does not run. A step that failed for
        good raises ``StepFailedError`` (the run fails and compensates), or with
        ``step_failures="return"`` becomes an error result too. Idempotency keys: as
        :meth:`call`.

        The calls that run count as tool calls of the saga run (with those of its agents:
        :class:`~sagaloop.agents.Budget`). With ``budget``, the calls that would run are
        checked together against what its ``tool_calls`` has left before any of them runs:
        over it, none runs, and as ``budget.on_exceed`` says the run fails with
        ``BudgetExceeded``, waits for the event ``budget``, or (``"tell_model"``) every call
        gets the refusal as its error result."""
        parsed = [c for c in (_parse_call(item) for item in tool_calls) if c is not None]
        results: list[ToolResult | None] = []
        valid: list[tuple[int, str, dict[str, Any]]] = []
        for fmt, call_id, name, arguments in parsed:
            try:
                args = self.validate(name, arguments)
            except ToolCallError as e:
                results.append(ToolResult(call_id, name, error=str(e), format=fmt))
                continue
            valid.append((len(results), name, args))
            results.append(None)
        _, refused = await _core.check_batch(ctx, budget, len(valid))
        if refused is not None:
            for index, name, _ in valid:
                fmt, call_id, _, _ = parsed[index]
                results[index] = ToolResult(call_id, name, error=refused, format=fmt)
            return [r for r in results if r is not None]
        _core.charge_tool_calls(ctx, len(valid))
        if budget is not None or _core.usage_of(ctx).allowance is not None:
            _core.publish_usage(ctx, budget)  # a run tree's parent reads the last one
        pending: list[tuple[int, Awaitable[JSON]]] = [
            (index, self._run(ctx, name, args)) for index, name, args in valid
        ]
        outcomes = await ctx.gather(*(aw for _, aw in pending), return_exceptions=True)
        for (index, _), outcome in zip(pending, outcomes, strict=True):
            fmt, call_id, name, _ = parsed[index]
            if isinstance(outcome, ApprovalDenied):
                error = f"the call was denied: {outcome.reason or 'no reason given'}"
            elif isinstance(outcome, StepFailedError) and step_failures == "return":
                error = f"the tool failed: {outcome.error.describe()}"
            elif isinstance(outcome, BaseException):
                raise outcome  # the first, in the order of the calls
            else:
                results[index] = ToolResult(call_id, name, value=outcome, format=fmt)
                continue
            results[index] = ToolResult(call_id, name, error=error, format=fmt)
        return [r for r in results if r is not None]

    async def _run(self, ctx: SagaContext, name: str, args: dict[str, Any]) -> JSON:
        step = self._tools[name].step
        value = await ctx.call(step, **args)
        return step.result.to_json(value, what=f"the result of tool {name!r}")

    # --- results -----------------------------------------------------------------------------

    @staticmethod
    def openai_result(
        tool_call_id: str, value: JSON = None, *, error: str | None = None
    ) -> dict[str, Any]:
        """A Chat Completions ``tool`` message answering ``tool_call_id``."""
        return {"role": "tool", "tool_call_id": tool_call_id, "content": _content(value, error)}

    @staticmethod
    def openai_responses_result(
        call_id: str, value: JSON = None, *, error: str | None = None
    ) -> dict[str, Any]:
        """A Responses ``function_call_output`` item answering ``call_id``."""
        return {
            "type": "function_call_output",
            "call_id": call_id,
            "output": _content(value, error),
        }

    @staticmethod
    def anthropic_result(
        tool_use_id: str, value: JSON = None, *, is_error: bool = False, error: str | None = None
    ) -> dict[str, Any]:
        """An Anthropic ``tool_result`` block answering ``tool_use_id`` (``is_error`` for an
        error; ``error`` gives its text)."""
        block: dict[str, Any] = {
            "type": "tool_result",
            "tool_use_id": tool_use_id,
            "content": _content(value, error),
        }
        if is_error or error is not None:
            block["is_error"] = True
        return block

    def _get(self, name: str) -> _Tool:
        tool = self._tools.get(name)
        if tool is None:
            raise KeyError(f"no tool {name!r}; the tools are: {', '.join(self._tools)}")
        return tool


# --- building a tool ---------------------------------------------------------------------------


def _build(spec: StepTool, *, strict: bool) -> _Tool:
    step = spec.step
    name = spec.name or step.name
    if not TOOL_NAME.match(name):
        fix = re.sub(r"[^a-zA-Z0-9_-]", "_", name)[:64]
        raise DeclarationError(
            f"step {step.name!r} cannot be offered as the tool {name!r}: tool names are 1 to 64 "
            f"letters, digits, '_' or '-'; name it: "
            f"StepTool({getattr(step.fn, '__name__', 'step')}, name={fix!r})"
        )
    summary, arg_docs = _parse_doc(step.fn.__doc__)
    hints = typing.get_type_hints(step.fn, include_extras=True)
    fields: dict[str, Any] = {}
    nullable: dict[str, Any] = {}  # param -> its default, for params that take null for it
    for p in step.signature.params:
        hint = hints.get(p.name, Any)
        fields[p.name] = Required[hint] if p.default is p.empty else NotRequired[hint]
        if p.default is not p.empty and not accepts_none(hint):
            nullable[p.name] = p.default
    args_type = _TypedDict(f"{name}_arguments", fields)
    args_type.__pydantic_config__ = pydantic.ConfigDict(extra="forbid")
    what = f"step {step.name!r}"
    try:
        adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(args_type)
        raw = adapter.json_schema()
    except pydantic.PydanticUserError as e:  # a type pydantic cannot describe
        raise DeclarationError(f"{what}: its parameters have no JSON Schema: {e}") from e
    props: dict[str, Any] = raw.setdefault("properties", {})
    for p in step.signature.params:
        prop = props[p.name]
        if "description" not in prop and p.name in arg_docs:
            prop["description"] = arg_docs[p.name]
        if p.default is p.empty:
            continue
        default = _dump_default(hints.get(p.name, Any), p.default)
        if strict and p.name in nullable:
            note = "null for the default" + (
                f": {json.dumps(default)}" if default is not _NO_DEFAULT else ""
            )
            described = prop.pop("description", None)
            props[p.name] = {
                "anyOf": [prop, dict(_NULL)],
                "description": f"{described} ({note})" if described else f"{note.capitalize()}.",
            }
        elif default is not _NO_DEFAULT:
            prop["default"] = default  # dropped again in strict mode
    schema = clean_schema(raw, strict=strict, what=what)
    schema.setdefault("required", [])
    return _Tool(
        name=name,
        step=step,
        description=spec.description or summary,
        parameters=ordered(schema),
        adapter=adapter,
        null_means_default=frozenset(nullable),
    )


_NO_DEFAULT = object()


def _dump_default(hint: Any, default: Any) -> Any:
    try:
        return pydantic.TypeAdapter(hint).dump_python(default, mode="json")
    except Exception:  # a default pydantic cannot dump: left out of the schema
        return _NO_DEFAULT


def _parse_doc(doc: str | None) -> tuple[str | None, dict[str, str]]:
    """The first paragraph of a docstring, and the Google-style ``Args:`` entries."""
    if not doc or not doc.strip():
        return None, {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line):
            break
        summary.append(line.strip())
    args: dict[str, str] = {}
    in_args, indent, current = False, 0, ""
    for line in lines:
        header = _SECTION.match(line)
        if header:
            in_args, indent, current = header.group(1) in _ARGS_SECTIONS, 0, ""
            continue
        if not in_args or not line.strip():
            continue
        if not line[0].isspace():
            in_args = False
            continue
        entry = _ARG_LINE.match(line)
        depth = len(line) - len(line.lstrip())
        if entry and (not indent or depth <= indent):
            indent, current = depth, entry.group(2)
            args[current] = entry.group(3).strip()
        elif current:
            args[current] = f"{args[current]} {line.strip()}".strip()
    return " ".join(summary) or None, args


# --- calls and results -------------------------------------------------------------------------


def _arguments(name: str, arguments: str | bytes | Mapping[str, Any] | None) -> dict[str, Any]:
    if arguments is None or (isinstance(arguments, str | bytes) and not arguments.strip()):
        return {}
    if isinstance(arguments, str | bytes):
        try:
            data = json.loads(arguments)
        except ValueError as e:
            raise ToolCallError(
                f"tool {name!r}: the arguments are not valid JSON ({e}); send a JSON object",
                tool=name,
            ) from e
    else:
        data = arguments
    if not isinstance(data, Mapping):
        raise ToolCallError(
            f"tool {name!r}: the arguments must be a JSON object, not {type(data).__name__}",
            tool=name,
        )
    return dict(data)


def _parse_call(item: Any) -> tuple[Format, str, str, Any] | None:
    """``(format, call id, tool name, arguments)`` of a provider's tool call; None for an item
    that is not one (text, reasoning)."""
    data = item.model_dump() if hasattr(item, "model_dump") else item
    if not isinstance(data, Mapping):
        raise ValidationError(f"not a tool call: {item!r}")
    kind = data.get("type")
    try:
        if isinstance(data.get("function"), Mapping):
            function = data["function"]
            return "openai", str(data["id"]), str(function["name"]), function.get("arguments")
        if kind == "function_call":
            return "openai_responses", str(data["call_id"]), str(data["name"]), data["arguments"]
        if kind == "tool_use":
            return "anthropic", str(data["id"]), str(data["name"]), data.get("input")
    except KeyError as e:
        raise ValidationError(f"a tool call without {e}: {dict(data)!r}") from e
    if isinstance(kind, str):
        return None
    raise ValidationError(
        f"not a tool call: {dict(data)!r}; give OpenAI tool calls, Responses function_call "
        "items or Anthropic tool_use blocks"
    )


def _content(value: JSON, error: str | None) -> str:
    if error is not None:
        return json.dumps({"error": error}, ensure_ascii=False)
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _copy(schema: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(json.dumps(schema))
    return result
