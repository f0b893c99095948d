"""The test harness finds what production would: saga code replayed from the history on every
activation, the calls a newcomer reaches for first refused in saga code, timers fired in order
by ``advance``, step bodies overridden, recorded histories replayed against new code."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from sagaloop import App, EventTimeoutError, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.errors import NonDeterminismError, SagaFailedError
from sagaloop.testing import Harness, history_to_json, replay

# --- 1. replay on every activation ---------------------------------------------------------


def counter_app() -> tuple[App, Any]:
    """A saga whose second call depends on a module-level counter: the same on its first
    execution only, as a call to ``os.urandom`` or a global cache would be."""
    app = App("counter")
    executions = itertools.count()

    @app.step()
    def a(ctx: StepContext) -> str:
        return "a"

    @app.step()
    def b(ctx: StepContext) -> str:
        return "b"

    @app.step()
    def c(ctx: StepContext) -> str:
        return "c"

    @app.saga(name="drifting")
    async def drifting(ctx: SagaContext) -> list[str]:
        first = await ctx.call(a)
        second = await ctx.call(b if next(executions) == 0 else c)
        return [first, second]

    return app, drifting


def test_the_harness_replays_from_the_history_by_default_and_finds_non_determinism() -> None:
    app, drifting = counter_app()
    env = Harness(app)
    run_id = env.start(drifting)
    env.run_until_idle()
    with pytest.raises(SagaFailedError, match="non-deterministic saga code") as raised:
        env.result(run_id)
    assert "call('b') at position 1" in str(raised.value)
    assert "call('c')" in str(raised.value)


def test_cache_true_keeps_suspended_runs_as_production_does() -> None:
    app, drifting = counter_app()
    env = Harness(app, cache=True)
    run_id = env.start(drifting)
    env.run_until_idle()
    assert env.result(run_id) == ["a", "b"]


# --- 2. the calls a newcomer reaches for first ----------------------------------------------


CALLS: dict[str, tuple[Callable[[], Any], str]] = {
    "random.random": (lambda: random.random(), "ctx.random()"),
    "random.randint": (lambda: random.randint(1, 6), "ctx.random()"),
    "random.choice": (lambda: random.choice("abc"), "ctx.random()"),
    "random.shuffle": (lambda: random.shuffle([1, 2, 3]), "ctx.random()"),
    "time.time": (lambda: time.time(), "ctx.now()"),
    "time.time_ns": (lambda: time.time_ns(), "ctx.now()"),
    "uuid.uuid4": (lambda: uuid.uuid4(), "ctx.uuid4()"),
}


def calling_app(call: Callable[[], Any]) -> tuple[App, Any]:
    app = App("newcomer")

    @app.saga(name="newcomer")
    async def newcomer(ctx: SagaContext) -> str:
        return repr(call())

    return app, newcomer


@pytest.mark.parametrize("name", sorted(CALLS))
def test_non_deterministic_calls_fail_the_run_pointing_to_the_context(name: str) -> None:
    call, advice = CALLS[name]
    app, newcomer = calling_app(call)
    env = Harness(app, cache=True)  # refused on the first execution, not only on replay
    run_id = env.start(newcomer)
    env.run_until_idle()
    with pytest.raises(SagaFailedError) as raised:
        env.result(run_id)
    error = raised.value.error
    assert error is not None
    assert error.type == "SagaDeterminismViolation"
    assert f"{name}()" in error.message
    assert advice in error.message


def test_steps_and_other_threads_may_call_them_while_saga_code_runs() -> None:
    app = App("others")
    go, done = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def other_thread() -> None:
        go.wait(5)
        try:
            for name, (call, _) in CALLS.items():
                seen[name] = call()
        except Exception as e:  # reported by the assertion below
            seen["error"] = e
        done.set()

    @app.step()
    def stamp(ctx: StepContext) -> list[str]:
        return [repr(call()) for call, _ in CALLS.values()]

    @app.saga(name="handoff")
    async def handoff(ctx: SagaContext) -> int:
        if not ctx.is_replaying:
            go.set()  # the other thread calls them while this saga code runs
            assert done.wait(5)
        return len(await ctx.call(stamp))

    thread = threading.Thread(target=other_thread)
    thread.start()
    env = Harness(app)
    run_id = env.start(handoff)
    env.run_until_idle()
    thread.join(5)
    assert "error" not in seen, seen.get("error")
    assert set(seen) == set(CALLS)
    assert env.result(run_id) == len(CALLS)


def test_logging_from_saga_code_still_works(caplog: pytest.LogCaptureFixture) -> None:
    """Log records are stamped with ``time.time()``; logging on behalf of saga code is fine."""
    app = App("logs")

    @app.saga(name="chatty")
    async def chatty(ctx: SagaContext) -> str:
        ctx.logger.warning("hello from saga code")
        logging.getLogger("user.module").warning("and from the user's own logger")
        return "ok"

    env = Harness(app)
    with caplog.at_level(logging.WARNING):
        run_id = env.start(chatty)
        env.run_until_idle()
    assert env.result(run_id) == "ok"
    assert "hello from saga code" in caplog.text
    assert "and from the user's own logger" in caplog.text


SPELLINGS = """
import datetime, random, time, uuid
from datetime import date as date_class, datetime as datetime_class
from time import time as time_function
from random import getrandbits, random as random_function, randbytes, randint
from uuid import uuid4

