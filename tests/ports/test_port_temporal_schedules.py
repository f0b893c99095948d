"""Port of Temporal's schedules sample.

Original: github.com/temporalio/samples-python, commit e652a4d0e85042a34ec8fc46a4a03e51681fd7f9,
``schedules/`` (``start_schedule.py``,
``describe_schedule.py``, ``list_schedule.py``, ``pause_schedule.py``, ``trigger_schedule.py``,
``backfill_schedule.py``, ``update_schedule.py``, ``delete_schedule.py``, ``your_workflows.py``,
``your_activities.py``; the README says what each does). Here the scripts are one test, in the
README's order, on the Harness: its virtual clock fires the ticks when advanced.

What maps to what:

- ``YourSchedulesWorkflow`` running ``your_activity`` -> the ``greet`` saga running the
  ``your_activity`` step;
- ``client.create_schedule(id, Schedule(action=StartWorkflow(..., "my schedule arg"),
  spec=ScheduleIntervalSpec(every=2 min)))`` -> ``client.schedules.create(name, saga, input,
  every=...)``; a tick's run id is ``schedule:<app>:<name>:<tick>`` (Temporal appends the
  tick's time to the workflow id too);
- ``handle.describe()``, ``client.list_schedules()`` -> ``client.schedules.describe(name)``,
  ``client.schedules.list()``;
- ``ScheduleState(note=...)``, ``handle.pause(note=...)`` / ``unpause()`` -> ``create(note=)``,
  ``pause(note=)`` / ``resume``; ``desc.schedule.state.note`` -> ``describe(name).note``;
- ``handle.trigger()`` -> ``client.schedules.trigger(name)``: one run now, outside the ticks;
- ``handle.backfill(ScheduleBackfill(now - 10 min, now - 9 min, ALLOW_ALL))`` ->
  ``client.schedules.backfill(name, start, end)``: one run per tick in the range (ticks already
  fired start nothing again: sagaloop's one overlap policy for a tick);
- ``handle.update(fn)`` setting ``args = ["my new schedule arg"]`` -> ``client.schedules.update(
  name, input=...)``: used from the next tick on;
- ``handle.delete()`` -> ``client.schedules.delete(name)``: the runs it started are untouched.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel

from sagaloop import App, SagaContext, StepContext
from sagaloop.testing import Harness

app = App("port-schedules")
NAME = "workflow-schedule-id"


class YourParams(BaseModel):
    greeting: str
    name: str


@app.step(timeout=timedelta(seconds=10))
def your_activity(ctx: StepContext, input: YourParams) -> str:
    return f"{input.greeting}, {input.name}!"


@app.saga
async def greet(ctx: SagaContext, name: str) -> str:
    return await ctx.call(your_activity, YourParams(greeting="Hello", name=name))


def runs(env: Harness) -> list[str]:
    return sorted(r.run_id for r in env.client.list(limit=100))


def test_the_schedules_scripts_in_sequence() -> None:
    env = Harness(app)  # the clock starts at 2026-01-01T00:00:00 UTC
    schedules = env.client.schedules

    # start_schedule.py: every 2 minutes, "my schedule arg"
    created = schedules.create(
        NAME,
        "greet",
        "my schedule arg",
        every=timedelta(minutes=2),
        note="Here's a note on my Schedule.",
    )
    assert created.spec == "every 120s"
    env.clock.advance(timedelta(minutes=2))
    env.run_until_idle()
    first = f"schedule:port-schedules:{NAME}:20260101T000200Z"
    assert runs(env) == [first]
    assert env.result(first) == "Hello, my schedule arg!"

    # describe_schedule.py: prints "Returns the note: Here's a note on my Schedule."
    desc = schedules.describe(NAME)
    assert f"Returns the note: {desc.note}" == "Returns the note: Here's a note on my Schedule."
    assert (desc.saga, desc.input, desc.paused) == ("greet", "my schedule arg", False)
    assert desc.last_run_id == first
    assert [f"{t:%H:%M}" for t in desc.next_ticks[:3]] == ["00:04", "00:06", "00:08"]

    # list_schedule.py
    assert [s.name for s in schedules.list()] == [NAME]

    # pause_schedule.py: nothing starts while paused; unpause from the next tick
    schedules.pause(NAME, note="Pausing the schedule for now")
    paused = schedules.describe(NAME)
    assert paused.paused and paused.note == "Pausing the schedule for now"
    env.clock.advance(timedelta(minutes=6))
    env.run_until_idle()
    assert runs(env) == [first]

    # trigger_schedule.py: an immediate run, paused or not
    triggered = schedules.trigger(NAME)
    env.run_until_idle()
    assert triggered.startswith(f"schedule:port-schedules:{NAME}:trigger:")
    assert env.result(triggered) == "Hello, my schedule arg!"

    # backfill_schedule.py: the ticks from now - 10 min to now - 9 min (the clock is 00:08)
    now = env.clock.now()
    backfilled = schedules.backfill(NAME, now - timedelta(minutes=10), now - timedelta(minutes=9))
    assert backfilled == [f"schedule:port-schedules:{NAME}:20251231T235800Z"]
    env.run_until_idle()
    assert env.result(backfilled[0]) == "Hello, my schedule arg!"

    # update_schedule.py: the new arg from the next tick on
    schedules.resume(NAME)
    schedules.update(NAME, input="my new schedule arg")
    env.clock.advance(timedelta(minutes=2))
    env.run_until_idle()
    updated = f"schedule:port-schedules:{NAME}:20260101T001000Z"
    assert env.result(updated) == "Hello, my new schedule arg!"

    # delete_schedule.py: the schedule goes, its runs stay
    schedules.delete(NAME)
    assert schedules.list() == []
    env.clock.advance(timedelta(minutes=10))
    env.run_until_idle()
    assert runs(env) == sorted([first, triggered, backfilled[0], updated])
