"""A timeout stops the work (issue 22, section 3): the step runner's slots.

Python cannot kill a thread. A sync attempt past its timeout is *abandoned*: its slot is given
back (the pool grows a replacement thread, up to a cap), its late outcome is discarded and the
process reports the thread until it ends. An async attempt is cancelled. The time an attempt
waits for a slot does not count against its timeout, and an attempt that never started is never
counted as timed out: a stopping runner gives it back instead."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from sagaloop import App, StepContext
from sagaloop.engine.messages import Envelope, StepReply
from sagaloop.errors import StepCancelled
from sagaloop.runtime.steps import StepRunner
from sagaloop.testing import eventually

app = App("timeouts")
release = threading.Event()
seen: dict[str, list[Any]] = {}


def note(what: str, value: Any = True) -> None:
    seen.setdefault(what, []).append(value)


@app.step(timeout=timedelta(milliseconds=300))
def hang(ctx: StepContext, tag: str) -> str:
    note(f"{tag}:started")
    while not release.wait(0.05):
        try:
            ctx.heartbeat()
        except StepCancelled:
            note(f"{tag}:told to stop")
            release.wait(120)
            break
    return f"{tag}:late"


@app.step(timeout=timedelta(seconds=60))
def slow(ctx: StepContext, tag: str) -> str:
    note(f"{tag}:started")
    release.wait(120)
    return tag


@app.step(timeout=timedelta(milliseconds=500))
def quick(ctx: StepContext, tag: str) -> str:
    note(f"{tag}:started")
    return f"{tag}:done"


@app.step(timeout=timedelta(milliseconds=300))
async def sleeper(ctx: StepContext, tag: str) -> str:
    note(f"{tag}:started")
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        note(f"{tag}:cancelled")
        raise
    return tag


@pytest.fixture(autouse=True)
def _reset() -> Any:
    release.clear()
    seen.clear()
    yield
    release.set()  # abandoned threads end


def task(step: str, tag: str, run: str = "r1") -> Envelope:
    return Envelope(
        type="step",
        run_id=run,
        position=1,
        attempt=1,
        payload={"step": step, "args": {"tag": tag}},
    )


class Call:
    """``runner.run(task)`` on a thread of its own, as a consumer thread calls it."""

    def __init__(self, runner: StepRunner, env: Envelope) -> None:
        self.reply: StepReply | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(runner, env), daemon=True)
        self.thread.start()

    def _run(self, runner: StepRunner, env: Envelope) -> None:
        try:
            self.reply = runner.run(env)
        except BaseException as e:
            self.error = e

    def result(self, timeout: float = 30) -> dict[str, Any]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the attempt did not end"
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply


def started(tag: str) -> bool:
    return f"{tag}:started" in seen


def test_two_hung_attempts_do_not_starve_a_later_timed_step() -> None:
    """The issue's case: ``--concurrency 1`` gives the runner two threads. Two attempts that
    hang past their timeout used to hold both for ever: a canary step's attempt waited in the
    pool's queue, never ran, and was failed as timed out (in doubt)."""
    runner = StepRunner(app, threads=2)
    try:
        for tag in ("h1", "h2"):
            reply = runner.run(task("hang", tag))
            assert reply.outcome == "failed" and reply.error["type"] == "StepTimeoutError"
        reply = runner.run(task("quick", "canary"))
        assert started("canary"), "the canary's body never ran"
        assert reply.outcome == "completed" and reply.result == "canary:done", reply
    finally:
        runner.close()


def test_the_wait_for_a_slot_does_not_count_against_the_timeout() -> None:
    """An attempt queued behind a long one starts its timeout when its body starts."""
    runner = StepRunner(app, threads=1)
    try:
        long = Call(runner, task("slow", "long"))
        eventually(lambda: started("long"), what="the long attempt to start")
        queued = Call(runner, task("quick", "queued", run="r2"))
        since = time.monotonic()
        # quick's timeout is 0.5 s: wait well past it (or until it came back failed)
        eventually(lambda: queued.reply or time.monotonic() - since > 2, what="2 s queued")
        assert not started("queued")
        release.set()
        reply = queued.result()
        assert reply.outcome == "completed", f"counted as timed out though queued: {reply}"
        assert long.result().outcome == "completed"
    finally:
        runner.close()


def test_a_timed_out_async_attempt_is_cancelled() -> None:
    runner = StepRunner(app, threads=1)
    try:
        reply = runner.run(task("sleeper", "a"))
        assert reply.outcome == "failed" and reply.error["type"] == "StepTimeoutError"
        eventually(lambda: "a:cancelled" in seen, 10, "the coroutine to be cancelled")
        eventually(lambda: not runner.abandoned(), 10, "its thread to be free")
    finally:
        runner.close()


