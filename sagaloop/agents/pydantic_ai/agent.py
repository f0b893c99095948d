"""`SagaAgent` and `step_as_tool`: the agent, its model and function tools as steps (see
:mod:`sagaloop.agents.pydantic_ai`)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import typing
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from functools import partial
from typing import Any, Generic, TypeVar, Unpack

import pydantic
import pydantic_core
from pydantic_ai import messages as _messages
from pydantic_ai.agent import AbstractAgent, WrapperAgent
from pydantic_ai.models import (
    CompletedStreamedResponse,
    Model,
    ModelRequestParameters,
    StreamedResponse,
    infer_model,
)
from pydantic_ai.models.fallback import FallbackModel
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import RunContext, Tool
from pydantic_ai.toolsets import AbstractToolset, CombinedToolset, FunctionToolset

from sagaloop import tracing
from sagaloop.agents import transcript
from sagaloop.agents._core import (
    ToolPolicy,
    attempt_timeout,
    jsonable,
    run_plain,
    step_part,
    usage_of,
)
from sagaloop.agents._model_call import (
    count_response,
    finish_run,
    relay,
    request_model,
)
from sagaloop.agents.budgets import Budget
from sagaloop.agents.options import AgentOptions, DurableAdapter, steps_prefix
from sagaloop.agents.pydantic_ai import mcp
from sagaloop.agents.pydantic_ai.profiles import lifted_request_limit, profile_model
from sagaloop.agents.pydantic_ai.run import (
    TOOL_SIGNALS,
    BudgetGate,
    PydanticRun,
    current,
    run_context,
    signal_of,
)
from sagaloop.agents.pydantic_ai.subagents import declare_agent_saga, saga_as_tool
from sagaloop.agents.subagents import Failures
from sagaloop.engine import sandbox
from sagaloop.errors import ValidationError
from sagaloop.sagas.app import App, SagaDef, StepDef
from sagaloop.sagas.context import StepContext, current_saga
from sagaloop.sagas.policy import RetryPolicy

# Pydantic AI names its graph's nodes and its runs with uuid4/uuid7 from its own modules: names
# of in-memory objects that never reach a decision or the history (the adapter passes run and
# conversation ids derived from the saga run).
sandbox.trust_framework("pydantic_ai", "pydantic_graph")

_PARAMS: pydantic.TypeAdapter[ModelRequestParameters] = pydantic.TypeAdapter(ModelRequestParameters)
_RESPONSE: pydantic.TypeAdapter[_messages.ModelResponse] = pydantic.TypeAdapter(
    _messages.ModelResponse
)
logger = logging.getLogger("sagaloop.agents.pydantic_ai")
DepsT = TypeVar("DepsT")
OutputT = TypeVar("OutputT")
METADATA_KEY = "sagaloop"
"""The key of a tool's ``metadata`` that holds its :class:`ToolPolicy` (or a dict of one)."""


def _policy_of(tool: Any, given: ToolPolicy | None) -> ToolPolicy:
    if given is not None:
        return given
    meta = getattr(tool, "metadata", None) or {}
    value = meta.get(METADATA_KEY) if isinstance(meta, Mapping) else None
    if isinstance(value, ToolPolicy):
        return value
    if isinstance(value, Mapping):
        # step_as_tool's and saga_as_tool's links
        fields = {k: v for k, v in value.items() if k not in ("step", "saga")}
        if isinstance(fields.get("retry"), Mapping):
            fields["retry"] = RetryPolicy(**fields["retry"])
        try:
            return ToolPolicy(**fields)
        except TypeError as e:
            raise ValidationError(f"the sagaloop metadata of tool {tool.name!r}: {e}") from e
    return ToolPolicy()


