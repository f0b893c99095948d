"""The model of a :class:`~sagaloop.agents.openai_agents.SagaRunner`'s agent, on both sides of its
step ``agent__{agent}__model_request``: :class:`StepModel` is the model saga code sees (each call
the step, through the shared core of :mod:`sagaloop.agents._model_call`), :func:`serve_request`
the worker side (the agent's real model, its response's usage and price)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, Any

import pydantic
from agents import Agent
from agents.agent_output import AgentOutputSchemaBase
from agents.exceptions import UserError
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem, TResponseStreamEvent
from agents.model_settings import ModelSettings
from agents.models.interface import Model, ModelProvider, ModelTracing
from agents.tool import FunctionTool, Tool

from sagaloop import tracing
from sagaloop.agents import transcript
from sagaloop.agents._core import attempt_timeout, jsonable
from sagaloop.agents._model_call import count_response, relay, request_model
from sagaloop.agents.openai_agents.replay import replayed_events
from sagaloop.agents.openai_agents.run import in_run
from sagaloop.sagas.app import StepDef
from sagaloop.sagas.context import StepContext

if TYPE_CHECKING:
    from sagaloop.agents.openai_agents.runner import SagaRunner

RESPONSE: pydantic.TypeAdapter[ModelResponse] = pydantic.TypeAdapter(ModelResponse)
_SETTINGS: pydantic.TypeAdapter[ModelSettings] = pydantic.TypeAdapter(ModelSettings)
_decoder = transcript.Decoder()


def _text_of(response: ModelResponse) -> str | None:
    texts = [
        part.text
        for item in response.output
        if getattr(item, "type", None) == "message"
        for part in getattr(item, "content", ())
        if getattr(part, "type", None) == "output_text"
    ]
    return "\n".join(texts) or None


class _Schema(AgentOutputSchemaBase):
    """An agent's output schema, rebuilt on the worker from what the model needs of it."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self._spec = spec

    def is_plain_text(self) -> bool:
        return bool(self._spec["plain"])

    def name(self) -> str:
        return str(self._spec["name"])

    def json_schema(self) -> dict[str, Any]:
        return dict(self._spec["schema"] or {})

    def is_strict_json_schema(self) -> bool:
        return bool(self._spec["strict"])

    def validate_json(self, json_str: str) -> Any:
        raise UserError("the output is validated in saga code, not on the worker")


def _schema_spec(output_schema: AgentOutputSchemaBase) -> dict[str, Any]:
    """What the worker needs of an agent's output schema (:class:`_Schema` rebuilds it)."""
    return {
        "plain": output_schema.is_plain_text(),
        "name": output_schema.name(),
        "schema": None if output_schema.is_plain_text() else output_schema.json_schema(),
        "strict": output_schema.is_strict_json_schema(),
    }


async def _not_here(*_: Any) -> Any:
    raise UserError("a tool or handoff the model is told about runs in saga code, not here")


