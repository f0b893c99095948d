"""Small primitives that workflows ported from other engines need (issue 25): published values
that survive ``continue_as_new``, the failed step's error type as a field of the run's error, a
timeout on a child call, ``ctx.deprecate_patch`` and ``ctx.started_by``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from sagaloop import App, RetryPolicy, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.engine.replay import check_replay
from sagaloop.engine.replay import started_by as replay_started_by
from sagaloop.errors import (
    ApplicationError,
    ChildTimeoutError,
    ErrorInfo,
    NonDeterminismError,
    SagaFailedError,
    StepFailedError,
    ValidationError,
)
from sagaloop.testing import Harness

# --- published values survive continue_as_new ----------------------------------------------------

carried = App("carried")


@carried.saga(name="counter")
async def counter(ctx: SagaContext, n: int) -> int:
    if n == 0:
        ctx.publish("first", "from the first history")
    ctx.publish("n", n)
    if n < 2:
        ctx.continue_as_new(n + 1)
    await ctx.wait_for_event("stop")
    ctx.publish("first", "overwritten")
    return n


def test_published_values_survive_continue_as_new_until_overwritten() -> None:
    env = Harness(carried)
    run_id = env.start(counter, 0)
    env.run_until_idle()
    history = env.history(run_id)
    assert history[0].kind == h.RUN_STARTED and history[0].data["epoch"] == 2
    assert not any(e.kind == h.PUBLISHED and e.name == "first" for e in history)
    assert env.client.get_published(run_id, "first") == "from the first history"
    assert env.client.get_published(run_id, "n") == 2
    assert env.status(run_id).published == {"first": "from the first history", "n": 2}
    env.restart()  # folded from the stored history alone
    assert env.client.get_published(run_id, "first") == "from the first history"
    env.send_event(run_id, "stop")
    env.run_until_idle()
    assert env.result(run_id) == 2
    assert env.client.get_published(run_id, "first") == "overwritten"


# --- the failed step's or child's error as fields of the run's error -----------------------------

failing = App("failing")


class OrderFailed(Exception):
    pass


@failing.step(retry=RetryPolicy(max_attempts=1))
def charge(ctx: StepContext, amount: int) -> int:
    raise ApplicationError(f"card declined for {amount}", type="CardDeclined", non_retryable=True)


@failing.saga(name="pay")
async def pay(ctx: SagaContext, amount: int) -> int:
    try:
        return await ctx.call(charge, amount)
    except StepFailedError as e:
        ctx.publish("seen", [e.step, e.cause_type, e.cause_message])
        if amount > 100:
            raise OrderFailed("the order could not be paid") from e
        raise


@failing.saga(name="checkout")
async def checkout(ctx: SagaContext, amount: int) -> int:
    return await ctx.call(pay, amount)


def test_the_run_error_names_the_failed_step_and_its_error_type() -> None:
    env = Harness(failing)
    run_id = env.start(pay, 5)
    env.run_until_idle()
    assert env.client.get_published(run_id, "seen") == [
        "charge",
        "CardDeclined",
        "card declined for 5",
    ]
    with pytest.raises(SagaFailedError) as raised:
        env.result(run_id)
    error = raised.value.error
    assert error is not None and error.type == "StepFailedError"
    assert error.step == "charge"
    assert error.cause is not None and error.cause.type == "CardDeclined"
    assert error.cause.message == "card declined for 5" and error.cause.non_retryable
    assert error.cause.traceback is None  # the step's own is in its step_failed event
    assert error.root_cause is error.cause
    stored = env.get(run_id).error
    assert stored is not None and stored["cause"]["type"] == "CardDeclined"


def test_an_error_raised_from_the_step_failure_keeps_it_as_its_cause() -> None:
    env = Harness(failing)
    run_id = env.start(pay, 500)
    env.run_until_idle()
    with pytest.raises(SagaFailedError) as raised:
        env.result(run_id)
    error = raised.value.error
    assert error is not None and error.type == "OrderFailed"
    assert error.step == "charge" and error.cause is not None
    assert error.cause.type == "CardDeclined"


def test_a_failed_child_run_chains_its_own_error_down_to_the_step() -> None:
    env = Harness(failing)
    run_id = env.start(checkout, 5)
    env.run_until_idle()
    with pytest.raises(SagaFailedError) as raised:
        env.result(run_id)
    error = raised.value.error
    assert error is not None and error.step == "pay"
    assert error.cause is not None and error.cause.type == "StepFailedError"  # the child's
    assert error.cause.step == "charge"
    assert error.root_cause.type == "CardDeclined"
    assert ErrorInfo.from_json(error.to_json()).root_cause.type == "CardDeclined"


# --- a timeout on await ctx.call(child) -----------------------------------------------------------

timed = App("timed")
child_undone: list[str] = []


@timed.step()
def book(ctx: StepContext, what: str) -> str:
    return f"booked {what}"


@book.compensation
def unbook(ctx: StepContext, what: str, booked: str) -> None:
    child_undone.append(what)


@timed.saga(name="supplier")
async def supplier(ctx: SagaContext, minutes: int) -> str:
    booked = await ctx.call(book, f"after {minutes} min")
    await ctx.sleep(timedelta(minutes=minutes))
    return booked


@timed.saga(name="buyer")
async def buyer(ctx: SagaContext, minutes: int) -> str:
    try:
        got = await ctx.call(supplier, minutes, run_id=f"supplier-{minutes}", timeout=MINUTE * 10)
    except TimeoutError as e:  # ChildTimeoutError
        assert isinstance(e, ChildTimeoutError) and e.run_id == f"supplier-{minutes}"
        return f"gave up at {ctx.now():%H:%M}"
    await ctx.sleep(timedelta(hours=1))  # the timer the child beat fires meanwhile
    return got


MINUTE = timedelta(minutes=1)


def test_a_child_slower_than_the_timeout_is_cancelled_and_the_call_raises() -> None:
    child_undone.clear()
    env = Harness(timed)
    start = env.clock.now()
    run_id = env.start(buyer, 60)
    env.run_until_idle()
    assert env.result(run_id) == f"gave up at {start + MINUTE * 10:%H:%M}"
    child = env.get("supplier-60")
    assert child.status == "cancelled"  # and compensated, as a cancelled run is
    assert child_undone == ["after 60 min"]
    kinds = [(e.kind, e.name) for e in env.history(run_id) if e.pos is not None]
    assert kinds[:3] == [
        (h.CHILD_STARTED, "supplier"),
        (h.TIMER_STARTED, "call_timeout"),
        (h.TIMER_FIRED, None),
    ]
    assert (h.CHILD_CANCEL_REQUESTED, "supplier") in kinds
    check_replay(timed, buyer, run_id, env.history(run_id), whole=True)


def test_a_child_faster_than_the_timeout_returns_its_output_and_the_timer_is_ignored() -> None:
    child_undone.clear()
    env = Harness(timed)
    run_id = env.start(buyer, 2)
    env.run_until_idle()
    assert env.result(run_id) == "booked after 2 min"
    assert env.get("supplier-2").status == "completed" and child_undone == []
    history = env.history(run_id)
    timer = next(e for e in history if e.kind == h.TIMER_STARTED and e.name == "call_timeout")
    assert timer.data["child"] == 0
    assert not [e for e in history if e.kind == h.TIMER_FIRED and e.pos == timer.pos]  # moot
    check_replay(timed, buyer, run_id, env.history(run_id), whole=True)


def test_the_timeout_replays_across_restarts() -> None:
    env = Harness(timed)
    run_id = env.start(buyer, 60)
    while env.step_once() or env.store.next_timer_at(app=timed.name) is not None:
        env.restart()  # nothing in memory between messages
        if not env.step_once():
            at = env.store.next_timer_at(app=timed.name)
            if at is None:
                break
            env.clock.set(at)
    assert env.get(run_id).status == "completed", env.status(run_id).to_json()
    assert env.get("supplier-60").status == "cancelled"


def test_a_bad_timeout_is_refused_before_anything_is_recorded() -> None:
    bad = App("bad_timeout")

    @bad.saga(name="inner")
    async def inner(ctx: SagaContext) -> None:
        return None

    @bad.saga(name="outer")
    async def outer(ctx: SagaContext, timeout: Any) -> str:
        try:
            await ctx.call(inner, timeout=timedelta(seconds=timeout) if timeout else "soon")
        except ValidationError as e:
            return str(e)
        return "called"

    env = Harness(bad)
    for value in (0, -5, None):
        run_id = env.start(outer, value)
        env.run_until_idle()
        assert "is a positive timedelta" in env.result(run_id)
        assert not [e for e in env.history(run_id) if e.kind == h.CHILD_STARTED]


# --- ctx.deprecate_patch ------------------------------------------------------------------------


def _patching_app() -> tuple[App, dict[str, Any]]:
    """Temporal's patching sample in four stages: the old code, ``patched``, then
    ``deprecate_patch``, then neither."""
    app = App("deprecating")

    @app.step()
    def pre_patch(ctx: StepContext) -> str:
        return "pre-patch"

    @app.step()
    def post_patch(ctx: StepContext) -> str:
        return "post-patch"

    async def initial(ctx: SagaContext) -> str:
        result = await ctx.call(pre_patch)
        await ctx.wait_for_event("go")
        return result

    async def patched(ctx: SagaContext) -> str:
        if ctx.patched("my-patch"):
            result = await ctx.call(post_patch)
        else:
            result = await ctx.call(pre_patch)
        await ctx.wait_for_event("go")
        return result

    async def deprecated(ctx: SagaContext) -> str:
        ctx.deprecate_patch("my-patch")
        result = await ctx.call(post_patch)
        await ctx.wait_for_event("go")
        return result

    async def removed(ctx: SagaContext) -> str:
        result = await ctx.call(post_patch)
        await ctx.wait_for_event("go")
        return result

    stages = {"initial": initial, "patched": patched, "deprecated": deprecated, "removed": removed}
    app.saga(name="patching")(patched)
    return app, stages


def _deploy(env: Harness, app: App, fn: Any) -> None:
    app.sagas["patching"].fn = fn
    env.restart()


def test_deprecate_patch_replays_runs_that_recorded_the_marker_and_records_none() -> None:
    app, stages = _patching_app()
    env = Harness(app)
    marked = env.start("patching", run_id="marked")  # runs the `patched` stage
    env.run_until_idle(skip_time=False)
    assert [e.name for e in env.history(marked) if e.kind == h.MARKER] == ["my-patch"]

    _deploy(env, app, stages["deprecated"])
    fresh = env.start("patching", run_id="fresh")
    env.run_until_idle(skip_time=False)
    for run_id in (marked, fresh):
        env.send_event(run_id, "go")
    env.run_until_idle()
    for run_id in (marked, fresh):
        assert env.get(run_id).status == "completed", env.get(run_id)
        assert env.result(run_id) == "post-patch"
    assert not [e for e in env.history(fresh) if e.kind == h.MARKER]  # records nothing

    saga = app.sagas["patching"]
    check_replay(app, saga, marked, env.history(marked), whole=True)
    # with the deprecate_patch call gone too, what the deprecated stage recorded replays...
    saga.fn = stages["removed"]
    check_replay(app, saga, fresh, env.history(fresh), whole=True)
    # ...but a history with the marker needs the call: it is what skips the marker
    with pytest.raises(NonDeterminismError, match="patched\\('my-patch'\\) at position 0"):
        check_replay(app, saga, marked, env.history(marked), whole=True)


def test_deprecate_patch_skips_a_marker_recorded_later_in_the_code() -> None:
    app = App("deprecating_later")

    @app.step()
    def first(ctx: StepContext) -> int:
        return 1

    @app.step()
    def second(ctx: StepContext) -> int:
        return 2

    @app.saga(name="later")
    async def later(ctx: SagaContext) -> list[Any]:
        a = await ctx.call(first)
        b = await ctx.call(second) if ctx.patched("second") else 0
        c = ctx.patched("third")  # a patch still in force after the deprecated marker
        return [a, b, c]

    env = Harness(app)
    run_id = env.start(later)
    env.run_until_idle()
    assert env.result(run_id) == [1, 2, True]

    async def deprecated(ctx: SagaContext) -> list[Any]:
        ctx.deprecate_patch("second")  # at the top, as Temporal's sample does
        a = await ctx.call(first)
        b = await ctx.call(second)
        c = ctx.patched("third")
        return [a, b, c]

    app.sagas["later"].fn = deprecated
    check_replay(app, app.sagas["later"], run_id, env.history(run_id), whole=True)


def test_deprecate_patch_refuses_a_bad_change_id() -> None:
    app = App("deprecating_bad")

    @app.saga(name="bad")
    async def bad(ctx: SagaContext) -> str:
        try:
            ctx.deprecate_patch("")
        except ValidationError as e:
            return str(e)
        return "accepted"

    env = Harness(app)
    run_id = env.start(bad)
    env.run_until_idle()
    assert "change id" in env.result(run_id)


def test_a_run_still_on_the_old_path_parks_under_deprecate_patch() -> None:
    """The precondition of deprecate_patch: no run that took the old path may replay."""
    app, stages = _patching_app()
    app.sagas["patching"].fn = stages["initial"]
    env = Harness(app)
    old = env.start("patching")
    env.run_until_idle(skip_time=False)
    _deploy(env, app, stages["deprecated"])
    env.send_event(old, "go")
    env.run_until_idle()
    run = env.get(old)
    assert run.status == "needs_attention" and run.reason is not None
    assert "pre_patch" in run.reason, run.reason


# --- ctx.started_by ------------------------------------------------------------------------------

family = App("started_by")


@family.saga(name="kid")
async def kid(ctx: SagaContext, n: int) -> str | None:
    ctx.publish(f"started_by {n}", ctx.started_by)
    if n < 1:
        ctx.continue_as_new(n + 1)  # the same in every history of the chain
    return ctx.started_by


@family.saga(name="parent")
async def parent(ctx: SagaContext) -> list[str | None]:
    return [ctx.started_by, await ctx.call(kid, 0, run_id="the-kid")]


def test_started_by_is_the_parent_of_a_child_run_and_none_for_a_client_start() -> None:
    env = Harness(family)
    run_id = env.start(parent)
    env.run_until_idle()
    assert env.result(run_id) == [None, run_id]
    assert env.client.get_published("the-kid", "started_by 0") == run_id
    assert env.client.get_published("the-kid", "started_by 1") == run_id  # continued as new
    env.restart()
    check_replay(family, kid, "the-kid", env.history("the-kid"), whole=True)


def test_started_by_reads_the_starter_a_run_started_records() -> None:
    assert replay_started_by({"input": None, "started_by": "spawner"}) == "spawner"
    assert replay_started_by({"parent": {"run_id": "p", "position": 3}}) == "p"
    assert replay_started_by({"input": None}) is None


def _history_app(lengths: list[int]) -> tuple[App, Any]:
    app = App("hist-hint")

    @app.step
    def note(ctx: StepContext, n: int) -> int:
        lengths.append(n)
        return n

    @app.saga(name="grows")
    async def grows(ctx: SagaContext, rounds: int) -> list[Any]:
        for done in range(rounds):
            if ctx.continue_as_new_suggested:
                ctx.continue_as_new(rounds - done)  # the rest, in a history from 1
            await ctx.call(note, ctx.history_length)
        return [ctx.history_length, ctx.continue_as_new_suggested]

    return app, grows


@pytest.mark.parametrize("cache", [False, True])
def test_history_length_is_what_woke_the_code_and_the_same_on_replay(cache: bool) -> None:
    """Item 7: ``ctx.history_length`` (the seq of the event that woke the code) and
    ``ctx.continue_as_new_suggested``; with or without the engine's cache (every activation
    replays without it) the code sees the same lengths."""
    lengths: list[int] = []
    app, grows = _history_app(lengths)
    env = Harness(app, cache=cache)
    rid = env.start(grows, 4)
    env.run_until_idle()
    final, suggested = env.result(rid)
    assert lengths[0] == 1 and lengths == sorted(lengths) and len(set(lengths)) == 4, lengths
    assert final > lengths[-1] and suggested is False
    assert final == max(e.seq for e in env.history(rid) if e.kind == "step_completed")


def test_continue_as_new_suggested_past_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    from sagaloop.sagas import context

    monkeypatch.setattr(context, "SUGGESTED_HISTORY", 12)
    lengths: list[int] = []
    app, grows = _history_app(lengths)
    env = Harness(app)
    rid = env.start(grows, 10)
    env.run_until_idle()
    assert env.get(rid).status == "completed"
    assert len(lengths) == 10 and max(lengths) < 12, lengths
    assert lengths.count(1) == 2, "a fresh history after the hint"