def step_as_tool(
    step: StepDef[Any, Any],
    *,
    name: str | None = None,
    description: str | None = None,
    requires_approval: bool = False,
) -> Tool[Any]:
    """A Pydantic AI tool that calls ``step`` (declared with ``@app.step``, with its own
    queue, retry, reconcile and compensation). In a saga the call is ``ctx.call(step, ...)``;
    outside one, the step's function runs in-process."""
    # resolved here: under `from __future__ import annotations` they are strings naming types
    # of the step's module, which the framework would look up in this one
    hints = typing.get_type_hints(step.fn)
    params = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation))
        for p in step.signature.params
    ]

    async def call(**kwargs: Any) -> Any:
        saga = current_saga()
        if saga is not None:
            return await saga.call(step, **kwargs)
        return await run_plain(step, kwargs)

    returns = hints.get("return", inspect.Signature.empty)
    call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        params, return_annotation=returns
    )
    call.__annotations__ = {
        p.name: p.annotation for p in params if p.annotation is not inspect.Parameter.empty
    }
    if returns is not inspect.Signature.empty:
        call.__annotations__["return"] = returns
    call.__name__ = step.name
    call.__doc__ = description or step.fn.__doc__
    return Tool(
        call,
        takes_ctx=False,
        name=name or step.name,
        description=description,
        requires_approval=requires_approval,
        metadata={METADATA_KEY: {"step": step.name}},
    )


_given_budget: ContextVar[Budget | None] = ContextVar("sagaloop_agent_budget", default=None)
"""The ``budget=`` given to ``run``/``run_stream``/``run_sync``, for the ``iter`` they enter
(Pydantic AI's entry points pass ``iter`` only the arguments they know)."""


@contextmanager
def _giving(budget: Budget | None) -> Iterator[None]:
    token = _given_budget.set(budget)
    try:
        yield
    finally:
        _given_budget.reset(token)


_decoder = transcript.Decoder(parse=_messages.ModelMessagesTypeAdapter.validate_python)


