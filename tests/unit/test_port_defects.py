"""Defects found by porting other engines' samples (issue 25), each pinned by the test that
failed for its reason before the fix."""

from __future__ import annotations

import asyncio
import gc
import warnings
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sagaloop import App, Client, SagaContext, StepContext
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.runtime.service import Runtime
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness
from sagaloop.testing.wait import eventually


def test_uuid4_and_random_differ_in_each_history_of_a_continue_as_new_chain() -> None:
    """Defect 2: seeded by the run id alone, every history of the chain drew the same values;
    ``Conversation(ctx)`` and ``SagaRunner`` take their ids from ``ctx.uuid4()``."""
    app = App("chain")
    drawn: list[tuple[str, float]] = []

    @app.step
    def keep(ctx: StepContext, u: str, r: float) -> None:
        drawn.append((u, r))

    @app.saga(name="loop")
    async def loop(ctx: SagaContext, n: int) -> int:
        await ctx.call(keep, str(ctx.uuid4()), ctx.random())
        if n < 3:
            ctx.continue_as_new(n + 1)
        return n

    env = Harness(app)
    rid = env.start(loop, 0)
    env.run_until_idle()
    assert env.result(rid) == 3
    assert len(drawn) == 4
    assert len({u for u, _ in drawn}) == 4 and len({r for _, r in drawn}) == 4, drawn


def test_a_replay_of_each_history_of_the_chain_draws_its_own_values_again() -> None:
    """The seed is a function of the history (run id and its place in the chain), so a
    replay after a restart draws what the first execution drew."""
    app = App("chain2")
    drawn: list[str] = []

    @app.step
    def keep(ctx: StepContext, u: str) -> None:
        drawn.append(u)

    @app.saga(name="loop")
    async def loop(ctx: SagaContext, n: int) -> str:
        u = str(ctx.uuid4())
        await ctx.call(keep, u)
        await ctx.call(keep, u)  # the second call's activation replays the first
        if n < 1:
            ctx.continue_as_new(n + 1)
        return u

    env = Harness(app)
    rid = env.start(loop, 0)
    env.run_until_idle()
    assert drawn[0] == drawn[1] and drawn[2] == drawn[3] and drawn[0] != drawn[2]
    assert env.result(rid) == drawn[2]


def test_a_child_saga_without_input_is_called_with_none() -> None:
    """Papercut: ``Client.start(saga, None)`` accepts a saga without input; so does
    ``ctx.call(saga, None)`` now (it raised ValidationError "takes 0 input")."""
    app = App("noinput")

    @app.saga(name="kid")
    async def kid(ctx: SagaContext) -> str:
        return "done"

    @app.saga(name="parent")
    async def parent(ctx: SagaContext) -> list[str]:
        return [await ctx.call(kid, None), await ctx.call(kid)]

    env = Harness(app)
    rid = env.start(parent, None)
    env.run_until_idle()
    assert env.result(rid) == ["done", "done"]


def _unwinding_app(unwound: list[str]) -> tuple[App, Any]:
    app = App("unwind")

    @app.saga(name="waits")
    async def waits(ctx: SagaContext) -> None:
        try:
            await ctx.wait_for_event("never")
        finally:
            await asyncio.sleep(0)  # an await in finally: only a loop can run it
            unwound.append(ctx.run_id)

    return app, waits


@pytest.mark.parametrize("cache", [False, True])
def test_the_code_of_a_cancelled_run_unwinds_on_its_own_loop(cache: bool) -> None:
    """Defect 5: the saga code of a run that ended by cancellation was closed by the garbage
    collector ("coroutine ignored GeneratorExit"), its ``finally`` cut at the first await."""
    unwound: list[str] = []
    app, waits = _unwinding_app(unwound)
    env = Harness(app, cache=cache)
    rid = env.start(waits, None)
    env.run_until_idle()
    before = list(unwound)  # without the cache, each activation's code unwinds when dropped
    assert before == ([] if cache else [rid])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        env.cancel(rid)
        env.run_until_idle()
        gc.collect()
    assert env.get(rid).status == "cancelled"
    assert unwound == [*before, rid]
    assert not [w for w in seen if "GeneratorExit" in str(w.message)]


def test_a_child_run_that_continues_as_new_answers_its_parent() -> None:
    """Defect 1: the child's new history had no parent link, so the parent's ``ctx.call``
    waited for ever (and ``status`` blamed a step 'queued or running on ?')."""
    app = App("childloop")

    @app.saga(name="child")
    async def child(ctx: SagaContext, n: int) -> int:
        if n < 2:
            ctx.continue_as_new(n + 1)
        return n

    @app.saga(name="parent")
    async def parent(ctx: SagaContext) -> int:
        return await ctx.call(child, 0)

    env = Harness(app)
    rid = env.start(parent, None)
    env.run_until_idle()
    assert env.get(rid).status == "completed"
    assert env.result(rid) == 2


