"""Errors tell the truth (issue 23): a failed step's cause chain is its own, its traceback
starts with the user's frames, and a reconciled step's duration is its attempt's."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from agents import Agent as OAAgent
from agents import function_tool
from agents.testing import ModelStep, ScriptedModel
from pydantic_ai import Agent, models
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from sagaloop import App, RetryPolicy, SagaContext, StepContext
from sagaloop.agents import ToolPolicy
from sagaloop.agents.openai_agents import SagaRunner
from sagaloop.agents.pydantic_ai import SagaAgent
from sagaloop.engine import history as h
from sagaloop.testing import Harness

models.ALLOW_MODEL_REQUESTS = False

ONCE = RetryPolicy(max_attempts=1)


def recorded_errors(env: Harness, run_id: str) -> list[dict[str, Any]]:
    """The errors of the failed attempts of the run's steps, as the history keeps them."""
    kinds = (h.STEP_RETRYING, h.STEP_FAILED, h.STEP_HALTED)
    return [e.data["error"] for e in env.history(run_id) if e.kind in kinds]


def assert_no_false_cause(errors: list[dict[str, Any]]) -> None:
    assert errors, "a step failed"
    for error in errors:
        causes = [c["message"] for c in error.get("causes", [])]
        assert not any("event loop" in c for c in causes), causes
        assert "no running event loop" not in (error.get("traceback") or "")


# --- the cause chain ---------------------------------------------------------------------------


def test_an_async_step_failure_has_no_event_loop_cause() -> None:
    app = App("truth")

    @app.step(retry=ONCE)
    async def charge(ctx: StepContext, order: str) -> str:
        raise ValueError(f"card declined for {order}")

    @app.step(retry=ONCE, timeout=timedelta(seconds=30))  # runs on the step threads
    async def charge_later(ctx: StepContext, order: str) -> str:
        try:
            raise ConnectionError("provider unreachable")
        except ConnectionError as e:
            raise RuntimeError(f"charge of {order} failed") from e

    @app.saga(name="s")
    async def s(ctx: SagaContext, which: str) -> str:
        return await ctx.call(charge if which == "now" else charge_later, order="o1")

    env = Harness(app)
    now, later = env.start(s, "now"), env.start(s, "later")
    env.run_until_idle()
    [first] = recorded_errors(env, now)
    assert first["type"] == "ValueError"
    assert first.get("causes", []) == [], "the error had no cause"
    [second] = recorded_errors(env, later)
    assert second["causes"] == [{"type": "ConnectionError", "message": "provider unreachable"}]


def test_pydantic_ai_model_and_tool_errors_have_their_own_causes() -> None:
    app = App("truth")

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("lookup", {"q": "x"})])
        raise ValueError("the model said no")

    agent = Agent(FunctionModel(model), name="pa")

    @agent.tool_plain(metadata={"sagaloop": ToolPolicy(retry=ONCE)})
    async def lookup(q: str) -> str:
        raise KeyError(q)

    @agent.tool_plain
    async def unused() -> str:
        return ""

    saga_agent = SagaAgent(agent, app=app, model_retry=ONCE)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("go")).output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    errors = recorded_errors(env, run_id)
    assert_no_false_cause(errors)
    assert [e["type"] for e in errors] == ["KeyError"]


def test_pydantic_ai_model_error_has_no_event_loop_cause() -> None:
    app = App("truth")

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise ValueError("the model said no")

    saga_agent = SagaAgent(Agent(FunctionModel(model), name="pm"), app=app, model_retry=ONCE)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await saga_agent.run("go")).output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    errors = recorded_errors(env, run_id)
    assert_no_false_cause(errors)
    # a model request's error that is no outage parks the run (issue 23): the cause is kept
    assert [e["type"] for e in errors] == ["ModelRequestRefused"]
    assert errors[0]["causes"][0] == {"type": "ValueError", "message": "the model said no"}


def test_openai_agents_model_and_tool_errors_have_their_own_causes() -> None:
    app = App("truth")

    @function_tool
    async def lookup(q: str) -> str:
        """Look it up."""
        raise KeyError(q)

    model = ScriptedModel([ModelStep.raise_error(ValueError("the model said no"))])
    agent: OAAgent[Any] = OAAgent(name="oa", model=model, tools=[lookup])
    runner = SagaRunner(app, agent, model_retry=ONCE, tools={"lookup": ToolPolicy(retry=ONCE)})

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return str((await runner.run(agent, "go")).final_output)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    errors = recorded_errors(env, run_id)
    assert_no_false_cause(errors)
    # a model request's error that is no outage parks the run (issue 23): the cause is kept
    assert [e["type"] for e in errors] == ["ModelRequestRefused"]
    assert errors[0]["causes"][0] == {"type": "ValueError", "message": "the model said no"}


# --- the user's frames first ---------------------------------------------------------------------


def _failing_tool_app() -> tuple[App, Any]:
    app = App("truth")

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("lookup", {"q": "x"})])
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(model), name="pt")

    @agent.tool_plain(metadata={"sagaloop": ToolPolicy(retry=ONCE)})
    async def lookup(q: str) -> str:
        raise KeyError(f"no record {q}")

    saga_agent = SagaAgent(agent, app=app, model_retry=ONCE)

    @app.saga(name="s")
    async def answer_the_user(ctx: SagaContext) -> str:
        return str((await saga_agent.run("go")).output)

    return app, answer_the_user


