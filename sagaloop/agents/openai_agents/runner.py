"""`SagaRunner` and `step_as_function_tool`: OpenAI Agents SDK agents whose models, tools and
handoffs go through steps (see :mod:`sagaloop.agents.openai_agents`)."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from typing import Any, Unpack

import pydantic
from agents import Agent, RunConfig, Runner, RunResult, RunResultStreaming
from agents.exceptions import UserError
from agents.handoffs import Handoff
from agents.items import TResponseInputItem
from agents.mcp import MCPServer
from agents.models.interface import Model, ModelProvider
from agents.models.multi_provider import MultiProvider
from agents.run import DEFAULT_MAX_TURNS
from agents.tool import (
    CodeInterpreterTool,
    FileSearchTool,
    FunctionTool,
    HostedMCPTool,
    ImageGenerationTool,
    Tool,
    ToolSearchTool,
    WebSearchTool,
    invoke_function_tool,
    maybe_invoke_function_tool_failure_error_function,
    set_function_tool_failure_error_function,
)
from agents.tool_context import ToolContext

from sagaloop import tracing
from sagaloop.agents import transcript
from sagaloop.agents._core import (
    ToolPolicy,
    ask,
    charge_tool_calls,
    denial,
    jsonable,
    run_plain,
    usage_of,
)
from sagaloop.agents._model_call import finish_run
from sagaloop.agents.budgets import Budget
from sagaloop.agents.openai_agents import mcp
from sagaloop.agents.openai_agents.model import StepModel, serve_request
from sagaloop.agents.openai_agents.run import (
    OpenAIRun,
    current,
    in_run,
    tool_call,
    unless_refused,
)
from sagaloop.agents.openai_agents.subagents import SAGA_ATTR, agent_tool
from sagaloop.agents.options import AgentOptions, DurableAdapter, steps_prefix
from sagaloop.agents.subagents import Failures
from sagaloop.agents.tools import StepTool, StepTools, ToolCallError
from sagaloop.engine import sandbox
from sagaloop.errors import StepFailedError, ValidationError
from sagaloop.sagas.app import App, SagaDef, StepDef
from sagaloop.sagas.context import SagaContext, StepContext, current_saga

__all__ = ["SagaRunner", "step_as_function_tool"]

# The SDK keys in-memory state with uuid4 from its own modules (the scope of an agent-as-tool's
# state, occurrence keys of run items, a trace group): values that "never enter model payloads"
# and never reach the history; tracing is off in saga code. User callbacks stay guarded.
sandbox.trust_framework("agents")

_HOSTED = (
    FileSearchTool,
    WebSearchTool,
    HostedMCPTool,
    CodeInterpreterTool,
    ImageGenerationTool,
    ToolSearchTool,
)
"""Tools the provider runs inside the model call: sent to the model as they are."""
_STEP_ATTR = "__sagaloop_step__"


def _encode_items(items: Any) -> list[Any]:
    return list(jsonable(list(items), "the model's input"))


def step_as_function_tool(
    step: StepDef[Any, Any],
    *,
    name: str | None = None,
    description: str | None = None,
    needs_approval: bool = False,
) -> FunctionTool:
    """An OpenAI Agents ``FunctionTool`` that calls ``step`` (declared with ``@app.step``, with
    its own queue, retry, reconcile and compensation): its parameters' strict JSON Schema comes
    from the step's signature (:class:`~sagaloop.agents.tools.StepTools`). In a saga the call is
    ``ctx.call(step, ...)``; outside one, the step's function runs in-process. Arguments that do
    not fit the signature come back to the model as an error."""
    tools = StepTools(StepTool(step, name=name, description=description))
    (tool_name,) = tools.names

    async def invoke(ctx: ToolContext[Any], arguments: str) -> Any:
        run, arguments, refusal = tool_call(ctx.tool_call_id, arguments)
        if refusal is not None:
            return refusal
        try:
            kwargs = tools.validate(tool_name, arguments)
        except ToolCallError as e:
            return f"Error: {e}"
        saga = current_saga()
        if saga is not None:
            charge_tool_calls(saga, 1, "" if run is None else run.conversation)
        value = await (saga.call(step, **kwargs) if saga else run_plain(step, kwargs))
        value = jsonable(value, f"the result of step {step.name!r}")
        return value if isinstance(value, str) else json.dumps(value)

    schema = tools.openai_responses()[0]
    tool = FunctionTool(
        name=tool_name,
        description=schema.get("description") or "",
        params_json_schema=schema["parameters"],
        on_invoke_tool=invoke,
        strict_json_schema=True,
        needs_approval=unless_refused(needs_approval),
    )
    setattr(tool, _STEP_ATTR, step.name)
    return tool


class SagaRunner(DurableAdapter):
    """Runs OpenAI Agents SDK agents durably in saga code (see the module's doc); outside saga
    code, ``run`` is ``Runner.run``.

    Declare it where the app's steps are declared, with the agents it may run: their steps (and
    those of every agent they hand off to) are registered on ``app`` here, so engine and
    workers that import the app know them. ``options`` are those of both adapters
    (:class:`~sagaloop.agents.options.AgentOptions`: queues, retries, rate limits, tool
    policies, budget, approvals, streaming); ``model_rate_limit`` gives each agent's model step
    its own quota unless ``model_rate_key`` names a shared one."""

    def __init__(
        self,
        app: App,
        *agents: Agent[Any],
        model_provider: ModelProvider | None = None,
        context_type: Any = None,
        **options: Unpack[AgentOptions],
    ) -> None:
        if not agents:
            raise ValidationError("SagaRunner needs the agents it runs: SagaRunner(app, agent)")
        self._given = self._take_options(app, options)
        self.model_provider = model_provider or MultiProvider()
        self.context_type = context_type
        self.policies: dict[str, ToolPolicy] = {}
        self.agents: dict[str, Agent[Any]] = {}
        """The original agents, by name (the worker runs their models and tools)."""
        self.model_steps: dict[str, StepDef[Any, Any]] = {}
        self.tool_steps: dict[tuple[str, str], StepDef[Any, Any]] = {}
        self.mcp_steps: dict[tuple[str, str], tuple[StepDef[Any, Any], StepDef[Any, Any]]] = {}
        self._function_tools: dict[tuple[str, str], FunctionTool] = {}
        self._clones: dict[int, Agent[Any]] = {}
        self.as_tools: dict[str, SagaDef[Any, Any]] = {}
        """The sagas of ``agent_as_tool``, by agent name."""
        for agent in agents:
            self._declare(agent)
        unknown = set(self._given) - set(self.policies)
        if unknown:
            raise ValidationError(f"SagaRunner(tools=...) names unknown tools: {sorted(unknown)}")
        for agent in list(self.agents.values()):
            self._durable(agent)

    @property
    def step_names(self) -> list[str]:
        """The names of the steps this runner registered (compatibility data)."""
        steps = [*self.model_steps.values(), *self.tool_steps.values()]
        steps += [s for pair in self.mcp_steps.values() for s in pair]
        return sorted(s.name for s in steps)

    # --- declaration -------------------------------------------------------------------------

    def _declare(self, agent: Agent[Any]) -> None:
        known = self.agents.get(agent.name)
        if known is agent:
            return
        if known is not None:
            raise ValidationError(
                f"two agents are named {agent.name!r}: a SagaRunner's agents need distinct names"
                " (their steps are named after them)"
            )
        self.agents[agent.name] = agent
        prefix = steps_prefix(agent.name)

        async def model_request(ctx: StepContext, request: dict[str, Any]) -> dict[str, Any]:
            return await self._model_request(agent.name, ctx, request)

        self.model_steps[agent.name] = self.model_options.declare(self.app, prefix, model_request)
        for tool in agent.tools:
            if isinstance(tool, FunctionTool):
                if not _linked(tool):
                    self._declare_tool(agent, prefix, tool)
            elif not isinstance(tool, _HOSTED):
                raise ValidationError(
                    f"tool {getattr(tool, 'name', tool)!r} of agent {agent.name!r} "
                    f"({type(tool).__name__}) runs in the caller's process, which a saga "
                    "replays: give the agent a function tool (a step) that does its work"
                )
        for server in agent.mcp_servers:
            self._declare_mcp(agent, prefix, server)
        for target in agent.handoffs:
            found = target if isinstance(target, Agent) else _handoff_target(target)
            if found is not None:
                self._declare(found)

    def _declare_tool(self, agent: Agent[Any], prefix: str, tool: FunctionTool) -> None:
        policy = self._given.get(tool.name) or ToolPolicy()
        self.policies[tool.name] = policy
        key = (agent.name, tool.name)
        # on the worker a tool's exception fails the step (retried by the policy, in doubt
        # for a guarded tool); after the last attempt the saga side formats it for the model
        raising = dataclasses.replace(tool)
        set_function_tool_failure_error_function(raising, None)
        self._function_tools[key] = raising

        async def run_tool(ctx: StepContext, call: dict[str, Any]) -> dict[str, Any]:
            return await self._run_tool(key, ctx, call)

        timeout = policy.timeout
        if timeout is None and tool.timeout_seconds is not None:
            timeout = timedelta(seconds=tool.timeout_seconds)
        policy = dataclasses.replace(policy, timeout=timeout)
        self.tool_steps[key] = self._tool_step(prefix, tool.name, policy, run_tool)

    def _declare_mcp(self, agent: Agent[Any], prefix: str, server: MCPServer) -> None:
        key = f"{mcp.SERVER_KEY}{server.name}"
        policy = self._given.get(key) or ToolPolicy()
        if key in self._given:
            self.policies[key] = policy
        steps = mcp.declare(self.app, prefix, server, self._placed(policy), self.tool_queue)
        self.mcp_steps[(agent.name, server.name)] = steps

    def agent_as_tool(
        self,
        agent: Agent[Any] | None = None,
        *,
        name: str | None = None,
        description: str | None = None,
        needs_approval: bool = False,
        failures: Failures = "raise",
    ) -> FunctionTool:
        """``agent`` (one of this runner's; default: its first) as a tool of another agent,
        durable where the SDK's ``Agent.as_tool`` is not: each call runs the saga
        ``agent__{agent}__as_tool`` (declared on the app at the first call) as a child run of
        the calling run; it runs ``agent`` with this runner on the tool's ``prompt`` and
        answers with its final output. Give the supervisor its own runner:
        ``SagaRunner(app, Agent(..., tools=[research.agent_as_tool()]))``. ``name`` defaults
        to the agent's name, ``description`` to its ``handoff_description``; ``failures`` as
        :func:`saga_as_function_tool`. The sub-agent runs without context."""
        return agent_tool(
            self,
            agent,
            name=name,
            description=description,
            needs_approval=needs_approval,
            failures=failures,
        )

    # --- the saga side -----------------------------------------------------------------------

    def _durable(self, agent: Agent[Any]) -> Agent[Any]:
        """The copy of ``agent`` that saga code runs: its model, tools, MCP servers and
        handoffs go through steps."""
        found = self._clones.get(id(agent))
        if found is not None:
            return found
        if any(clone is agent for clone in self._clones.values()):
            return agent  # already durable: a result's ``last_agent``, run for the next turn
        if self.agents.get(agent.name) is not agent:
            raise UserError(
                f"agent {agent.name!r} is not one of this SagaRunner's: name it in "
                "SagaRunner(app, ...) so that its steps are registered"
            )
        clone = agent.clone(
            model=StepModel(self, agent.name),
            model_settings=agent.model_settings,
            tools=[self._durable_tool(agent, t) for t in agent.tools],
            mcp_servers=[
                mcp.StepMCPServer(s, self.mcp_steps[(agent.name, s.name)])
                for s in agent.mcp_servers
            ],
            handoffs=[],
        )
        self._clones[id(agent)] = clone
        clone.handoffs = [
            self._durable(h) if isinstance(h, Agent) else self._durable_handoff(h)
            for h in agent.handoffs
        ]
        return clone

    def _durable_handoff(self, handoff: Handoff[Any, Any]) -> Handoff[Any, Any]:
        invoke = handoff.on_invoke_handoff

        async def to_durable(ctx: Any, arguments: str) -> Any:
            return self._durable(await invoke(ctx, arguments))

        return dataclasses.replace(handoff, on_invoke_handoff=to_durable)

    def _durable_tool(self, agent: Agent[Any], tool: Tool) -> Tool:
        if not isinstance(tool, FunctionTool) or _linked(tool):
            return tool
        step = self.tool_steps[(agent.name, tool.name)]
        policy = self.policies[tool.name]

        async def invoke(ctx: ToolContext[Any], arguments: str) -> Any:
            run = in_run(f"tool {tool.name!r}")
            if run.refusal is not None:
                return run.refusal
            arguments = run.edits.pop(ctx.tool_call_id, arguments)
            call: dict[str, Any] = {"call_id": ctx.tool_call_id, "context": run.context}
            try:
                args = json.loads(arguments or "{}")
            except ValueError:
                args = None
            if isinstance(args, dict):
                call["args"] = args
            else:
                call["arguments"] = arguments
            charge_tool_calls(run.saga, 1, run.conversation)
            try:
                reply = await run.saga.call(step, call)
                run.encoder.received(reply)
            except StepFailedError as e:  # its last attempt: as the SDK would tell the model
                told = await maybe_invoke_function_tool_failure_error_function(
                    function_tool=tool, context=ctx, error=e
                )
                if told is None:  # the tool's failure_error_function is None: the run fails
                    raise
                return told
            return reply["value"]

        needs = policy.requires_approval
        return dataclasses.replace(
            tool,
            on_invoke_tool=invoke,
            timeout_seconds=None,  # the step's timeout, on the worker
            needs_approval=unless_refused(tool.needs_approval if needs is None else needs),
        )

    async def run(
        self,
        starting_agent: Agent[Any],
        input: str | list[TResponseInputItem],
        *,
        context: Any = None,
        max_turns: int = DEFAULT_MAX_TURNS,
        hooks: Any = None,
        run_config: RunConfig | None = None,
        budget: Budget | None = None,
        **kwargs: Any,
    ) -> RunResult:
        """``Runner.run(starting_agent, input, ...)``, durable in saga code: see the module's
        doc. ``budget`` (else the runner's) bounds all agent runs of the saga run together.
        A tool that needs approval makes the run wait for ``sagaloop approve``/``deny``; the
        SDK's run then resumes from its state, in the same saga run."""
        options = dict(kwargs, context=context, max_turns=max_turns, hooks=hooks)
        run, agent, config = self._begin(starting_agent, run_config, budget, options)
        if run is None:
            return await Runner.run(agent, input, run_config=config, **options)
        token = current.set(run)
        try:
            result = await Runner.run(agent, input, run_config=config, **options)
            while result.interruptions:
                state = result.to_state()
                for item in result.interruptions:
                    await self._answer(run, state, item)
                result = await Runner.run(
                    agent, state, max_turns=max_turns, hooks=hooks, run_config=config
                )
            return result
        finally:
            current.reset(token)
            finish_run(run)

    def run_streamed(
        self,
        starting_agent: Agent[Any],
        input: str | list[TResponseInputItem],
        *,
        context: Any = None,
        max_turns: int = DEFAULT_MAX_TURNS,
        hooks: Any = None,
        run_config: RunConfig | None = None,
        budget: Budget | None = None,
        **kwargs: Any,
    ) -> RunResultStreaming:
        """``Runner.run_streamed(starting_agent, input, ...)``, durable in saga code: the same
        steps and records as :meth:`run`; ``stream_events()`` yields the SDK's events, each
        model response replayed from its recorded step (the same on every replay), while the
        worker streams the live tokens to the run's channel with ``SagaRunner(stream=True)``.
        A tool that needs approval ends the stream with ``interruptions``: use :meth:`run`,
        which waits for the answer in the run."""
        options = dict(kwargs, context=context, max_turns=max_turns, hooks=hooks)
        run, agent, config = self._begin(starting_agent, run_config, budget, options)
        if run is None:
            return Runner.run_streamed(agent, input, run_config=config, **options)
        token = current.set(run)  # the streamed run's task starts with a copy of this context
        try:
            return Runner.run_streamed(agent, input, run_config=config, **options)
        finally:
            current.reset(token)

    def _begin(
        self,
        agent: Agent[Any],
        run_config: RunConfig | None,
        budget: Budget | None,
        options: dict[str, Any],
    ) -> tuple[OpenAIRun | None, Agent[Any], RunConfig | None]:
        """What :meth:`run` and :meth:`run_streamed` run: outside saga code, the SDK's own run
        of ``agent`` (no saga side); in saga code, the saga side of a new run, the durable
        copy of ``agent`` and the run config saga code runs it with."""
        saga = current_saga()
        if saga is None:
            return None, agent, run_config
        run, config = self._start(saga, options["context"], run_config, budget, options)
        return run, self._durable(agent), config

    def _start(
        self,
        saga: SagaContext,
        context: Any,
        run_config: RunConfig | None,
        budget: Budget | None,
        kwargs: dict[str, Any],
    ) -> tuple[OpenAIRun, RunConfig]:
        """The saga side of one run, and the run config saga code runs it with."""
        if kwargs.get("session") is not None:
            raise ValidationError(
                "SagaRunner.run(session=...) is not supported in a saga: the run's history is "
                "its memory; pass the earlier items as input"
            )
        config = run_config or RunConfig()
        if isinstance(config.model, Model):
            raise ValidationError(
                "RunConfig(model=...) must name the model in a saga (the worker resolves it "
                "with SagaRunner(model_provider=...))"
            )
        model_name = config.model
        # no trace is exported from saga code (a replay would send it again)
        config = dataclasses.replace(config, model=None, tracing_disabled=True)
        run = OpenAIRun(
            saga=saga,
            runner=self,
            conversation=f"{saga.run_id}/{saga.uuid4()}",
            context=None
            if context is None
            else jsonable(
                context,
                "the run's context (tools "
                "run on workers, which rebuild it from JSON: pass ids and URLs, not connections)",
            ),
            model=model_name,
            budget=budget or self.budget,
            encoder=transcript.Encoder(_encode_items, same=_same_item),
        )
        usage_of(saga)
        return run, config

    async def _answer(self, run: OpenAIRun, state: Any, item: Any) -> None:
        """Ask a person about the tool call ``item``, and tell the SDK's run state."""
        if run.refusal is not None:  # its batch is over the budget: nobody is asked
            state.reject(item, rejection_message=run.refusal)
            return
        name = item.name or "tool"
        raw_arguments = item.arguments
        try:
            args = json.loads(raw_arguments) if raw_arguments else {}
        except ValueError:
            args = {"arguments": raw_arguments}
        decision = await ask(
            run.saga,
            name,
            args,
            self.policies.get(name) or ToolPolicy(),
            timeout=self.approval_timeout,
            on_timeout=self.on_approval_timeout,
            reasoning=run.last_text,
            schema=_schema_of(item, name),
        )
        if not decision.approved:
            state.reject(item, rejection_message=denial(decision.reason))
            return
        call_id = _call_id(item)
        if decision.edited and call_id is not None:
            run.edits[call_id] = json.dumps(decision.args)
        state.approve(item)

    # --- the worker side ---------------------------------------------------------------------

    async def _model_request(
        self, agent_name: str, ctx: StepContext, request: dict[str, Any]
    ) -> dict[str, Any]:
        return await serve_request(
            ctx,
            request,
            agent=self.agents[agent_name],
            step=self.model_steps[agent_name],
            provider=self.model_provider,
            stream=self.stream,
        )

    async def _run_tool(
        self, key: tuple[str, str], ctx: StepContext, call: dict[str, Any]
    ) -> dict[str, Any]:
        tool = self._function_tools[key]
        tracing.tool_call(tool.name)  # on the step's span: gen_ai.tool.name
        arguments = call["arguments"] if "arguments" in call else json.dumps(call.get("args"))
        context = call.get("context")
        if context is not None and self.context_type is not None:
            context = pydantic.TypeAdapter(self.context_type).validate_python(context)
        tool_ctx: ToolContext[Any] = ToolContext(
            context=context,
            tool_name=tool.name,
            tool_call_id=str(call.get("call_id") or ""),
            tool_arguments=arguments,
            agent=self.agents[key[0]],
        )
        value = await invoke_function_tool(
            function_tool=tool, context=tool_ctx, arguments=arguments
        )
        return {"value": jsonable(value, f"the result of tool {tool.name!r}")}


def _linked(tool: FunctionTool) -> bool:
    """Whether ``tool`` calls a step or runs a saga from saga code (no step of its own)."""
    return getattr(tool, _STEP_ATTR, None) is not None or getattr(tool, SAGA_ATTR, None) is not None


def _handoff_target(handoff: Handoff[Any, Any]) -> Agent[Any] | None:
    ref = getattr(handoff, "_agent_ref", None)
    target = ref() if callable(ref) else None
    return target if isinstance(target, Agent) else None


def _call_id(item: Any) -> str | None:
    raw = item.raw_item
    found = raw.get("call_id") if isinstance(raw, dict) else getattr(raw, "call_id", None)
    return None if found is None else str(found)


def _same_item(a: Any, b: Any) -> bool:
    return a is b or a == b


def _schema_of(item: Any, name: str) -> dict[str, Any] | None:
    """The JSON Schema of the arguments of the function tool ``name`` of the item's agent,
    which an approver's edit must fit (None: not a function tool of that agent)."""
    for tool in getattr(getattr(item, "agent", None), "tools", None) or []:
        if getattr(tool, "name", None) == name:
            schema = getattr(tool, "params_json_schema", None)
            return schema if isinstance(schema, dict) else None
    return None