from sagaloop import App, SagaContext
from sagaloop.testing import Harness

SPELLINGS = {
    "random.random()": lambda: random.random(),
    "from random import random": lambda: random_function(),
    "from random import randint": lambda: randint(1, 6),
    "from random import randbytes": lambda: randbytes(2),
    "from random import getrandbits": lambda: getrandbits(8),
    "time.time()": lambda: time.time(),
    "from time import time": lambda: time_function(),
    "datetime.datetime.now()": lambda: datetime.datetime.now(),
    "from datetime import datetime": lambda: datetime_class.now(),
    "from datetime import datetime (utcnow)": lambda: datetime_class.utcnow(),
    "from datetime import datetime (today)": lambda: datetime_class.today(),
    "from datetime import date (today)": lambda: date_class.today(),
    "uuid.uuid4()": lambda: uuid.uuid4(),
    "from uuid import uuid4": lambda: uuid4(),
}
assert getattr(time.time, "__wrapped__", None) is None, "nothing is patched at import"
app = App("spellings")
caught = {}

@app.saga(name="spell")
async def spell(ctx: SagaContext, name: str) -> None:
    SPELLINGS[name]()

env = Harness(app, cache=True)
for name in SPELLINGS:
    env.run_until_idle(); run_id = env.start(spell, name); env.run_until_idle()
    caught[name] = env.get(run_id).status == "failed"
