"""asyncio's timers in saga code are durable timers: ``asyncio.sleep(seconds)`` is
``ctx.sleep`` (a ``timer_started`` command, a timer in the store, ``timer_fired`` when it is
due), and ``asyncio.wait_for``, ``asyncio.timeout`` and ``asyncio.wait(timeout=)`` race one,
as Temporal's workflow sandbox makes them. Every replay takes the same branch: which of the
timer and the awaited result came first is the order of their events in the history."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.engine.messages import engine_queue
from sagaloop.errors import SagaDeterminismViolation
from sagaloop.testing import Harness, replay

app = App("asyncio-timers")


@app.step()
def work(ctx: StepContext, n: int) -> int:
    return n * 10


@app.saga(name="naps")
async def naps(ctx: SagaContext, seconds: float) -> list[str]:
    began = ctx.now()
    await asyncio.sleep(seconds)
    slept = ctx.now() - began
    await asyncio.sleep(0)  # yields, records nothing
    return [str(slept), str(await ctx.call(work, 1))]


@app.saga(name="patient")
async def patient(ctx: SagaContext, timeout: float) -> str:
    try:
        data = await asyncio.wait_for(ctx.wait_for_event("answer"), timeout=timeout)
    except TimeoutError:
        return "timed out"
    return f"answered {data}"


@app.saga(name="scoped")
async def scoped(ctx: SagaContext) -> str:
    try:
        async with asyncio.timeout(60):
            await ctx.wait_for_event("answer")
    except TimeoutError:
        late = await ctx.wait_for_event("answer")  # the event that came late is still taken
        return f"late: {late}"
    return "in time"


@app.saga(name="racing")
async def racing(ctx: SagaContext) -> str:
    call = asyncio.ensure_future(ctx.call(work, 2))
    done, _ = await asyncio.wait([call], timeout=30)
    return f"step {call.result()}" if done else "step still running"


@pytest.fixture(params=[False, True], ids=["replay", "cache"])
def env(request: pytest.FixtureRequest) -> Harness:
    return Harness(app, cache=request.param)


def timers(env: Harness, run_id: str) -> list[tuple[str, int | None]]:
    kinds = (h.TIMER_STARTED, h.TIMER_FIRED)
    return [(e.kind, e.pos) for e in env.history(run_id) if e.kind in kinds]


def test_asyncio_sleep_is_a_durable_timer(env: Harness) -> None:
    run_id = env.start(naps, 90.5)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == "waiting"
    assert any("sleeping until" in line for line in env.status(run_id).waiting_for)
    env.restart()  # nothing of the run is in memory: the timer is in the store
    env.run_until_idle()  # the clock skips to the timer
    assert env.result(run_id) == ["0:01:30.500000", "10"]
    assert timers(env, run_id) == [(h.TIMER_STARTED, 0), (h.TIMER_FIRED, 0)]
    replay(app, env.history(run_id), run_id=run_id)


def test_wait_for_returns_what_came_before_its_timer(env: Harness) -> None:
    run_id = env.start(patient, 60.0)
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, "answer", "yes")
    env.run_until_idle()
    assert env.result(run_id) == "answered yes"
    replay(app, env.history(run_id), run_id=run_id)


def test_wait_for_raises_timeout_error_when_its_timer_fires_first(env: Harness) -> None:
    run_id = env.start(patient, 60.0)
    env.run_until_idle()  # nothing arrives: the clock skips to the timer
    assert env.result(run_id) == "timed out"
    (started, at), (fired, fired_at) = timers(env, run_id)
    assert (started, fired) == (h.TIMER_STARTED, h.TIMER_FIRED) and at == fired_at
    replay(app, env.history(run_id), run_id=run_id)


def test_the_timer_of_a_timeout_block_races_the_wait_and_a_late_event_is_kept(
    env: Harness,
) -> None:
    run_id = env.start(scoped)
    env.run_until_idle()  # the timeout fires first
    env.send_event(run_id, "answer", "late")
    env.run_until_idle()
    assert env.result(run_id) == "late: late"
    replay(app, env.history(run_id), run_id=run_id)


def test_wait_with_a_timeout_returns_at_the_first_of_the_two(env: Harness) -> None:
    run_id = env.start(racing)
    env.run_until_idle()
    assert env.result(run_id) == "step 20"
    slow = env.start(racing, run_id="slow")
    env.queues = [engine_queue(app.name)]  # the step is never taken: the timer wins
    env.run_until_idle()
    assert env.result(slow) == "step still running"
    replay(app, env.history(slow), run_id=slow)


def test_threads_and_executors_are_still_refused() -> None:
    refused = App("refused")

    @refused.saga(name="executor")
    async def executor(ctx: SagaContext) -> None:
        await asyncio.get_running_loop().run_in_executor(None, print)

    @refused.saga(name="threadsafe")
    async def threadsafe(ctx: SagaContext) -> None:
        asyncio.get_running_loop().call_soon_threadsafe(print)

    env = Harness(refused)
    for saga in (executor, threadsafe):
        run_id = env.start(saga)
        env.run_until_idle()
        run = env.get(run_id)
        assert run.status == "failed"
        assert run.error is not None
        assert run.error["type"] == SagaDeterminismViolation.__name__


def test_a_durable_sleep_is_at_least_as_long_as_asked() -> None:
    env = Harness(app)
    run_id = env.start(naps, 0.001)
    env.run_until_idle()
    slept = env.result(run_id)[0]
    assert timedelta(microseconds=1000) <= timedelta(seconds=float(slept.rsplit(":", 1)[1]))


def test_a_timer_the_code_stopped_waiting_for_is_recorded_cancelled_and_fires_for_nothing(
    env: Harness,
) -> None:
    """The event came first: the timer of ``wait_for`` is cancelled (``timer_cancelled``), the
    run no longer says it sleeps, and its row is deleted with the record: nothing fires."""
    run_id = env.start(patient_then_waits, 60.0)
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, "answer", "yes")
    env.run_until_idle(skip_time=False)
    kinds = [e.kind for e in env.history(run_id)]
    assert h.TIMER_CANCELLED in kinds
    assert not any("sleeping" in line for line in env.status(run_id).waiting_for)
    assert env.store.next_timer_at() is None  # its row is gone: it never fires
    before = len(env.history(run_id))
    env.advance(timedelta(minutes=2))
    env.run_until_idle(skip_time=False)
    assert len(env.history(run_id)) == before
    env.send_event(run_id, "done")
    env.run_until_idle()
    assert env.result(run_id) == "answered yes"
    replay(app, env.history(run_id), run_id=run_id)


def test_a_condition_met_before_its_timeout_no_longer_says_it_sleeps(env: Harness) -> None:
    """Before: ``wait_condition(fn, timeout=)`` met first left "sleeping until ..." in the
    run's status until its timer fired."""
    run_id = env.start(condition_then_waits)
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, "flag")
    env.run_until_idle(skip_time=False)
    assert not any("sleeping" in line for line in env.status(run_id).waiting_for)
    env.send_event(run_id, "done")
    env.run_until_idle()
    assert env.result(run_id) == "met"


@app.saga(name="patient-then-waits")
async def patient_then_waits(ctx: SagaContext, timeout: float) -> str:
    data = await asyncio.wait_for(ctx.wait_for_event("answer"), timeout=timeout)
    await ctx.wait_for_event("done")
    return f"answered {data}"


@app.saga(name="condition-then-waits")
async def condition_then_waits(ctx: SagaContext) -> str:
    flags: list[object] = []
    ctx.on_event("flag", flags.append)
    await ctx.wait_condition(lambda: bool(flags), timeout=timedelta(hours=1))
    await ctx.wait_for_event("done")
    return "met"