class StepModel(Model):
    """The model as saga code sees it: each call is the agent's model step."""

    def __init__(self, runner: SagaRunner, agent: str) -> None:
        self._runner = runner
        self._agent = agent

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: Any,
    ) -> ModelResponse:
        run = in_run("the model")
        items: list[Any] = [{"role": "user", "content": input}] if isinstance(input, str) else input

        def request() -> dict[str, Any]:
            return {
                "model": run.model,
                "system": system_instructions,
                "settings": model_settings.to_json_dict(),
                "tools": [tool_spec(t) for t in tools],
                "output_schema": None if output_schema is None else _schema_spec(output_schema),
                "handoffs": [
                    {
                        "tool_name": h.tool_name,
                        "tool_description": h.tool_description,
                        "input_json_schema": h.input_json_schema,
                        "agent_name": h.agent_name,
                        "strict_json_schema": h.strict_json_schema,
                    }
                    for h in handoffs
                ],
                "previous_response_id": previous_response_id,
                "conversation_id": conversation_id,
                "prompt": jsonable(prompt, "the prompt"),
            }

        step = self._runner.model_steps[self._agent]
        reply = await request_model(run, step, items, request, _output_items)
        response = RESPONSE.validate_python(_aliased(reply["response"]))
        run.last_text = _text_of(response)
        names = {t.name for t in tools if isinstance(t, FunctionTool)}  # MCP tools included
        calls = sum(
            getattr(i, "type", None) == "function_call" and getattr(i, "name", None) in names
            for i in response.output
        )
        await count_response(run, reply, response.usage, calls)
        return response

    async def stream_response(
        self, *args: Any, **kwargs: Any
    ) -> AsyncIterator[TResponseStreamEvent]:
        """``SagaRunner.run_streamed`` in a saga: the request (the SDK's arguments, as to
        :meth:`get_response`) is the same step as :meth:`get_response` (streamed on the worker
        with ``SagaRunner(stream=True)``); saga code gets the recorded response, replayed as
        events (:func:`replayed_events`)."""
        response = await self.get_response(*args, **kwargs)
        for event in replayed_events(response):
            yield event


def tool_spec(tool: Tool) -> dict[str, Any]:
    """A tool as the worker rebuilds it for the model: a function tool's declaration, or a
    hosted tool's name (the worker takes the agent's own)."""
    if isinstance(tool, FunctionTool):
        return {
            "function": {
                "name": tool.name,
                "description": tool.description,
                "params_json_schema": tool.params_json_schema,
                "strict_json_schema": tool.strict_json_schema,
                "defer_loading": tool.defer_loading,
            }
        }
    return {"hosted": tool.name}


def _model(provider: ModelProvider, agent: Agent[Any], name: str | None) -> Model:
    if name is None and isinstance(agent.model, Model):
        return agent.model
    return provider.get_model(name or agent.model)  # type: ignore[arg-type]


async def serve_request(
    ctx: StepContext,
    request: dict[str, Any],
    *,
    agent: Agent[Any],
    step: StepDef[Any, Any],
    provider: ModelProvider,
    stream: bool,
) -> dict[str, Any]:
    """The worker side of the model step ``step`` of ``agent``: the recorded request sent to
    the agent's model (resolved by ``provider`` when it names one), streamed to the run's live
    channel with ``stream``; returns the response and its price."""
    agent_name = agent.name
    delta = request["transcript"]
    items = _decoder.messages(ctx.run_id, delta, step=step.name, history=ctx.history)
    request = {
        **request,
        **_decoder.extras(ctx.run_id, request, step=step.name, history=ctx.history),
    }
    tools: list[Tool] = []
    for spec in request.get("tools") or []:
        if "function" in spec:
            tools.append(FunctionTool(on_invoke_tool=_not_here, **spec["function"]))
        else:
            hosted = [t for t in agent.tools if getattr(t, "name", None) == spec["hosted"]]
            if not hosted:
                raise UserError(f"agent {agent_name!r} has no tool {spec['hosted']!r} here")
            tools.append(hosted[0])
    handoffs: list[Handoff[Any, Any]] = [
        Handoff(on_invoke_handoff=_not_here, **spec) for spec in request.get("handoffs") or []
    ]
    schema = request.get("output_schema")
    args: tuple[Any, ...] = (
        request.get("system"),
        items,
        _SETTINGS.validate_python(request.get("settings") or {}),
        tools,
        None if schema is None else _Schema(schema),
        handoffs,
        ModelTracing.DISABLED,
    )
    options: dict[str, Any] = {
        "previous_response_id": request.get("previous_response_id"),
        "conversation_id": request.get("conversation_id"),
        "prompt": request.get("prompt"),
    }
    model = _model(provider, agent, request.get("model"))
    if stream:
        response = None
        events: Any = model.stream_response(*args, **options)  # an async generator
        # closed (its connection too) when the run ends (the heartbeat raises
        # StepCancelled) or the step's timeout passes: nothing reads, or pays for, the rest
        async with attempt_timeout(step.timeout), aclosing(events) as closing:
            async for event in closing:
                relay(
                    ctx,
                    agent_name,
                    getattr(event, "delta", None)
                    if event.type == "response.output_text.delta"
                    else None,
                    partial(jsonable, event, "a stream event"),
                )
                if event.type == "response.completed":
                    response = ModelResponse(
                        output=list(event.response.output),
                        usage=_usage_from(event.response.usage),
                        response_id=event.response.id,
                    )
        if response is None:
            raise UserError(f"the model of agent {agent_name!r} ended its stream unfinished")
    else:
        response = await model.get_response(*args, **options)
    ref, vendor = model_ref(request.get("model") or agent.model, model)
    usage = response.usage  # on the step's span (GenAI semantic conventions):
    tracing.model_call(
        model=ref,
        provider=vendor,
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
    )
    cost = _price(request.get("model") or agent.model, model, response)
    # by alias: a field named ``async_`` is ``async`` in the API's JSON, and only that
    # name loads back into the field (else it comes back as an extra too)
    dumped = RESPONSE.dump_python(response, mode="json", by_alias=True)
    result = {"response": dumped, "cost": cost}
    _decoder.responded(ctx.run_id, delta, result)
    return result


