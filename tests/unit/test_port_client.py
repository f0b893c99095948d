"""Client and Harness primitives that workflows ported from other engines need (issue 25):
a blocking read of a published value (``Client.wait_published``, ``Harness.wait_published``)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from sagaloop import App, RunFinishedError, SagaContext, ValidationError
from sagaloop.client import NotPublishedError
from sagaloop.client.polling import MAX_POLL, Pending, poll_until
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
    from sagaloop import RunNotFoundError

    with pytest.raises(RunNotFoundError):
        env.client.wait_published("no-such-run", "done", timeout=0)


def test_wait_published_wakes_a_waiting_reader_in_another_thread() -> None:
    """The blocking form: a reader polls the store while the run, stepped on another thread,
    publishes. It returns once the value is there, not at its timeout."""
    env = Harness(app)
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
