"""`await ctx.compensate()`: undo the completed steps, newest first and durably, then go on and
return a result (Temporal's trip booking answers {"status": "failure"} after undoing)."""

from __future__ import annotations

from typing import Any

from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext, StepFailedError
from sagaloop.engine import history as h
from sagaloop.testing import Harness

app = App("trip")
ledger: list[str] = []


@app.step()
def book(ctx: StepContext, what: str) -> str:
    if what == "flight-full":
        raise ApplicationError("no seats", type="SoldOut", non_retryable=True)
    ledger.append(f"book {what}")
    return f"{what}-ref"


@book.compensation
def cancel_booking(ctx: StepContext, what: str, ref: str) -> None:
    ledger.append(f"cancel {ref}")


@app.step()
def note(ctx: StepContext, text: str) -> str:  # no compensation: nothing to undo
    return text


@app.saga(name="trip")
async def trip(ctx: SagaContext, flight: str) -> dict[str, Any]:
    await ctx.call(book, "car")
    await ctx.call(note, "car booked")
    await ctx.call(book, "hotel")
    try:
        await ctx.call(book, flight)
    except StepFailedError as e:
        await ctx.compensate()
        return {"status": "failure", "reason": e.error.type}
    return {"status": "success"}


@app.saga(name="twice")
async def twice(ctx: SagaContext) -> list[str]:
    await ctx.call(book, "a")
    await ctx.compensate()  # undoes a
    await ctx.call(book, "b")
    await ctx.compensate()  # undoes b only
    await ctx.compensate()  # nothing left: goes straight on
    return ["done"]


def test_the_trip_is_undone_newest_first_and_the_saga_answers() -> None:
    ledger.clear()
    env = Harness(app)
    run_id = env.start(trip, "flight-full")
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "completed", run
    assert run.output == {"status": "failure", "reason": "SoldOut"}
    assert ledger == ["book car", "book hotel", "cancel hotel-ref", "cancel car-ref"]
    kinds = [e.kind for e in env.history(run_id)]
    assert kinds.count(h.COMPENSATION_COMPLETED) == 2 and h.COMPENSATE_DONE in kinds
    undo = [(line.step, line.compensation) for line in env.status(run_id).steps]
    assert undo == [
        ("book", "compensated"),
        ("note", None),
        ("book", "compensated"),
        ("book", None),
    ]


def test_each_compensate_undoes_only_what_is_not_undone_yet_across_restarts() -> None:
    ledger.clear()
    env = Harness(app)
    run_id = env.start(twice)
    for _ in range(40):  # one message at a time, forgetting everything in memory in between
        if not env.step_once():
            break
        env.restart()
    env.run_until_idle()
    assert env.result(run_id) == ["done"]
    assert ledger == ["book a", "cancel a-ref", "book b", "cancel b-ref"]


def test_a_successful_trip_undoes_nothing() -> None:
    ledger.clear()
    env = Harness(app)
    run_id = env.start(trip, "flight")
    env.run_until_idle()
    assert env.result(run_id) == {"status": "success"}
    assert ledger == ["book car", "book hotel", "book flight"]


failing_undo = App("failing-undo")


@failing_undo.step(retry=RetryPolicy(max_attempts=1))
def reserve(ctx: StepContext) -> str:
    return "r"


@reserve.compensation
def release(ctx: StepContext, result: str) -> None:
    if not ledger:
        raise ConnectionError("inventory down")


@failing_undo.saga(name="s")
async def s(ctx: SagaContext) -> str:
    await ctx.call(reserve)
    await ctx.compensate()
    return "finished"


def test_a_compensation_that_fails_for_good_parks_the_run_until_retry() -> None:
    ledger.clear()
    env = Harness(failing_undo)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.get(run_id).status == "needs_attention"
    ledger.append("inventory back")
    env.retry(run_id)
    env.run_until_idle()
    assert env.result(run_id) == "finished"