def _output_items(reply: dict[str, Any]) -> list[tuple[list[Any], Any]]:
    """A reply's output items: what the next request's input may repeat, one message each."""
    output = (reply.get("response") or {}).get("output")
    return [(["response", "output", i], item) for i, item in enumerate(output or [])]


def _aliased(recorded: Any) -> Any:
    """A response recorded before it was stored by alias: its items' ``async_`` (the field's
    name) as ``async`` (its alias), which the SDK needs to tell parallel approvals apart."""
    output = recorded.get("output") if isinstance(recorded, dict) else None
    if not isinstance(output, list) or not any(
        isinstance(i, dict) and "async_" in i for i in output
    ):
        return recorded
    items = [
        {("async" if k == "async_" else k): v for k, v in i.items()}
        if isinstance(i, dict) and "async" not in i
        else i
        for i in output
    ]
    return {**recorded, "output": items}


def _usage_from(usage: Any) -> Any:
    from agents.usage import Usage

    if usage is None:
        return Usage(requests=1)
    return Usage(
        requests=1,
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        total_tokens=usage.total_tokens,
    )


def model_ref(name: Any, model: Model) -> tuple[str | None, str | None]:
    """The model's name and its provider, when known: ``openai`` for the SDK's OpenAI models,
    or the prefix of MultiProvider's ``provider/model``."""
    ref = name if isinstance(name, str) else getattr(model, "model", None)
    if not isinstance(ref, str) or not ref:
        return None, None
    provider, _, bare = ref.rpartition("/")
    if not provider and type(model).__module__.startswith("agents.models.openai"):
        provider = "openai"
    return bare, provider or None


def _price(name: Any, model: Model, response: ModelResponse) -> float | None:
    """What the response cost, priced on the worker with genai-prices (None when the package,
    the model's name or its price is not known)."""
    try:
        import genai_prices
    except ImportError:
        return None
    ref = name if isinstance(name, str) else getattr(model, "model", None)
    if not isinstance(ref, str) or not ref:
        return None
    provider, _, bare = ref.rpartition("/")  # MultiProvider's "openai/gpt-5"
    usage = response.usage
    try:
        price = genai_prices.calc_price(
            genai_prices.Usage(
                input_tokens=usage.input_tokens,
                cache_read_tokens=usage.input_tokens_details.cached_tokens or None,
                output_tokens=usage.output_tokens,
            ),
            model_ref=bare,
            provider_id=provider or None,
        )
        return float(price.total_price)
    except Exception:  # no price known for this model: counted as 0
        return None
