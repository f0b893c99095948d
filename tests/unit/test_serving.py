"""Issue 23, item 2, as pure functions: which queues no live process consumes, for ``status``
(``client.serving``) and for ``health`` (``runtime.registry.fleet``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sagaloop.client.serving import Serving, unserved
from sagaloop.client.timeline import StepLine, Timeline
from sagaloop.runtime.registry import fleet
from sagaloop.store.processes import ProcessRecord

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def waiting(queue: str, state: str = "scheduled") -> Timeline:
    line = StepLine(1, "book", state, 1, "k", queue, T0, None, None, None, None, None)
    why = [f"step 'book' (attempt 1) queued or running on {queue} for 3.0 s"]
    return Timeline("r", "trip", "running", T0, T0, [line], why, None, None, None, 2)


ENGINE = ("shop", ["shop.engine", "shop/local"], ["shop.steps.bookings"])


def test_a_queue_no_live_process_consumes_is_named() -> None:
    tl = unserved(waiting("bookings"), "shop", Serving.of("shop", [ENGINE]))
    assert tl.unserved == ["bookings"] and not tl.no_live_engine
    assert tl.waiting_for[0].startswith("step 'book' (attempt 1) queued on bookings for 3.0 s; ")
    assert "no live process consumes queue 'bookings'" in tl.waiting_for[0]
    assert "`sagaloop worker --queue bookings`" in tl.waiting_for[0]


def test_a_consumed_queue_and_an_in_process_step_are_not() -> None:
    worker = ("shop", ["shop.steps.bookings"], ["shop.steps.bookings"])
    tl = unserved(waiting("bookings"), "shop", Serving.of("shop", [ENGINE, worker]))
    assert tl.unserved == [] and "queued or running" in tl.waiting_for[0]
    local = unserved(waiting("default"), "shop", Serving.of("shop", [ENGINE]))
    assert local.unserved == [], "an in-process step's queue is run by the engines"


def test_no_live_engine_comes_first_and_nothing_is_said_without_a_registry() -> None:
    worker = ("shop", ["shop.steps.bookings"], ["shop.steps.bookings"])
    tl = unserved(waiting("bookings"), "shop", Serving.of("shop", [worker]))
    assert tl.no_live_engine and tl.waiting_for[0].startswith("no live engine of app 'shop'")
    quiet = unserved(waiting("bookings"), "shop", Serving.of("shop", []))
    assert quiet.unserved == [] and not quiet.no_live_engine


def proc(name: str, queues: list[str], seen: float, stopped: bool = False) -> ProcessRecord:
    at = T0 - timedelta(seconds=seen)
    return ProcessRecord(
        name, "shop", name, T0, at, None, at if stopped else None, None, queues, ["shop.steps.q"]
    )


def test_health_fails_for_runs_in_flight_without_an_engine_or_a_consumer() -> None:
    engine = proc("engine", ["shop.engine"], 1)
    worker = proc("worker", ["shop.steps.q"], 1)
    assert fleet([engine, worker], T0, {"shop": 3}) == ({}, [])
    unserved_q, problems = fleet([engine], T0, {"shop": 3})
    assert unserved_q == {"shop": ["shop.steps.q"]}
    assert problems and "no live process consumes queue(s) shop.steps.q" in problems[0]
    assert fleet([engine], T0, {}) == ({"shop": ["shop.steps.q"]}, []), "no run waits: listed"
    dead = proc("engine", ["shop.engine"], 60)
    _, problems = fleet([dead, worker], T0, {"shop": 1})
    assert problems == [
        "app 'shop' has 1 run(s) in flight and no live engine: nothing moves them (start "
        "`sagaloop engine`, or `sagaloop dev`)"
    ]
    _, problems = fleet([], T0, {"other": 2})
    assert "app 'other' has 2 run(s) in flight and no live engine" in problems[0]