def test_an_abandoned_attempt_is_told_to_stop_reported_until_it_ends_and_its_result_dropped() -> (
    None
):
    runner = StepRunner(app, threads=1)
    try:
        reply = runner.run(task("hang", "h", run="run-7"))
        assert reply.outcome == "failed" and reply.error["type"] == "StepTimeoutError"
        assert "within 0:00:00.300000" in reply.error["message"]
        [attempt] = runner.abandoned()
        assert {k: attempt[k] for k in ("step", "run_id", "attempt")} == {
            "step": "hang",
            "run_id": "run-7",
            "attempt": 1,
        }
        assert attempt["since"] is not None
        eventually(lambda: "h:told to stop" in seen, 10, "ctx.heartbeat() to raise StepCancelled")
        release.set()
        eventually(lambda: not runner.abandoned(), 10, "the abandoned thread to end")
        # the pool is whole again: a new attempt runs
        assert runner.run(task("quick", "after")).outcome == "completed"
    finally:
        runner.close()


def test_slots_all_held_past_their_timeouts_is_a_problem_and_the_queued_attempt_waits() -> None:
    """At the cap (one thread, one spare), two abandoned attempts hold every thread: that is
    the process's problem (health fails), and a later attempt waits for a thread without its
    timeout running; once the hung ones end it runs."""
    runner = StepRunner(app, threads=1, spare_threads=1)
    try:
        for tag in ("h1", "h2"):
            assert runner.run(task("hang", tag, run=tag)).outcome == "failed"
        [problem] = runner.problems()
        assert "all 2 step threads are held by attempts past their timeouts" in problem
        assert "step 'hang', run h1" in problem and "run h2" in problem
        queued = Call(runner, task("quick", "canary"))
        since = time.monotonic()
        eventually(lambda: queued.reply or time.monotonic() - since > 1.5, what="1.5 s queued")
        assert queued.reply is None and not started("canary")
        release.set()
        assert queued.result().outcome == "completed"
        eventually(lambda: not runner.problems() and not runner.abandoned(), 10, "threads free")
    finally:
        runner.close()


def test_a_stopping_runner_gives_back_an_attempt_that_never_started() -> None:
    """What has not started when the process stops is given back (its message goes back to
    the queue), never answered as a failed, in-doubt attempt (it used to be answered failed
    with ``CancelledError``)."""
    runner = StepRunner(app, threads=1)
    try:
        long = Call(runner, task("slow", "long"))
        eventually(lambda: started("long"), what="the long attempt to start")
        queued = Call(runner, task("quick", "queued", run="r2"))
        eventually(lambda: getattr(runner, "waiting", lambda: 1)() == 1, 10, "it to queue")
        runner.close()  # what Runtime.stop does
        try:
            reply = queued.result()
        except Exception as e:
            assert type(e).__name__ == "AttemptNotStarted", e
        else:
            pytest.fail(f"answered although it never started: {reply}")
        assert not started("queued")
        release.set()
        assert long.result().outcome == "completed", "what runs is waited for"
    finally:
        runner.close()


def test_health_lists_abandoned_threads_as_notes_and_fails_only_for_problems() -> None:
    """The registry keeps a process's abandoned attempts apart from its problems; health
    lists them under the process and fails only for the problems."""
    from datetime import UTC, datetime

    from sagaloop.runtime.registry import assess
    from sagaloop.store.processes import ProcessRecord

    now = datetime.now(UTC)
    hung = [
        {"step": "hang", "run_id": r, "position": 0, "attempt": 1, "since": "T"}
        for r in ("r1", "r2")
    ]
    note = (
        "2 abandoned threads (step 'hang', run r1, attempt 1, since T; "
        "step 'hang', run r2, attempt 1, since T)"
    )

    def row(name: str, problem: str | None) -> ProcessRecord:
        return ProcessRecord(name, "shop", "engine", now, now, problem, None, hung)

    quiet = row("engine@h:1", None)
    full = row("engine@h:2", "all 4 step threads are held")
    listed, problems = assess([quiet, full], now)
    assert [p["notes"] for p in listed] == [note, note]
    assert [p["problem"] for p in listed] == [None, "all 4 step threads are held"]
    assert problems == ["engine@h:2 (engine of app shop): all 4 step threads are held"]


def test_an_attempt_that_cannot_start_before_its_schedule_to_close_failed_not_in_doubt() -> None:
    """Its body never ran: the failure says so (``not_applied``), so the next attempt, if any,
    is not in doubt."""
    from datetime import UTC, datetime

    runner = StepRunner(app, threads=1)
    try:
        long = Call(runner, task("slow", "long"))
        eventually(lambda: started("long"), what="the long attempt to start")
        late = task("quick", "late", run="r2")
        deadline = datetime.now(UTC) + timedelta(milliseconds=300)
        late.payload["schedule_deadline"] = deadline.isoformat()
        reply = runner.run(late)
        assert reply.outcome == "failed" and not started("late")
        assert reply.error["type"] == "StepTimeoutError" and reply.error["not_applied"]
        release.set()
        assert long.result().outcome == "completed"
    finally:
        runner.close()
