"""Cancellation delivered into saga code (issue 25, item 13): a cancel raises
``asyncio.CancelledError`` at the saga's pending await, so that its ``finally``/``except`` runs
and may call cleanup steps within the saga's ``cancel_grace``; the run is ``cancelling`` while
it does, then ends ``cancelled`` with its completed steps compensated, as before."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from sagaloop import (
    App,
    Concurrency,
    DeclarationError,
    NonDeterminismError,
    RetryPolicy,
    SagaContext,
    SagaFailedError,
    StepContext,
)
from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.sagas.app import DEFAULT_CANCEL_GRACE
from sagaloop.testing import Harness
from sagaloop.testing.histories import replay

app = App("cancel-cleanup")
seen: list[str] = []


@app.step()
def work(ctx: StepContext, what: str) -> str:
    seen.append(f"work {what}")
    return what


@work.compensation
def undo_work(ctx: StepContext, result: str, what: str) -> None:
    seen.append(f"undo {what}")


@app.step()
def cleanup(ctx: StepContext, what: str) -> None:
    seen.append(f"cleanup {what}")


@app.saga(name="finally-cleans")
async def finally_cleans(ctx: SagaContext) -> None:
    await ctx.call(work, "a")
    try:
        await ctx.sleep(timedelta(hours=1))
        seen.append("never: slept")
    finally:
        await ctx.call(cleanup, "after sleep")


@app.saga(name="except-reraises")
async def except_reraises(ctx: SagaContext) -> None:
    await ctx.call(work, "b")
    try:
        await ctx.wait_for_event("go")
    except asyncio.CancelledError:
        await ctx.call(cleanup, "after wait")
        raise


@app.saga(name="swallows")
async def swallows(ctx: SagaContext) -> str:
    await ctx.call(work, "c")
    try:
        await ctx.wait_for_event("go")
    except asyncio.CancelledError:
        await ctx.call(cleanup, "swallowed")
    return "done anyway"


@app.saga(name="slow-cleanup", cancel_grace=timedelta(seconds=30))
async def slow_cleanup(ctx: SagaContext) -> None:
    await ctx.call(work, "d")
    try:
        await ctx.wait_for_event("go")
    finally:
        await ctx.wait_for_event("cleaned")  # the cleanup waits longer than the grace
        await ctx.call(cleanup, "too late")


@app.saga(name="no-grace", cancel_grace=0)
async def no_grace(ctx: SagaContext) -> None:
    await ctx.call(work, "e")
    try:
        await ctx.wait_for_event("go")
    finally:
        seen.append("finally of no-grace")
        await ctx.call(cleanup, "never recorded")


@app.saga(name="in-a-step")
async def in_a_step(ctx: SagaContext) -> None:
    try:
        await ctx.call(work, "f")
        seen.append("never: after the step")
    finally:
        await ctx.call(cleanup, "after step")


@app.saga(name="sleeping-child")
async def sleeping_child(ctx: SagaContext) -> None:
    try:
        await ctx.wait_for_event("wake")
    finally:
        await ctx.call(cleanup, "in child")


@app.saga(name="awaits-child")
async def awaits_child(ctx: SagaContext) -> None:
    try:
        await ctx.call(sleeping_child, None)
    finally:
        await ctx.call(cleanup, "in parent")


@app.saga(name="asks-approval")
async def asks_approval(ctx: SagaContext) -> bool:
    try:
        return (await ctx.approval("refund", {"cents": 5})).approved
    except asyncio.CancelledError:
        await ctx.call(cleanup, "no refund")
        raise


@app.step(
    retry=RetryPolicy(
        max_attempts=5, initial_interval=timedelta(hours=1), maximum_interval=timedelta(hours=1)
    )
)
def flaky(ctx: StepContext) -> None:
    seen.append(f"flaky attempt {ctx.attempt}")
    raise ConnectionError("the service is down")


@app.saga(name="retrying")
async def retrying(ctx: SagaContext) -> None:
    try:
        await ctx.call(flaky)
    finally:
        await ctx.call(cleanup, "after flaky")


@app.step()
def beating_cleanup(ctx: StepContext) -> None:
    for _ in range(3):
        ctx.heartbeat()  # the run is cancelling, but this step is awaited: it goes on
    seen.append("beating cleanup done")


@app.step()
def beating_work(ctx: StepContext) -> None:
    seen.append("beating work started")
    env = harness_of_test[0]
    env.cancel(ctx.run_id)  # taken at once: the run is cancelling while this step runs
    ctx.heartbeat()  # the code no longer awaits this step: StepCancelled
    seen.append("never: beating work went on")


harness_of_test: list[Harness] = []


@app.saga(name="beats")
async def beats(ctx: SagaContext) -> None:
    try:
        await ctx.call(beating_work)
    finally:
        await ctx.call(beating_cleanup)


@pytest.fixture(autouse=True)
def _clear() -> None:
    seen.clear()


def kinds(env: Harness, run_id: str) -> list[str]:
    return [e.kind for e in env.history(run_id)]


def assert_cancelled(env: Harness, run_id: str) -> None:
    assert env.get(run_id).status == s.CANCELLED
    with pytest.raises(SagaFailedError) as err:
        env.result(run_id)
    assert err.value.status == s.CANCELLED


def test_the_default_grace_is_five_minutes_and_a_negative_one_is_refused() -> None:
    assert DEFAULT_CANCEL_GRACE.total_seconds() == 300
    assert finally_cleans.cancel_grace == DEFAULT_CANCEL_GRACE
    assert slow_cleanup.cancel_grace == timedelta(seconds=30)
    assert no_grace.cancel_grace == timedelta(0)
    other = App("grace-checks")
    with pytest.raises(DeclarationError, match="must not be negative"):
        other.saga(name="neg", cancel_grace=-1)(finally_cleans.fn)
    with pytest.raises(DeclarationError, match="timedelta or seconds"):
        other.saga(name="text", cancel_grace="5m")(finally_cleans.fn)  # type: ignore[arg-type]
    assert other.saga(name="secs", cancel_grace=2.5)(finally_cleans.fn).cancel_grace == (
        timedelta(seconds=2.5)
    )


def test_a_finally_block_runs_a_cleanup_step_then_the_run_is_cancelled_and_compensated() -> None:
    env = Harness(app)
    run_id = env.start(finally_cleans)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == s.WAITING
    env.cancel(run_id, "changed my mind")
    env.run_until_idle(skip_time=False)
    assert_cancelled(env, run_id)
    assert seen == ["work a", "cleanup after sleep", "undo a"]
    history = kinds(env, run_id)
    delivered = history.index(h.CANCEL_DELIVERED)
    assert h.STEP_SCHEDULED in history[delivered:]  # the cleanup, after the cancel
    assert history.index(h.CANCEL_REQUESTED) > delivered
    assert h.CANCEL_GRACE_EXPIRED not in history
    assert env.get(run_id).error is None  # the code let the cancel out: nothing else failed


def test_except_cancelled_error_runs_cleanup_and_re_raises() -> None:
    env = Harness(app)
    run_id = env.start(except_reraises)
    env.run_until_idle()
    env.cancel(run_id)
    env.run_until_idle()
    assert_cancelled(env, run_id)
    assert seen == ["work b", "cleanup after wait", "undo b"]


def test_code_that_swallows_the_cancel_still_ends_cancelled_and_compensated() -> None:
    env = Harness(app)
    run_id = env.start(swallows)
    env.run_until_idle()
    env.cancel(run_id)
    env.run_until_idle()
    assert_cancelled(env, run_id)
    assert seen == ["work c", "cleanup swallowed", "undo c"]
    assert env.get(run_id).output == "done anyway"  # recorded, but the cancel wins
    history = kinds(env, run_id)
    assert history.index(h.SAGA_FINISHED) < history.index(h.CANCEL_REQUESTED)


def test_the_run_is_cancelling_while_its_code_cleans_up_and_a_second_cancel_changes_nothing() -> (
    None
):
    env = Harness(app)
    run_id = env.start(slow_cleanup)
    env.run_until_idle()
    env.cancel(run_id, "first")
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == s.CANCELLING
    assert env.status(run_id).status == s.CANCELLING
    env.cancel(run_id, "second")
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == s.CANCELLING
    assert kinds(env, run_id).count(h.CANCEL_DELIVERED) == 1
    env.send_event(run_id, "cleaned")
    env.run_until_idle(skip_time=False)
    assert_cancelled(env, run_id)
    assert seen == ["work d", "cleanup too late", "undo d"]
    cancel = next(e for e in env.history(run_id) if e.kind == h.CANCEL_REQUESTED)
    assert cancel.data["reason"] == "first"


def test_cleanup_that_outlasts_the_grace_is_stopped_and_the_run_cancelled() -> None:
    env = Harness(app)
    run_id = env.start(slow_cleanup)
    env.run_until_idle()
    start = env.clock.now()
    env.cancel(run_id)
    env.run_until_idle()  # skips time: the grace timer fires
    assert_cancelled(env, run_id)
    assert seen == ["work d", "undo d"]  # the cleanup step never ran
    events = env.history(run_id)
    expired = next(e for e in events if e.kind == h.CANCEL_GRACE_EXPIRED)
    assert expired.at - start >= timedelta(seconds=30)
    assert events[events.index(expired) + 1].kind == h.CANCEL_REQUESTED


def test_a_grace_of_zero_keeps_the_old_behaviour() -> None:
    env = Harness(app)
    run_id = env.start(no_grace)
    env.run_until_idle()
    env.cancel(run_id)
    env.run_until_idle()
    assert_cancelled(env, run_id)
    assert seen[0] == "work e" and seen[-1] == "undo e"
    assert "cleanup never recorded" not in seen
    history = kinds(env, run_id)
    assert h.CANCEL_DELIVERED not in history
    after = history[history.index(h.CANCEL_REQUESTED) :]
    assert h.STEP_SCHEDULED not in after
    assert h.EVENT_WAITING in history


def test_cancel_while_a_step_runs_abandons_it_and_compensates_it_once_it_completes() -> None:
    env = Harness(app)
    run_id = env.start(in_a_step)
    env.step_once()  # the start: the step is queued, not run yet
    env.cancel(run_id)
    env.run_until_idle()
    assert_cancelled(env, run_id)
    assert "never: after the step" not in seen
    assert sorted(seen[:2]) == ["cleanup after step", "work f"]
    assert seen[2:] == ["undo f"]  # the abandoned step completed: it is undone
    delivered = next(e for e in env.history(run_id) if e.kind == h.CANCEL_DELIVERED)
    assert delivered.data["steps"] == [0]


def test_cancel_of_a_run_awaiting_a_child_cancels_the_child_and_both_clean_up() -> None:
    env = Harness(app)
    parent = env.start(awaits_child)
    env.run_until_idle()
    child = next(e for e in env.history(parent) if e.kind == h.CHILD_STARTED).data["run_id"]
    assert env.get(child).status == s.WAITING
    env.cancel(parent)
    env.run_until_idle()
    assert_cancelled(env, parent)
    assert env.get(child).status == s.CANCELLED
    assert sorted(seen) == ["cleanup in child", "cleanup in parent"]
    assert h.CHILD_CANCEL_REQUESTED in kinds(env, parent)


def test_a_queued_run_has_no_code_to_clean_up_and_is_cancelled_at_once() -> None:
    queued_app = App("cancel-queued")

    @queued_app.saga(name="one-at-a-time", concurrency=Concurrency(limit=1))
    async def one_at_a_time(ctx: SagaContext) -> None:
        await ctx.wait_for_event("go")

    env = Harness(queued_app)
    first = env.start(one_at_a_time)
    second = env.start(one_at_a_time)
    env.run_until_idle()
    env.cancel(second)
    env.run_until_idle()
    assert env.get(second).status == s.CANCELLED
    assert env.get(first).status == s.WAITING


def test_a_replay_raises_the_cancel_at_the_same_point() -> None:
    env = Harness(app)  # the harness replays the history on every activation
    run_id = env.start(except_reraises)
    env.run_until_idle()
    env.cancel(run_id)
    env.run_until_idle()
    assert_cancelled(env, run_id)
    history = env.history(run_id)
    replay(app, history, run_id=run_id)  # the recorded path: no divergence

    changed = App(app.name)
    changed_work = changed.step(name="work")(work.fn)
    changed.step(name="cleanup")(cleanup.fn)
    other = changed.step(name="other")(cleanup.fn)

    @changed.saga(name="except-reraises")
    async def other_cleanup(ctx: SagaContext) -> None:
        await ctx.call(changed_work, "b")
        try:
            await ctx.wait_for_event("go")
        except asyncio.CancelledError:
            await ctx.call(other, "elsewhere")
            raise

    with pytest.raises(NonDeterminismError, match="position 2"):
        replay(changed, history, run_id=run_id)


def test_an_engine_restart_during_the_cleanup_replays_it_and_the_cleanup_runs_once() -> None:
    env = Harness(app, cache=True)
    run_id = env.start(slow_cleanup)
    env.run_until_idle()
    env.cancel(run_id)
    env.run_until_idle(skip_time=False)
    assert env.get(run_id).status == s.CANCELLING
    env.restart()
    env.send_event(run_id, "cleaned")
    env.run_until_idle(skip_time=False)
    assert_cancelled(env, run_id)
    assert seen == ["work d", "cleanup too late", "undo d"]


def test_cancel_of_a_run_awaiting_an_approval_withdraws_it_and_cleans_up() -> None:
    env = Harness(app)
    run_id = env.start(asks_approval)
    env.run_until_idle()
    assert [p.run_id for p in env.approvals()] == [run_id]
    env.cancel(run_id)
    env.step_once()  # the cancel only: the run is cancelling, its cleanup step queued
    assert env.get(run_id).status == s.CANCELLING
    assert env.approvals() == []  # nobody is asked what the code no longer waits for
    env.run_until_idle()
    assert_cancelled(env, run_id)
    assert seen == ["cleanup no refund"]


def test_status_says_why_a_run_is_cancelling() -> None:
    env = Harness(app)
    run_id = env.start(slow_cleanup)
    env.run_until_idle()
    env.cancel(run_id, "user left")
    env.run_until_idle(skip_time=False)
    timeline = env.status(run_id)
    assert timeline.status == s.CANCELLING
    assert timeline.cancel_reason == "user left"
    assert any(
        "cancelling (user left): its saga code cleans up until" in w for w in timeline.waiting_for
    )


def test_a_step_waiting_to_retry_when_the_cancel_arrives_gets_no_new_attempt() -> None:
    env = Harness(app)
    run_id = env.start(retrying)
    env.run_until_idle(skip_time=False)
    assert seen == ["flaky attempt 1"]  # its retry is an hour away
    env.cancel(run_id)
    env.run_until_idle()  # skips time: no retry timer starts an attempt
    assert_cancelled(env, run_id)
    assert seen == ["flaky attempt 1", "cleanup after flaky"]
    history = kinds(env, run_id)
    assert history[history.index(h.CANCEL_DELIVERED) + 1] == h.STEP_FAILED
    assert h.STEP_DISPATCHED not in history


def test_a_run_whose_slot_another_run_takes_is_cancelled_without_its_grace() -> None:
    taken_app = App("cancel-taken")
    tidied: list[str] = []

    @taken_app.step()
    def tidy(ctx: StepContext) -> None:
        tidied.append("tidy")

    @taken_app.saga(
        name="latest-wins", concurrency=Concurrency(limit=1, at_limit="cancel_in_progress")
    )
    async def latest_wins(ctx: SagaContext) -> None:
        try:
            await ctx.wait_for_event("go")
        finally:
            await ctx.call(tidy)  # would run beside the new run's code: not run

    env = Harness(taken_app)
    first = env.start(latest_wins)
    env.run_until_idle()
    second = env.start(latest_wins)
    env.run_until_idle()
    assert env.get(first).status == s.CANCELLED
    assert env.get(second).status == s.WAITING
    assert h.CANCEL_DELIVERED not in kinds(env, first)
    assert tidied == []


def test_the_heartbeat_stops_the_abandoned_step_and_not_the_cleanup_step() -> None:
    env = Harness(app)
    harness_of_test[:] = [env]
    run_id = env.start(beats)
    env.run_until_idle()
    assert_cancelled(env, run_id)
    assert seen == ["beating work started", "beating cleanup done"]
    failed = [e for e in env.history(run_id) if e.kind == h.STEP_FAILED]
    assert [e.data["error"]["type"] for e in failed] == ["StepCancelled"]


def test_a_cancel_now_skips_the_cleanup_and_cuts_a_running_one_short() -> None:
    env = Harness(app)
    fresh = env.start(except_reraises)
    env.run_until_idle()
    env.cancel(fresh, "at once", now=True)
    env.run_until_idle()
    assert_cancelled(env, fresh)
    assert h.CANCEL_DELIVERED not in kinds(env, fresh)
    assert "cleanup after wait" not in seen

    seen.clear()
    slow = env.start(slow_cleanup)
    env.run_until_idle()
    env.cancel(slow, "politely")
    env.run_until_idle(skip_time=False)
    assert env.get(slow).status == s.CANCELLING  # its cleanup waits for 'cleaned'
    env.cancel(slow, "enough", now=True)
    env.run_until_idle(skip_time=False)
    assert_cancelled(env, slow)
    assert seen == ["work d", "undo d"]
    history = kinds(env, slow)
    assert history.count(h.CANCEL_REQUESTED) == 1 and h.CANCEL_GRACE_EXPIRED not in history
    cancel = next(e for e in env.history(slow) if e.kind == h.CANCEL_REQUESTED)
    assert cancel.data["reason"] == "enough"