def frame_files(trace: str) -> list[str]:
    return [line.split('"')[1] for line in trace.splitlines() if line.startswith('  File "')]


def test_a_failed_agent_run_shows_the_users_frames_and_folds_the_frameworks() -> None:
    app, saga = _failing_tool_app()
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "failed"
    trace = (run.error or {})["traceback"]
    lines = trace.splitlines()
    assert len(lines) < 25, trace
    files = frame_files(trace)
    assert files[0] == __file__, "the saga's own frame comes first"
    assert "in answer_the_user" in trace
    assert not any("pydantic_graph" in f or "/pydantic_ai/" in f for f in files[:-1]), trace
    assert any("frames of" in line and "pydantic_graph" in line for line in lines), trace
    assert lines[-1].startswith("sagaloop.errors.StepFailedError: step 'agent__pt__tool__lookup'")

    [failed] = [e for e in env.history(run_id) if e.kind == h.STEP_FAILED]
    step_trace = failed.data["error"]["traceback"]
    assert frame_files(step_trace)[-1] == __file__, "where the tool raised is shown"
    assert "in lookup" in step_trace and "raise KeyError" in step_trace
    assert "frames of" in step_trace and "pydantic_ai" in step_trace
    assert not any("/pydantic_ai/" in f for f in frame_files(step_trace)), step_trace
    line = next(x for x in env.status(run_id).steps if x.step.endswith("lookup"))
    assert line.traceback == step_trace


def test_folding_keeps_the_cause_chain_and_the_innermost_frame() -> None:
    import asyncio

    from sagaloop.errors import ErrorInfo

    async def inner() -> None:
        await asyncio.sleep(0)
        raise ConnectionError("refused")

    def user_code() -> None:
        try:
            asyncio.run(inner())
        except ConnectionError as e:
            raise RuntimeError("could not book") from e

    try:
        user_code()
    except RuntimeError as e:
        trace = ErrorInfo.from_exception(e, with_traceback=True).traceback or ""
    assert "The above exception was the direct cause of the following exception:" in trace
    assert "ConnectionError: refused" in trace and "RuntimeError: could not book" in trace
    assert "in inner" in trace and "in user_code" in trace
    assert "frames of asyncio" in trace, trace
    assert "asyncio/runners.py" not in trace and "asyncio/base_events.py" not in trace


# --- a reconciled step's duration ---------------------------------------------------------------


def test_a_reconciled_steps_duration_is_its_attempts_not_the_lease_wait() -> None:
    """The worker dies after the step took effect; the message comes back once the lease
    runs out, and the reconcile finds the effect at once: the step took that attempt's time,
    not the 60 s the message waited for its lease."""
    from sagaloop.engine.messages import Envelope
    from sagaloop.engine.ports import Delivery
    from sagaloop.runtime.steps import StepRunner
    from sagaloop.testing import Crash

    app = App("truth")
    charges: dict[str, str] = {}

    @app.step(idempotent=False)
    def charge(ctx: StepContext, order: str) -> str:
        charges[ctx.idempotency_key] = f"ch-{order}"
        return charges[ctx.idempotency_key]

    @charge.reconcile
    def find(ctx: StepContext, order: str) -> str | None:
        return charges.get(ctx.idempotency_key)

    @app.saga(name="s")
    async def s(ctx: SagaContext, order: str) -> str:
        return await ctx.call(charge, order=order)

    env = Harness(app)
    crashed: list[str] = []

    def die_after_the_effect(role: str, delivery: Delivery) -> None:
        if role == "worker" and not crashed:
            task = Envelope.from_bytes(delivery.body)
            crashed.append(task.message_id)
            StepRunner(app, worker="doomed", inline=True).run(task)
            raise Crash("killed before commit")

    env.crash_hook = die_after_the_effect
    run_id = env.start(s, "o1")
    env.run_until_idle()
    assert crashed and env.result(run_id) == "ch-o1"
    [line] = env.status(run_id).steps
    assert line.state == "reconciled"
    waited = (env.get(run_id).updated_at - line.started_at).total_seconds()
    assert waited >= env.lease.total_seconds(), "the message waited out its lease"
    assert line.duration_s is not None and line.duration_s < 5, line.duration_s


def test_a_step_reconciled_on_a_retry_took_that_attempts_time_not_the_backoff() -> None:
    """The first attempt's response was lost (the effect happened); the retry, 45 s later,
    finds the effect: the step's duration is the reconciling attempt's, not the backoff's."""
    app = App("truth")
    charges: dict[str, str] = {}

    @app.step(idempotent=False, retry=RetryPolicy(initial_interval=timedelta(seconds=45)))
    def charge(ctx: StepContext, order: str) -> str:
        charges[ctx.idempotency_key] = f"ch-{order}"
        raise ConnectionError("the response was lost")

    @charge.reconcile
    def find(ctx: StepContext, order: str) -> str | None:
        return charges.get(ctx.idempotency_key)

    @app.saga(name="s")
    async def s(ctx: SagaContext, order: str) -> str:
        return await ctx.call(charge, order=order)

    env = Harness(app)
    run_id = env.start(s, "o1")
    env.run_until_idle()
    assert env.result(run_id) == "ch-o1"
    [line] = env.status(run_id).steps
    assert (line.state, line.attempts) == ("reconciled", 2)
    assert line.duration_s is not None and line.duration_s < 5, line.duration_s
