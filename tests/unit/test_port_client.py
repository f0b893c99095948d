"""Client and Harness primitives that workflows ported from other engines need (issue 25):
a blocking read of a published value (``Client.wait_published``, ``Harness.wait_published``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from sagaloop import (
    App,
    Client,
    DeclarationError,
    RunFinishedError,
    RunNotFoundError,
    SagaContext,
    StepCancelled,
    StepContext,
    ValidationError,
)
from sagaloop.client import NotPublishedError, RunView, query
from sagaloop.client.polling import MAX_POLL, Pending, poll_until
from sagaloop.engine import history as h
from sagaloop.testing import Harness

app = App("port-client")


@app.saga(name="progress")
async def progress(ctx: SagaContext, steps: int) -> str:
    for n in range(1, steps + 1):
        ctx.publish("done", n)
        await ctx.sleep(timedelta(minutes=1))
    ctx.publish("done", steps)  # the same value again: not a new one
    return "finished"


# --- wait_published ------------------------------------------------------------------------------


def test_wait_published_returns_each_value_as_soon_as_the_run_publishes_it() -> None:
    env = Harness(app)
    run_id = env.start(progress, 3)
    with pytest.raises(TimeoutError, match="has not published a value under 'done'"):
        env.client.wait_published(run_id, "done", timeout=0)  # not started yet: read once, now
    assert env.wait_published(run_id, "done") == 1  # steps the harness until it is there
    with pytest.raises(TimeoutError, match=r"other than 1.*Harness\.advance"):
        env.wait_published(run_id, "done", after=1)  # only the timer is left: time must pass
    env.advance(timedelta(minutes=1))
    assert env.client.wait_published(run_id, "done", timeout=0, after=1) == 2
    assert env.client.wait_published(run_id, "done", timeout=timedelta(0)) == 2
    env.advance(timedelta(minutes=1))
    assert env.wait_published(run_id, "done", after=2) == 3


def test_wait_published_says_so_when_the_run_ended_without_publishing_it() -> None:
    env = Harness(app)
    run_id = env.start(progress, 1)
    env.run_until_idle()
    assert env.result(run_id) == "finished"
    with pytest.raises(NotPublishedError, match=r"ended \(completed\) without publishing anything"):
        env.client.wait_published(run_id, "other", timeout=None)  # no wait for ever: it ended
    with pytest.raises(RunFinishedError, match="without publishing a value other than 1"):
        env.wait_published(run_id, "done", after=1)  # published 1 again at the end: not new
    assert env.client.wait_published(run_id, "done", timeout=None) == 1  # what is there


def test_wait_published_refuses_bad_input() -> None:
    env = Harness(app)
    run_id = env.start(progress, 1)
    with pytest.raises(ValidationError, match="timeout"):
        env.client.wait_published(run_id, "done", timeout=-1)
    with pytest.raises(ValidationError, match="timeout"):
        env.client.wait_published(run_id, "done", timeout="soon")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="key"):
        env.client.wait_published(run_id, "", timeout=0)
    with pytest.raises(ValidationError, match="after"):
        env.client.wait_published(run_id, "done", timeout=0, after=float("nan"))
    with pytest.raises(RunNotFoundError):
        env.client.wait_published("no-such-run", "done", timeout=0)


def test_wait_published_wakes_a_waiting_reader_in_another_thread(tmp_path: Path) -> None:
    """The blocking form: a reader polls the store while the run, stepped on another thread,
    publishes. It returns once the value is there, not at its timeout. (A database file: each
    thread its own connection, as two processes would have.)"""
    env = Harness(app, url=f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = env.start(progress, 1)
    found: list[Any] = []
    reader = threading.Thread(
        target=lambda: found.append(env.client.wait_published(run_id, "done", timeout=60))
    )
    reader.start()
    env.run_until_idle(skip_time=False)
    reader.join(timeout=60)
    assert found == [1]


def test_the_client_waits_with_backoff_up_to_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """One polling mechanism for ``result`` and ``wait_published``: pauses double up to
    MAX_POLL and never pass the deadline (a virtual monotonic clock: no real sleep)."""
    now = [0.0]
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(round(seconds, 6))
        now[0] += seconds

    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(time, "sleep", sleep)
    with pytest.raises(TimeoutError, match="still waiting after 2 s"):
        poll_until(lambda: Pending("still waiting"), timeout=2, poll=0.05)
    assert pauses[:4] == [0.05, 0.1, 0.2, 0.4]
    assert max(pauses) == MAX_POLL
    assert sum(pauses) == pytest.approx(2)
    reads = iter([Pending("x"), Pending("x"), "there"])
    assert poll_until(lambda: next(reads), timeout=None) == "there"


# --- queries -------------------------------------------------------------------------------------


CART_RUNS = [0]


@app.saga(name="cart")
async def cart(ctx: SagaContext, owner: str) -> list[str]:
    CART_RUNS[0] += 1  # each time saga code runs (replays included)
    items: list[str] = []
    while True:
        item = await ctx.wait_for_event("add")
        if item == "checkout":
            return items
        items.append(item)
        ctx.publish("items", items)


@query(cart)
def count(run: RunView, prefix: str = "") -> int:
    """How many items (starting with ``prefix``) the cart holds."""
    return sum(1 for item in run.published.get("items", []) if item.startswith(prefix))


@query(cart, name="summary")
def cart_summary(run: RunView, top: int) -> dict[str, Any]:
    events = [e.data.get("name") for e in run.history if e.kind == "event_arrived"]
    return {
        "owner": run.input,
        "status": run.status,
        "first": run.published.get("items", [])[:top],
        "events": len(events),
    }


def test_a_query_is_computed_on_demand_with_arguments_over_what_the_run_recorded() -> None:
    env = Harness(app)
    run_id = env.start(cart, "ada")
    env.run_until_idle()
    assert env.client.query(run_id, count) == 0
    for item in ["apple", "avocado", "bread"]:
        env.send_event(run_id, "add", item)
    env.run_until_idle()
    seen = len(env.history(run_id))
    assert env.client.query(run_id, count) == 3
    assert env.client.query(run_id, count, "a") == 2
    assert env.query(run_id, "count", prefix="b") == 1  # by name, keyword arguments
    assert env.query(run_id, "summary", "2")["first"] == ["apple", "avocado"]  # converted
    assert env.client.query(run_id, cart_summary, top=1)["owner"] == "ada"
    assert len(env.history(run_id)) == seen  # a query records nothing
    env.restart()  # no engine state involved: the store is read
    env.send_event(run_id, "add", "checkout")
    env.run_until_idle()
    assert env.result(run_id) == ["apple", "avocado", "bread"]
    assert env.query(run_id, "summary", 9)["status"] == "completed"  # a finished run too
    view = RunView("r", "cart", "running", "ada", None, None, {"items": ["bun"]}, ())
    assert count(view, "b") == 1  # a declared query is a plain function too


def test_a_query_runs_no_saga_code_and_needs_no_engine() -> None:
    env = Harness(app)
    run_id = env.start(cart, "bob")
    env.run_until_idle()
    env.send_event(run_id, "add", "pear")
    env.run_until_idle()
    activations = CART_RUNS[0]
    reader = Client(env.store, app)  # another process: no engine, no harness, no worker
    assert reader.query(run_id, count) == 1
    assert reader.query(run_id, "summary", 1) == {
        "owner": "bob",
        "status": "waiting",
        "first": ["pear"],
        "events": 1,
    }
    assert CART_RUNS[0] == activations  # the saga code did not run to answer


def test_queries_refuse_bad_declarations_and_bad_calls() -> None:
    env = Harness(app)
    run_id = env.start(cart, "cy")
    env.run_until_idle()
    with pytest.raises(
        ValidationError, match=r"declares no query 'nope'; its queries: count, summary"
    ):
        env.query(run_id, "nope")
    with pytest.raises(ValidationError, match=r"query 'summary'.*missing a required argument"):
        env.query(run_id, "summary")
    with pytest.raises(ValidationError, match="argument 'top' is not a valid int"):
        env.query(run_id, cart_summary, "many")
    progress_run = env.start(progress, 1)
    with pytest.raises(ValidationError, match="is not a query of saga 'progress'"):
        env.query(progress_run, count)
    with pytest.raises(ValidationError, match="needs that app's code"):
        Client(env.store, "port-client").query(run_id, "count")
    with pytest.raises(RunNotFoundError):
        env.query("no-such-run", "count")
    with pytest.raises(DeclarationError, match="already declares a query 'count'"):
        query(cart)(count.fn)
    with pytest.raises(DeclarationError, match="plain `def`"):

        @query(cart, name="later")
        async def later(run: RunView) -> int:
            return 0

    with pytest.raises(DeclarationError, match="invalid query name"):
        query(cart, name="no spaces")(count.fn)
    with pytest.raises(DeclarationError, match="takes a declared saga"):
        query("cart")  # type: ignore[arg-type]


# --- a cancel delivered to a running step ------------------------------------------------------

steps_seen: list[str] = []
HARNESS: list[Harness] = []
"""The harness of the test running: what the steps below cancel their run through."""


def cancel_and_beat(ctx: StepContext, beats_before: int) -> str:
    """Temporal's hello_cancellation activity, in a harness: it heartbeats while it works, and
    its run is cancelled while it runs (here, by the step itself after ``beats_before``
    heartbeats: a test's stand-in for a user who gives up)."""
    steps_seen.append("started")
    try:
        # until the heartbeat says stop (it looks at the run at most once a second), within
        # a limit generous enough for a busy machine
        deadline, beat = time.monotonic() + 60, 0
        while time.monotonic() < deadline:
            if beat == beats_before:
                HARNESS[0].cancel(ctx.run_id, "the user gave up")
                steps_seen.append(HARNESS[0].get(ctx.run_id).status)
            ctx.heartbeat(beat)
            beat += 1
            time.sleep(0.01)  # the step's own work between two heartbeats, not a wait
        steps_seen.append("never told")
        return "done"
    except StepCancelled:
        steps_seen.append("cancelled")
        raise
    finally:
        steps_seen.append("cleanup")


remote_step = app.step(name="remote_beats", queue="q")(cancel_and_beat)
local_step = app.step(name="local_beats", local=True)(cancel_and_beat)


@remote_step.compensation
def undo_remote(ctx: StepContext, beats_before: int, result: str) -> None:
    steps_seen.append("compensated")


@local_step.compensation
def undo_local(ctx: StepContext, beats_before: int, result: str) -> None:
    steps_seen.append("compensated")


@app.saga(name="beats")
async def beats(ctx: SagaContext, args: dict[str, Any]) -> str:
    step = local_step if args["local"] else remote_step
    return await ctx.call(step, args["beats_before"])


@pytest.fixture
def env() -> Iterator[Harness]:
    steps_seen.clear()
    harness = Harness(app)
    HARNESS[:] = [harness]
    yield harness
    HARNESS.clear()
    harness.close()


@pytest.mark.parametrize("local", [False, True], ids=["worker step", "in-process step"])
def test_the_harness_delivers_a_cancel_to_a_running_step_through_its_heartbeat(
    env: Harness, local: bool
) -> None:
    run_id = env.start(beats, {"local": local, "beats_before": 0})
    env.run_until_idle()
    assert steps_seen == ["started", "compensating", "cancelled", "cleanup", "compensated"]
    assert env.get(run_id).status == "cancelled"
    failed = [e for e in env.history(run_id) if e.kind == h.STEP_FAILED]
    assert [e.data["error"]["type"] for e in failed] == ["StepCancelled"]


def test_a_step_that_heartbeats_in_a_loop_sees_the_cancel_within_a_second(env: Harness) -> None:
    """After its first, a heartbeat looks at the run at most once a second (real time): a step
    cancelled after a few beats stops at the first look after the cancel."""
    run_id = env.start(beats, {"local": False, "beats_before": 3})
    started = time.monotonic()
    env.run_until_idle()
    assert time.monotonic() - started < 10
    assert steps_seen == ["started", "compensating", "cancelled", "cleanup", "compensated"]
    assert env.get(run_id).status == "cancelled"


def test_a_cancel_outside_a_step_waits_for_the_engine_as_before(env: Harness) -> None:
    run_id = env.start(cart, "dee")
    env.run_until_idle()
    env.cancel(run_id)
    assert env.get(run_id).status == "waiting"  # queued: the test steps the harness
    env.run_until_idle()
    assert env.get(run_id).status == "cancelled"