print(json.dumps(caught))
"""

CAUGHT = {
    "random.random()": True,
    "from random import random": False,  # C methods of the generator, bound at import
    "from random import randint": True,  # Python methods: they draw through the guarded class
    "from random import randbytes": True,
    "from random import getrandbits": False,
    "time.time()": True,
    "from time import time": False,
    "datetime.datetime.now()": False,
    "from datetime import datetime": False,
    "from datetime import datetime (utcnow)": False,
    "from datetime import datetime (today)": True,  # C code that calls time.time()
    "from datetime import date (today)": True,
    "uuid.uuid4()": True,
    "from uuid import uuid4": False,
}


def test_which_spellings_are_caught_as_docs_concepts_testing_says() -> None:
    """Names imported before the first saga ran keep the original function (a fresh process,
    imports at the top of the module as users write them)."""
    code = "import json\n" + SPELLINGS
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == CAUGHT


# --- 3. advance and override -------------------------------------------------------------------


def race_app() -> tuple[App, Any]:
    app = App("race")

    @app.step()
    def note(ctx: StepContext, what: str) -> str:
        return what

    @app.saga(name="race")
    async def race(ctx: SagaContext) -> dict[str, Any]:
        start = ctx.now()
        sleep = asyncio.ensure_future(ctx.sleep(timedelta(days=30)))
        try:
            await ctx.wait_for_event("reply", timeout=timedelta(days=1))
            winner = "reply"
        except EventTimeoutError:
            winner = "timeout"
        at = ctx.now() - start
        await ctx.call(note, winner)
        await ctx.sleep(timedelta(days=2))  # due long before the 30-day sleep
        later = ctx.now() - start
        await sleep
        return {
            "winner": winner,
            "at": at.days,
            "later": later.days,
            "end": (ctx.now() - start).days,
        }

    return app, race


def test_advance_fires_each_timer_at_its_due_time_in_order() -> None:
    app, race = race_app()
    env = Harness(app)
    start = env.clock.now()
    run_id = env.start(race)
    env.run_until_idle(skip_time=False)
    env.advance(timedelta(days=31))
    assert env.clock.now() == start + timedelta(days=31)
    assert env.result(run_id) == {"winner": "timeout", "at": 1, "later": 3, "end": 30}


def test_advance_stops_at_the_target_and_leaves_later_timers() -> None:
    app, race = race_app()
    env = Harness(app)
    run_id = env.start(race)
    env.run_until_idle(skip_time=False)
    env.advance(timedelta(days=2))
    assert env.get(run_id).status == "waiting"
    fired = [e for e in env.history(run_id) if e.kind == h.TIMER_FIRED]
    assert len(fired) == 1, "only the one-day timeout fell due"
    env.advance(timedelta(days=29))
    assert env.get(run_id).status == "completed"


def override_app() -> tuple[App, Any, Any]:
    app = App("override")

    @app.step()
    def charge(ctx: StepContext, amount: int) -> str:
        return f"charged {amount}"

    @app.step(local=True)
    def local_fee(ctx: StepContext, amount: int) -> int:
        return amount // 10

    @app.saga(name="pay")
    async def pay(ctx: SagaContext, amount: int) -> list[Any]:
        return [await ctx.call(charge, amount), await ctx.call(local_fee, amount)]

    return app, pay, (charge, local_fee)


def test_override_swaps_a_step_body_for_the_rest_of_the_test() -> None:
    app, pay, (charge, local_fee) = override_app()
    env = Harness(app)
    env.override(charge, lambda ctx, amount: f"fake charge of {amount}")
    env.override(local_fee, lambda ctx, amount: 0)
    first = env.start(pay, 100)
    env.run_until_idle()
    assert env.result(first) == ["fake charge of 100", 0]
    env.restart()
    second = env.start(pay, 200)
    env.run_until_idle()
    assert env.result(second) == ["fake charge of 200", 0], "a restart keeps the override"

    other = Harness(app)  # the app itself is untouched
    run_id = other.start(pay, 100)
    other.run_until_idle()
    assert other.result(run_id) == ["charged 100", 10]


def test_override_as_a_context_manager_restores_the_step() -> None:
    app, pay, (charge, _) = override_app()
    env = Harness(app)
    with env.override(charge, lambda ctx, amount: "fake"):
        inside = env.start(pay, 100)
        env.run_until_idle()
    after = env.start(pay, 100)
    env.run_until_idle()
    assert env.result(inside) == ["fake", 10]
    assert env.result(after) == ["charged 100", 10]


def test_override_refuses_a_step_of_another_app() -> None:
    app, _, _ = override_app()
    _, _, (stranger, _) = override_app()
    env = Harness(app)
    with pytest.raises(ValueError, match="not registered in app 'override'"):
        env.override(stranger, lambda ctx, amount: "x")


# --- 4. replaying a recorded history ---------------------------------------------------------


def trip_app(*, change: str | None = None) -> tuple[App, Any]:
    app = App("trips")

    @app.step()
    def book_car(ctx: StepContext) -> str:
        return "car"

    @app.step()
    def book_hotel(ctx: StepContext) -> str:
        return "hotel"

    @app.step()
    def book_flight(ctx: StepContext) -> str:
        return "flight"

    @app.saga(name="trip")
    async def trip(ctx: SagaContext, days: int) -> list[str]:
        booked = [await ctx.call(book_car)]
        if change == "reorder":
            booked.append(await ctx.call(book_flight))
            booked.append(await ctx.call(book_hotel))
        elif change == "shorter":
            booked.append(await ctx.call(book_hotel))
            return booked
        else:
            booked.append(await ctx.call(book_hotel))
            booked.append(await ctx.call(book_flight))
        await ctx.sleep(timedelta(days=days))
        if change == "longer":
            booked.append(await ctx.call(book_car))
        return booked

    return app, trip


def recorded_trip() -> tuple[str, list[h.Event]]:
    app, trip = trip_app()
    env = Harness(app)
    run_id = env.start(trip, 3)
    env.run_until_idle()
    assert env.result(run_id) == ["car", "hotel", "flight"]
    return run_id, env.history(run_id)


def test_replay_of_a_recorded_history_against_the_same_code_passes() -> None:
    run_id, events = recorded_trip()
    app, _ = trip_app()
    replay(app, events, run_id=run_id)
    replay(app, json.loads(json.dumps(history_to_json(events))), run_id=run_id)
    replay(app, json.dumps(history_to_json(events)), run_id=run_id)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "reorder",
            "the history has call('book_hotel') at position 1, the code now issues "
            "call('book_flight') at position 1",
        ),
        (
            "shorter",
            "the history has call('book_flight') at position 2 but the saga code no "
            "longer issues it",
        ),
        ("longer", "the code now issues call('book_car') at position 4"),
    ],
)
def test_replay_names_the_first_divergence_of_changed_code(change: str, message: str) -> None:
    run_id, events = recorded_trip()
    app, _ = trip_app(change=change)
    with pytest.raises(NonDeterminismError) as raised:
        replay(app, history_to_json(events), run_id=run_id)
    assert message in str(raised.value)


def test_replay_explains_a_history_it_cannot_use() -> None:
    app, _ = trip_app()
    with pytest.raises(ValueError, match="no run_started"):
        replay(app, [])
    with pytest.raises(ValueError, match="saga 'gone' is not registered in app 'trips'"):
        replay(
            app,
            [
                {
                    "seq": 1,
                    "kind": "run_started",
                    "at": "2026-01-01T00:00:00+00:00",
                    "name": "gone",
                    "data": {"input": None},
                }
            ],
        )