class _SagaModel(WrapperModel):
    """The model as the saga sees it: each request is a step."""

    def __init__(self, agent: SagaAgent[Any, Any], wrapped: Model) -> None:
        super().__init__(wrapped)
        self._agent = agent

    async def request(
        self,
        messages: list[_messages.ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> _messages.ModelResponse:
        run = current.get()
        if run is None:  # not inside SagaAgent.run in a saga
            return await self.wrapped.request(messages, model_settings, model_request_parameters)

        def request() -> dict[str, Any]:
            return {
                "settings": jsonable(model_settings, "model settings"),
                # a tool's metadata may hold its policy's functions: not sent to a model, not kept
                "params": _PARAMS.dump_python(
                    model_request_parameters, mode="json", fallback=lambda _: None
                ),
            }

        reply = await request_model(run, self._agent.model_step, messages, request)
        response = _RESPONSE.validate_python(reply["response"])
        run.last_response = response
        names = {t.name for t in model_request_parameters.function_tools}
        calls = sum(
            isinstance(p, _messages.ToolCallPart) and p.tool_name in names for p in response.parts
        )
        await count_response(run, reply, response.usage, calls)
        return response

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[_messages.ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        """``run_stream`` in a saga: the request is the same step as :meth:`request` (streamed
        on the worker with ``SagaAgent(stream=True)``); saga code gets the recorded response,
        replayed as events."""
        if current.get() is None:
            async with self.wrapped.request_stream(
                messages, model_settings, model_request_parameters, run_context
            ) as streamed:
                yield streamed
            return
        response = await self.request(messages, model_settings, model_request_parameters)
        yield CompletedStreamedResponse(
            response, model_request_parameters=model_request_parameters, replay_events=True
        )


def _none(_: Any) -> None:
    return None


def _text_of(event: Any) -> str | None:
    """The text a stream event adds to the answer (a text part starts, or grows)."""
    if isinstance(event, _messages.PartStartEvent) and isinstance(event.part, _messages.TextPart):
        return event.part.content
    if isinstance(event, _messages.PartDeltaEvent) and isinstance(
        event.delta, _messages.TextPartDelta
    ):
        return event.delta.content_delta
    return None


class SagaAgent(WrapperAgent[DepsT, OutputT], DurableAdapter, Generic[DepsT, OutputT]):
    """``agent`` made durable: in saga code each model request and each tool call is a step of
    the run (see the module's doc); outside saga code it is the plain agent.

    Declare it where the app's steps are declared (its steps are registered on ``app`` here, so
    engine and workers that import the app know them). ``options`` are those of both adapters
    (:class:`~sagaloop.agents.options.AgentOptions`: queues, retries, rate limits, tool
    policies, budget, approvals, streaming); give agents that call one provider the same
    ``model_rate_key`` to share its quota (see ``@app.step(rate_limit=...)``)."""

    def __init__(
        self,
        agent: AbstractAgent[DepsT, OutputT],
        *,
        app: App,
        name: str | None = None,
        fallback_models: Sequence[Model | str] = (),
        **options: Unpack[AgentOptions],
    ) -> None:
        super().__init__(agent)
        self.saga_name = name or agent.name
        if not self.saga_name:
            raise ValidationError("SagaAgent needs a name: Agent(..., name=...) or name=...")
        given = self._take_options(app, options)
        self._fallbacks = tuple(fallback_models)
        self._worker_model: Model | None = None
        self._saga_model: _SagaModel | None = None
        self.prefix = steps_prefix(self.saga_name)
        self.model_step = self.model_options.declare(app, self.prefix, self._model_request)
        self.tool_steps: dict[str, str] = {}
        self.step_tools: set[str] = set()
        self.saga_tools: dict[str, str] = {}
        """Tools that run a saga as a child run (``saga_as_tool``): the saga, by tool name."""
        self._as_tool: SagaDef[Any, Any] | None = None
        self.needs_approval: dict[str, bool] = {}
        self.policies: dict[str, ToolPolicy] = {}
        self._function_toolsets: dict[str, FunctionToolset[Any]] = {}
        for toolset in self._leaves():
            for tool_name, tool in toolset.tools.items():
                self._declare_tool(toolset, tool_name, tool, given.pop(tool_name, None))
        # MCP servers: their tools are only known at run time
        self.mcp_servers = mcp.declare(self, given)
        if given:
            raise ValidationError(f"SagaAgent(tools=...) names unknown tools: {sorted(given)}")

    # --- declaration -------------------------------------------------------------------------

    def _leaves(self) -> list[FunctionToolset[Any]]:
        found: list[FunctionToolset[Any]] = []

        def visit(toolset: AbstractToolset[Any]) -> None:
            if isinstance(toolset, FunctionToolset):
                found.append(toolset)

        for toolset in self.wrapped.toolsets:
            toolset.apply(visit)
        return found

    def _declare_tool(
        self,
        toolset: FunctionToolset[Any],
        tool_name: str,
        tool: Tool[Any],
        given: ToolPolicy | None,
    ) -> None:
        meta = tool.metadata or {}
        linked = meta.get(METADATA_KEY) if isinstance(meta, Mapping) else None
        policy = _policy_of(tool, given)
        self.needs_approval[tool_name] = bool(
            policy.requires_approval
            if policy.requires_approval is not None
            else tool.requires_approval
        )
        self.policies[tool_name] = policy
        if isinstance(linked, Mapping) and "step" in linked:  # step_as_tool
            self.tool_steps[tool_name] = str(linked["step"])
            self.step_tools.add(tool_name)
            return
        if isinstance(linked, Mapping) and "saga" in linked:  # saga_as_tool: runs in saga code
            self.saga_tools[tool_name] = str(linked["saga"])
            return
        self._function_toolsets[tool_name] = toolset

        async def run_tool(ctx: StepContext, call: dict[str, Any]) -> dict[str, Any]:
            return await self._run_tool(tool_name, ctx, call)

        self.tool_steps[tool_name] = self._tool_step(self.prefix, tool_name, policy, run_tool).name

    def as_tool(
        self,
        *,
        name: str | None = None,
        description: str | None = None,
        requires_approval: bool = False,
        failures: Failures = "raise",
    ) -> Tool[Any]:
        """This agent as a tool of another (a supervisor's sub-agent): each call runs the saga
        ``agent__{name}__as_tool`` (declared on the app at the first call: call it where the
        app's sagas are declared) as a child run of the supervisor's run; it runs this agent
        on the tool's ``prompt`` and answers with its output. The tool's ``name`` defaults to
        the agent's; ``failures`` as :func:`saga_as_tool`. The sub-agent runs without deps."""
        if self._as_tool is None:
            self._as_tool = declare_agent_saga(self, f"{self.prefix}__as_tool")
        return saga_as_tool(
            self._as_tool,
            name=name or step_part(str(self.saga_name)),
            description=description
            or self.wrapped.description
            or f"Ask the agent {self.saga_name!r}: give it a prompt, get its answer.",
            requires_approval=requires_approval,
            failures=failures,
        )

    # --- the saga side -----------------------------------------------------------------------

    def _deps_json(self, deps: Any) -> Any:
        deps_type = self.wrapped.deps_type
        if deps is None:
            return None
        try:
            return pydantic.TypeAdapter(deps_type).dump_python(deps, mode="json")
        except (pydantic_core.PydanticSerializationError, pydantic.PydanticSchemaGenerationError):
            pass
        fields: Mapping[str, Any] = {}
        if dataclasses.is_dataclass(deps):
            fields = {f.name: getattr(deps, f.name) for f in dataclasses.fields(deps)}
        elif isinstance(deps, pydantic.BaseModel):
            fields = dict(deps)
        for field, value in fields.items():
            try:
                pydantic_core.to_json(value)
            except pydantic_core.PydanticSerializationError:
                raise ValidationError(
                    f"the deps of agent {self.saga_name!r} cannot be stored: field {field!r} "
                    f"holds a {type(value).__name__}, which is not JSON. Tools run on workers, "
                    "which rebuild the deps from JSON: pass what identifies the resource (a URL,"
                    " an id) and open it in the tool"
                ) from None
        raise ValidationError(
            f"the deps of agent {self.saga_name!r} ({type(deps).__name__}) cannot be stored as "
            "JSON; give the agent a deps_type of a dataclass or pydantic model of JSON values"
        )

    def _saga_side_model(self) -> _SagaModel:
        if self._saga_model is None:
            model = self.wrapped.model
            if model is None:
                raise ValidationError(f"agent {self.saga_name!r} has no model")
            self._saga_model = _SagaModel(self, profile_model(model))
        return self._saga_model

    async def run(
        self, user_prompt: Any = None, *, budget: Budget | None = None, **kwargs: Any
    ) -> Any:
        """``Agent.run``; ``budget`` (else the agent's) bounds this agent run in a saga."""
        with _giving(budget):
            return await super().run(user_prompt, **kwargs)

    def run_sync(
        self, user_prompt: Any = None, *, budget: Budget | None = None, **kwargs: Any
    ) -> Any:
        """``Agent.run_sync`` (outside saga code only: a saga awaits ``run``)."""
        with _giving(budget):
            return super().run_sync(user_prompt, **kwargs)

    @asynccontextmanager
    async def run_stream(
        self, user_prompt: Any = None, *, budget: Budget | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """``Agent.run_stream``; ``budget`` as for :meth:`run`."""
        with _giving(budget):
            async with super().run_stream(user_prompt, **kwargs) as streamed:
                yield streamed

    @asynccontextmanager
    async def iter(
        self, user_prompt: Any = None, *, budget: Budget | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        if budget is None:
            budget = _given_budget.get()
        _given_budget.set(None)  # not for the agent runs started inside this one
        saga = current_saga()
        if saga is None:
            async with super().iter(user_prompt, **kwargs) as agent_run:
                yield agent_run
            return
        if kwargs.get("model") is not None:
            raise ValidationError(
                "SagaAgent.run(model=...) is not supported in a saga: the model runs on a worker;"
                " give SagaAgent(fallback_models=...) or wrap another agent"
            )
        if kwargs.get("toolsets"):
            raise ValidationError("SagaAgent.run(toolsets=...) is not supported in a saga")
        budget = budget or self.budget
        kwargs["usage_limits"] = lifted_request_limit(kwargs.get("usage_limits"), budget)
        conversation = f"{saga.run_id}/{saga.uuid4()}"
        for key in ("run_id", "conversation_id"):  # Agent.run passes them as None
            if kwargs.get(key) is None:
                kwargs[key] = conversation
        run = PydanticRun(
            saga=saga,
            agent=self,
            conversation=conversation,
            deps=self._deps_json(kwargs.get("deps")),
            budget=budget,
            encoder=transcript.Encoder(
                lambda ms: _messages.ModelMessagesTypeAdapter.dump_python(list(ms), mode="json")
            ),
        )
        usage_of(saga)
        toolset = BudgetGate(mcp.saga_toolset(self, CombinedToolset(list(self.wrapped.toolsets))))
        token = current.set(run)
        try:
            with self.wrapped.override(model=self._saga_side_model(), tools=[], toolsets=[toolset]):
                async with super().iter(user_prompt, **kwargs) as agent_run:
                    yield agent_run
        finally:
            current.reset(token)
            finish_run(run)

    # --- the worker side ---------------------------------------------------------------------

    def _model(self) -> Model:
        if self._worker_model is None:
            model = self.wrapped.model
            if model is None:
                raise ValidationError(f"agent {self.saga_name!r} has no model")
            primary = infer_model(model)
            self._worker_model = (
                FallbackModel(primary, *self._fallbacks) if self._fallbacks else primary
            )
        return self._worker_model

    async def _model_request(self, ctx: StepContext, request: dict[str, Any]) -> dict[str, Any]:
        delta = request["transcript"]
        messages = _decoder.messages(
            ctx.run_id,
            delta,
            step=self.model_step.name,
            history=ctx.history,
        )
        extras = _decoder.extras(
            ctx.run_id, request, step=self.model_step.name, history=ctx.history
        )
        params = _PARAMS.validate_python(extras.get("params") or {})
        model = self._model()
        settings = extras.get("settings")
        if self.stream:
            # closed (its connection too) when the run ends (the heartbeat raises
            # StepCancelled) or the step's timeout passes: nothing reads, or pays for, the rest
            async with (
                attempt_timeout(self.model_step.timeout),
                model.request_stream(messages, settings, params) as streamed,
            ):
                async for event in streamed:
                    text = _text_of(event)
                    relay(
                        ctx,
                        self.saga_name,
                        text if isinstance(text, str) else None,
                        partial(pydantic_core.to_jsonable_python, event, fallback=_none),
                    )
            response = streamed.get()
        else:
            response = await model.request(messages, settings, params)
        usage = response.usage  # on the step's span (GenAI semantic conventions):
        tracing.model_call(
            model=model.model_name,
            provider=response.provider_name or model.system,
            response_model=response.model_name,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
        )
        cost: float | None = None
        try:
            cost = float(response.cost().total_price)
        except Exception:  # no price known for this model (or no usage): counted as 0
            cost = None
        result = {"response": _RESPONSE.dump_python(response, mode="json"), "cost": cost}
        _decoder.responded(ctx.run_id, delta, result)
        return result

    async def _run_tool(self, name: str, ctx: StepContext, call: dict[str, Any]) -> dict[str, Any]:
        tracing.tool_call(name)  # on the step's span: gen_ai.tool.name
        toolset = self._function_toolsets[name]
        run_ctx = run_context(self.wrapped.deps_type, call)
        tool = (await toolset.get_tools(run_ctx))[name]
        args = tool.args_validator.validate_python(call.get("args") or {})
        try:
            value = await toolset.call_tool(name, args, run_ctx, tool)
        except TOOL_SIGNALS as e:
            return signal_of(e)
        return {"value": jsonable(value, f"the result of tool {name!r}")}

    @property
    def step_names(self) -> list[str]:
        """The names of the steps this agent registered (compatibility data)."""
        return sorted(
            {self.model_step.name, *(self.tool_steps[t] for t in self.tool_steps)}
            - {self.tool_steps[t] for t in self.step_tools}
        )