def test_cancelling_the_await_of_a_child_run_cancels_the_child() -> None:
    """Defect 3: a parent that raced ``ctx.call(child)`` against a timer, cancelled the loser
    and failed sat in ``compensating`` until the child ended, then undid it. Cancelling the
    await cancels the child run; the parent does not wait for it."""
    app = App("race")
    started: list[datetime] = []

    @app.saga(name="slow")
    async def slow(ctx: SagaContext) -> str:
        await ctx.sleep(timedelta(seconds=60))
        return "slow"

    @app.saga(name="racer")
    async def racer(ctx: SagaContext) -> str:
        started.append(ctx.now())
        call = asyncio.ensure_future(ctx.call(slow, run_id="slow-child"))
        timer = asyncio.ensure_future(ctx.sleep(timedelta(seconds=1)))
        done, losers = await asyncio.wait([call, timer], return_when=asyncio.FIRST_COMPLETED)
        for loser in losers:
            loser.cancel()
        if call in done:
            return str(call.result())
        raise RuntimeError("the child was too slow")

    env = Harness(app)
    rid = env.start(racer, None)
    env.run_until_idle()
    assert env.get("slow-child").status == "cancelled"
    run = env.get(rid)
    assert run.status == "failed", run
    assert run.updated_at - started[0] < timedelta(seconds=60)


def test_the_code_of_cached_runs_unwinds_when_the_engine_is_dropped() -> None:
    """Defect 5, second half: ``Harness.restart()`` (as a process restart drops its engine)
    unwinds every cached run's code on its own loop, not in the garbage collector."""
    unwound: list[str] = []
    app, waits = _unwinding_app(unwound)
    env = Harness(app, cache=True)
    rids = [env.start(waits, None) for _ in range(3)]
    env.run_until_idle()
    assert unwound == []
    env.restart()
    gc.collect()
    assert sorted(unwound) == sorted(rids)


def test_a_stopping_service_unwinds_the_code_of_the_runs_it_kept(tmp_path: Path) -> None:
    """Defect 5 on real threads: ``Service.stop()`` unwinds the cached runs' saga code on
    its own loop once no engine thread runs."""
    unwound: list[str] = []
    app, waits = _unwinding_app(unwound)
    store = SqlStore(f"sqlite:///{tmp_path / 'stop.db'}")
    store.upgrade()
    service = Runtime(app, store, DatabaseBroker(store, poll_interval=0.02), poll=0.02).start()
    try:
        client = Client(store, app)
        rid = client.start(waits, None)
        eventually(lambda: client.get(rid).status == "waiting", 60, "the run to wait")
        assert unwound == []
    finally:
        service.stop()
        store.close()
    assert unwound == [rid]


def test_a_saga_runner_runs_the_next_turn_with_the_last_agent_of_the_previous() -> None:
    """Defect 4: the OpenAI Agents SDK's multi-turn idiom, ``runner.run(result.last_agent,
    result.to_input_list() + [new message])``, was refused ("agent 'billing' is not one of
    this SagaRunner's"): ``last_agent`` is the durable copy the runner made."""
    from agents import Agent, handoff
    from agents.items import ModelResponse
    from agents.testing import ScriptedModel, assistant_message, function_call
    from agents.usage import Usage

    from sagaloop.agents.openai_agents import SagaRunner

    def reply(item: Any) -> ModelResponse:
        used = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
        return ModelResponse(output=[item], usage=used, response_id=None)

    triage_model = ScriptedModel([reply(function_call("transfer_to_billing", {}, call_id="h1"))])
    billing_model = ScriptedModel(
        [reply(assistant_message("which order?")), reply(assistant_message("refunded #7"))]
    )
    app = App("turns")
    billing: Agent[Any] = Agent(name="billing", model=billing_model)
    triage: Agent[Any] = Agent(name="triage", model=triage_model, handoffs=[handoff(billing)])
    runner = SagaRunner(app, triage)

    @app.saga(name="chat")
    async def chat(ctx: SagaContext, prompt: str) -> list[str]:
        first = await runner.run(triage, prompt)
        turn = [*first.to_input_list(), {"role": "user", "content": "order #7"}]
        second = await runner.run(first.last_agent, turn)
        return [first.last_agent.name, str(first.final_output), str(second.final_output)]

    env = Harness(app)
    rid = env.start(chat, "refund please")
    env.run_until_idle()
    assert env.result(rid) == ["billing", "which order?", "refunded #7"]
    billing_model.assert_complete()
