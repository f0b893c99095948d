"""Agents as tools: a tool that runs a saga (a sub-agent's, or any) as a CHILD RUN of the run
whose agent calls it, the part both framework adapters share. No agent framework is imported.

A supervisor's sub-agents are then as durable as it is: the sub-agent's model requests and tools
are steps of its own run (recorded once, resumed after a crash, never paid again on replay), the
child shows in ``sagaloop status`` under its parent, and cancelling the parent cancels it. The
tool runs in saga code (``await current_saga().call(saga, input)``), never on a worker::

    @app.saga(name="researcher")
    async def researcher(ctx: SagaContext, question: str) -> str:
        return (await research_agent.run(question)).output

    supervisor = SagaAgent(Agent(model, tools=[saga_as_tool(researcher)], name="boss"), app=app)

- :func:`sagaloop.agents.pydantic_ai.saga_as_tool` gives a Pydantic AI ``Tool``;
  :meth:`SagaAgent.as_tool() <sagaloop.agents.pydantic_ai.SagaAgent.as_tool>` declares the saga
  that runs the agent on a prompt and gives its tool;
- :func:`sagaloop.agents.openai_agents.saga_as_function_tool` gives an OpenAI Agents
  ``FunctionTool``; :meth:`SagaRunner.agent_as_tool
  <sagaloop.agents.openai_agents.SagaRunner.agent_as_tool>` does for an agent of the runner
  what ``SagaAgent.as_tool`` does.

The tool's arguments are the saga's input: the fields of a pydantic model, dataclass or
TypedDict input, else one argument named after the saga function's input parameter. The child
run's id is derived from the parent's and the call's position (``ctx.call``), so a replay finds
the same child instead of starting a second one. The tool's result is the child's output as
JSON; a child that fails raises ``StepFailedError`` in the parent (its run fails and
compensates) or, with ``failures="return"``, answers the model with the error.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Mapping
from typing import Any, Literal

from sagaloop.agents._core import jsonable
from sagaloop.agents.schemas import clean_schema, ordered
from sagaloop.agents.tools import TOOL_NAME, ToolCallError
from sagaloop.errors import DeclarationError, StepFailedError, ValidationError
from sagaloop.sagas.app import SagaDef
from sagaloop.sagas.context import SagaContext, current_saga

__all__ = ["SagaTool", "saga_tool"]

Failures = Literal["raise", "return"]


@dataclasses.dataclass(frozen=True)
class SagaTool:
    """A saga offered to a model as a tool (see the module's doc): what both adapters build
    their framework's tool from."""

    saga: SagaDef[Any, Any]
    name: str
    description: str
    parameters: dict[str, Any]
    """The JSON Schema of the tool's arguments (an object)."""
    wrapped: str | None
    """The one argument that holds the saga's input when that input is not an object
    (None: the arguments are the input's fields)."""
    failures: Failures = "raise"

    def input_of(self, arguments: str | Mapping[str, Any] | None) -> Any:
        """The saga's input from a model's tool call (a JSON string or a dict); a call that
        does not fit raises :class:`~sagaloop.agents.tools.ToolCallError`."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as e:
                raise ToolCallError(
                    f"tool {self.name!r}: the arguments are not valid JSON ({e})", tool=self.name
                ) from e
        args = dict(arguments or {})
        if not self.saga.has_input:
            return None
        data: Any = args
        if self.wrapped is not None:
            if self.wrapped not in args:
                raise ToolCallError(
                    f"tool {self.name!r}: the argument {self.wrapped!r} is missing",
                    tool=self.name,
                    fields=[self.wrapped],
                )
            data = args[self.wrapped]
        try:
            return self.saga.input.from_json(data, what=f"the input of tool {self.name!r}")
        except ValidationError as e:
            raise ToolCallError(str(e), tool=self.name) from e

    async def call(self, arguments: str | Mapping[str, Any] | None) -> Any:
        """Run the saga as a child run of the current saga run, and return its output as JSON
        (or, with ``failures="return"``, the child's failure as text for the model). The
        adapter counts the call against the budget first."""
        ctx = self.in_saga()
        value = self.input_of(arguments)
        try:
            output = await (
                ctx.call(self.saga, value) if self.saga.has_input else ctx.call(self.saga)
            )
        except StepFailedError as e:
            if self.failures == "raise":
                raise
            return f"the sub-agent {self.name!r} failed: {e.error.describe()}"
        return jsonable(output, f"the output of saga {self.saga.name!r}")

    def in_saga(self) -> SagaContext:
        ctx = current_saga()
        if ctx is None:
            raise ValidationError(
                f"tool {self.name!r} runs saga {self.saga.name!r} as a child run: only an agent "
                "run in saga code can call it (SagaAgent.run or SagaRunner.run inside a saga); "
                f"outside one, start the saga with Client.start({self.saga.name!r}, ...)"
            )
        return ctx


def saga_tool(
    saga: SagaDef[Any, Any],
    *,
    name: str | None = None,
    description: str | None = None,
    strict: bool = False,
    failures: Failures = "raise",
) -> SagaTool:
    """The :class:`SagaTool` of ``saga`` (declared with ``@app.saga``). ``name`` defaults to
    the saga's name (which must then be a valid tool name), ``description`` to the first
    paragraph of the saga's docstring; ``strict``: the schema in OpenAI's strict mode."""
    if not isinstance(saga, SagaDef):
        raise DeclarationError(
            f"saga_as_tool takes a saga declared with @app.saga, not {saga!r} (for a step, "
            "use step_as_tool / step_as_function_tool)"
        )
    if failures not in ("raise", "return"):
        raise DeclarationError(f"failures must be 'raise' or 'return', not {failures!r}")
    tool_name = name or saga.name
    if not TOOL_NAME.match(tool_name):
        raise DeclarationError(
            f"saga {saga.name!r} cannot be offered as the tool {tool_name!r}: tool names are 1 "
            "to 64 letters, digits, '_' or '-'; give saga_as_tool(..., name=...)"
        )
    text = description or _summary(saga.fn.__doc__)
    if not text:
        raise DeclarationError(
            f"saga {saga.name!r} as a tool needs a description for the model: give "
            "description=... or a docstring to the saga"
        )
    parameters, wrapped = _parameters(saga, strict=strict)
    return SagaTool(saga, tool_name, text, parameters, wrapped, failures)


def _summary(doc: str | None) -> str:
    if not doc or not doc.strip():
        return ""
    return inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ").strip()


def _parameters(saga: SagaDef[Any, Any], *, strict: bool) -> tuple[dict[str, Any], str | None]:
    what = f"the input of saga {saga.name!r}"
    empty: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    if strict:
        empty["additionalProperties"] = False
    if not saga.has_input:
        return empty, None
    raw = saga.input.json_schema()
    if raw is None:
        raise DeclarationError(f"{what} has no JSON Schema: give its parameter a type")
    if raw.get("type") == "object" and raw.get("properties"):
        schema = clean_schema(raw, strict=strict, what=what)
        schema.setdefault("required", [])
        return ordered(schema), None
    params = list(inspect.signature(saga.fn).parameters)
    arg = params[1] if len(params) > 1 else "input"
    defs = raw.pop("$defs", None)
    wrapper: dict[str, Any] = {"type": "object", "properties": {arg: raw}, "required": [arg]}
    if defs:
        wrapper["$defs"] = defs
    return ordered(clean_schema(wrapper, strict=strict, what=what)), arg
