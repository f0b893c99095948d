"""Polling timers while nothing is due costs no read (issue 27): a look says when the next
timer is due, the engine of the process says when it commits an earlier one, and a look holds
for ``RELOOK`` seconds (for the timers other processes' engines set)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from sagaloop import App, SagaContext
from sagaloop.runtime import timers as timers_module
from sagaloop.testing import Harness

app = App("naps")


@app.saga(name="nap")
async def nap(ctx: SagaContext, seconds: float) -> str:
    await ctx.sleep(timedelta(seconds=seconds))
    return "rested"


class Monotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def mono(monkeypatch: pytest.MonkeyPatch) -> Monotonic:
    fake = Monotonic()
    monkeypatch.setattr(timers_module.time, "monotonic", fake)
    return fake


def _reads(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    reads: list[int] = []
    look = harness.store.next_timer_at

    def counted(**kw: Any) -> Any:
        reads.append(1)
        return look(**kw)

    monkeypatch.setattr(harness.store, "next_timer_at", counted)
    return reads


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(app, url=f"sqlite:///{tmp_path / 'naps.db'}")
    yield h
    h.close()


def test_an_idle_poll_reads_once_per_relook(
    harness: Harness, mono: Monotonic, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _reads(harness, monkeypatch)
    assert harness.timers.fire_due() == 0 and len(reads) == 1
    for _ in range(20):
        assert harness.timers.fire_due() == 0
    assert len(reads) == 1, "the look holds: nothing is due before the next timer"
    mono.now += timers_module.RELOOK
    assert harness.timers.fire_due() == 0 and len(reads) == 2, "looked again after RELOOK"


def test_a_timer_this_engine_sets_fires_at_its_due_time_without_a_relook(
    harness: Harness, mono: Monotonic, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _reads(harness, monkeypatch)
    assert harness.timers.fire_due() == 0  # a look: no timer at all, quiet for RELOOK
    run_id = harness.start(nap, 5.0)
    harness.run_until_idle(skip_time=False)  # the engine commits the sleep's timer
    before = len(reads)
    assert harness.timers.fire_due() == 0 and len(reads) == before, "told, not read"
    harness.clock.advance(timedelta(seconds=5))
    assert harness.timers.fire_due() == 1, "fired at its due time, RELOOK not passed"
    harness.run_until_idle(skip_time=False)
    assert harness.result(run_id) == "rested"


def test_a_timer_another_engine_sets_is_found_within_relook(
    tmp_path: Path, mono: Monotonic, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    here, there = Harness(app, url=url), Harness(app, url=url)
    try:
        assert here.timers.fire_due() == 0  # quiet: no timer anywhere
        there.clock.set(here.clock.now())
        run_id = there.start(nap, 1.0)
        there.step_once()  # the other engine sets the timer (and tells its own scheduler)
        assert [k.kind for k in there.history(run_id)][-1] == "timer_started"
        here.clock.advance(timedelta(seconds=1))
        assert here.timers.fire_due() == 0, "this process was not told: its look holds"
        mono.now += timers_module.RELOOK
        assert here.timers.fire_due() == 1, "found by the next look"
    finally:
        here.close()
        there.close()


def test_a_wake_between_a_look_and_its_verdict_is_kept(
    harness: Harness, mono: Monotonic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine commits a timer while the scheduler reads (it sees none): the wake is not
    lost when the scheduler then records that nothing was due."""
    timers = harness.timers
    look = harness.store.next_timer_at
    soon = harness.clock.now() + timedelta(seconds=2)

    def racing(**kw: Any) -> Any:
        found = look(**kw)
        timers.wake(soon)  # committed just after the read
        return found

    monkeypatch.setattr(harness.store, "next_timer_at", racing)
    assert timers.fire_due() == 0
    monkeypatch.setattr(harness.store, "next_timer_at", look)
    harness.clock.advance(timedelta(seconds=2))
    assert not timers._still_quiet(harness.clock.now()), "due by the wake: it looks"
