"""`Client.fork`: a new run with the history of another up to a command position, results
reused (counters in the step bodies prove that nothing before the cut ran again), the code as
it is now going on from there; and the forks it refuses."""

from __future__ import annotations

import collections
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from sagaloop import App, SagaContext, StepContext
from sagaloop.client import Client
from sagaloop.client.fork import fork_history, settled_commands
from sagaloop.engine.messages import engine_queue, step_queue
from sagaloop.errors import EventTimeoutError, RunNotFoundError, RunStateError, ValidationError
from sagaloop.testing import Harness
from sagaloop.testing.histories import history_document


class Trip:
    """An app whose steps count their runs and keep their idempotency keys. ``version`` 2
    reviews instead of shipping after the event; ``"renamed"`` calls another step first."""

    def __init__(self, version: int | str = 1) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.keys: list[str] = []
        self.app = app = App("fork-tests")

        @app.step(queue="fast")
        def count(ctx: StepContext, label: str) -> str:
            self.counts[label] += 1
            self.keys.append(ctx.idempotency_key)
            return f"{label}-{self.counts[label]}"

        @app.step(queue="slow")
        def slow(ctx: StepContext, label: str) -> str:
            self.counts[label] += 1
            self.keys.append(ctx.idempotency_key)
            return f"{label}-{self.counts[label]}"

        @app.saga(name="trip")
        async def trip(ctx: SagaContext, who: str) -> list[Any]:
            first = await ctx.call(slow if version == "renamed" else count, "a")  # 0
            await ctx.sleep(timedelta(hours=1))  # 1
            b = await ctx.call(count, "b")  # 2
            go = await ctx.wait_for_event("go")  # 3
            last = await ctx.call(count, "review" if version == 2 else "c")  # 4
            return [who, first, b, go, last]

        @app.saga(name="pair")
        async def pair(ctx: SagaContext) -> list[str]:
            x, y = await ctx.gather(ctx.call(count, "x"), ctx.call(slow, "y"))  # 0, 1
            z = await ctx.call(count, "z")  # 2
            return [x, y, z]

        @app.saga(name="inbox")
        async def inbox(ctx: SagaContext) -> list[Any]:
            try:
                first = await ctx.wait_for_event("a", timeout=timedelta(minutes=5))  # 0
            except EventTimeoutError:
                first = "timed out"
            second = await ctx.wait_for_event("b")  # 1
            third = await ctx.wait_for_event("c")  # 2
            return [first, second, third]


@pytest.fixture
def trip() -> Trip:
    return Trip()


@pytest.fixture
def env(trip: Trip) -> Any:
    env = Harness(trip.app)
    yield env
    env.close()


def finished_trip(env: Harness) -> str:
    run = env.start("trip", "ada", run_id="trip-1")
    env.run_until_idle()  # a, the sleep (skipped), b; waits for "go"
    env.send_event(run, "go", "yes")
    env.run_until_idle()
    assert env.result(run) == ["ada", "a-1", "b-1", "yes", "c-1"]
    return run


def test_fork_at_a_wait_reuses_what_came_before_and_waits_again(env: Harness, trip: Trip) -> None:
    finished_trip(env)
    fork = env.client.fork("trip-1", 3, run_id="trip-1-fork")
    env.run_until_idle(skip_time=False)  # the sleep before the cut ended: no clock needed
    assert trip.counts == {"a": 1, "b": 1, "c": 1}, "nothing before the cut ran again"
    assert env.get(fork).status == "waiting"
    assert [w.events for w in env.status(fork).waits] == [["go"]]
    env.send_event(fork, "go", "again")
    env.run_until_idle()
    assert env.result(fork) == ["ada", "a-1", "b-1", "again", "c-2"]
    assert trip.keys[-1] == "trip-1-fork/4/do" != "trip-1/4/do", "its own idempotency keys"
    started = env.history(fork)[0]
    assert started.data["forked_from"] == {"run_id": "trip-1", "position": 3}
    assert started.data["input"] == "ada"
    steps = env.status(fork).steps
    assert [(x.position, x.step, x.state, x.attempts) for x in steps] == [
        (0, "count", "completed", 1),
        (2, "count", "completed", 1),
        (4, "count", "completed", 1),
    ]


def test_fork_after_a_wait_keeps_the_event_it_received(env: Harness, trip: Trip) -> None:
    finished_trip(env)
    fork = env.client.fork("trip-1", 4)
    env.run_until_idle(skip_time=False)
    assert env.result(fork) == ["ada", "a-1", "b-1", "yes", "c-2"]
    assert trip.counts == {"a": 1, "b": 1, "c": 2}


def test_fork_at_the_end_copies_the_run_and_at_the_start_runs_it_again(
    env: Harness, trip: Trip
) -> None:
    finished_trip(env)
    copy = env.client.fork("trip-1", 5)
    env.run_until_idle(skip_time=False)
    assert env.result(copy) == ["ada", "a-1", "b-1", "yes", "c-1"]
    assert trip.counts == {"a": 1, "b": 1, "c": 1}
    again = env.client.fork("trip-1", 0)
    env.run_until_idle()
    assert env.get(again).status == "waiting"
    assert trip.counts == {"a": 2, "b": 2, "c": 1}


def test_waits_keep_their_timeout_and_the_event_they_took(env: Harness) -> None:
    run = env.start("inbox", run_id="inbox-1")
    env.run_until_idle(skip_time=False)
    env.send_event(run, "b", "early")  # kept until the wait at position 1 asks for it
    env.run_until_idle()  # the wait at 0 times out; the one at 1 takes "b"
    env.send_event(run, "c", "late")
    env.run_until_idle()
    assert env.result(run) == ["timed out", "early", "late"]
    at_2 = env.client.fork(run, 2)
    at_1 = env.client.fork(run, 1)
    env.run_until_idle(skip_time=False)
    assert [w.events for w in env.status(at_2).waits] == [["c"]]
    assert [w.events for w in env.status(at_1).waits] == [["b"]], "its event was dropped"
    env.send_event(at_2, "c", "fork")
    env.send_event(at_1, "b", "fork")
    env.run_until_idle(skip_time=False)
    env.send_event(at_1, "c", "fork")
    env.run_until_idle(skip_time=False)
    assert env.result(at_2) == ["timed out", "early", "fork"]
    assert env.result(at_1) == ["timed out", "fork", "fork"]


def test_a_changed_saga_goes_on_from_the_cut(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    v1 = Trip(1)
    old = Harness(v1.app, url=url)
    finished_trip(old)
    old.close()
    v2 = Trip(2)
    new = Harness(v2.app, url=url, clock=old.clock)
    fork = new.client.fork("trip-1", 4)
    new.run_until_idle()
    assert new.result(fork) == ["ada", "a-1", "b-1", "yes", "review-1"]
    assert v2.counts == {"review": 1}, "only what comes after the cut ran, with the new code"
    with pytest.raises(ValidationError) as refused:  # the first step changed: cannot keep it
        Client(new.store, Trip("renamed").app).fork("trip-1", 1)
    assert "position 0" in str(refused.value) and "fork at an earlier position" in str(
        refused.value
    )
    new.close()


def test_outstanding_commands_before_the_cut_are_issued_again(env: Harness, trip: Trip) -> None:
    app = trip.app
    env.queues = [engine_queue(app.name), step_queue(app.name, "fast")]  # "slow" is stuck
    run = env.start("pair", run_id="pair-1")
    env.run_until_idle()
    assert trip.counts == {"x": 1} and env.get(run).status == "running"
    events = env.history(run)
    assert settled_commands(events) == {0}
    kept = fork_history(events, 2)
    assert [(e.kind, e.pos) for e in kept] == [
        ("run_started", None),
        ("step_scheduled", 0),
        ("step_completed", 0),
    ], "y (position 1) was outstanding: dropped"
    fork = env.client.fork(run, 2, run_id="pair-2")
    env.queues = None
    env.run_until_idle()
    assert env.result(run) == ["x-1", "y-1", "z-1"]
    assert env.result(fork) == ["x-1", "y-2", "z-2"]
    assert trip.counts == {"x": 1, "y": 2, "z": 2}, "x reused; y and z run by each run"
    assert {"pair-1/1/do", "pair-2/1/do"} <= set(trip.keys)


def test_refusals(env: Harness, trip: Trip) -> None:
    finished_trip(env)
    client = env.client
    with pytest.raises(ValidationError, match=r"position 6 is outside .* positions 0 to 4"):
        client.fork("trip-1", 6)
    with pytest.raises(ValidationError, match="position -1 is outside"):
        client.fork("trip-1", -1)
    with pytest.raises(RunNotFoundError):
        client.fork("nope", 0)
    with pytest.raises(RunStateError, match="another id"):
        client.fork("trip-1", 2, run_id="trip-1")
    fork = client.fork("trip-1", 2, run_id="taken")
    assert client.fork("trip-1", 2, run_id="taken") == fork, "the same fork again: the same run"
    with pytest.raises(RunStateError, match="'taken' is taken"):
        client.fork("trip-1", 3, run_id="taken")
    other = App("fork-tests")
    with pytest.raises(RunStateError, match="does not declare"):
        Client(env.store, other).fork("trip-1", 2)
    with pytest.raises(ValidationError, match="needs the App"):
        Client(env.store, "fork-tests").fork("trip-1", 2)
    runs = [r.run_id for r in env.client.list()]
    assert sorted(runs) == ["taken", "trip-1"], "nothing written by a refused fork"


def test_the_export_document_lists_positions_and_the_fork(env: Harness) -> None:
    finished_trip(env)
    fork = env.client.fork("trip-1", 3, run_id="f")
    env.run_until_idle()
    doc = history_document(env.get(fork), env.history(fork))
    assert doc["forked_from"] == {"run_id": "trip-1", "position": 3}
    assert [(c["position"], c["command"], c["done"]) for c in doc["commands"]] == [
        (0, "call", True),
        (1, "sleep", True),
        (2, "call", True),
        (3, "wait_for_event", False),
    ]


def test_a_failing_fork_never_undoes_the_effects_it_copied() -> None:
    """The steps before the cut ran for the source run: their effects are the source's. A fork
    that fails (or is cancelled) compensates what it ran itself, never what it copied; else
    debugging an agent's choice on a fork could refund the customer of the original run."""
    undone: list[str] = []
    app = App("fork-undo")

    @app.step(queue="q")
    def charge(ctx: StepContext, label: str) -> str:
        return label

    @charge.compensation
    def refund(ctx: StepContext, label: str, result: str) -> None:
        undone.append(label)

    @app.saga(name="buy")
    async def buy(ctx: SagaContext) -> str:
        await ctx.call(charge, "source")  # 0
        go = await ctx.wait_for_event("go")  # 1
        await ctx.call(charge, f"fork-{go}")  # 2
        raise ValueError("the fork's new code fails")

    env = Harness(app)
    source = env.start(buy)
    env.run_until_idle()
    fork = env.client.fork(source, at=1)
    env.send_event(fork, "go", "x")
    env.run_until_idle()
    assert env.get(fork).status == "compensated"
    assert undone == ["fork-x"], "only the step the fork ran itself is undone"
    env.send_event(source, "go", "y")
    env.run_until_idle()
    assert undone == ["fork-x", "fork-y", "source"], "the source run undoes its own"
    env.close()
