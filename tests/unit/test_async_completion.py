"""Steps completed from outside (Temporal's async activity completion): a step's body hands its
attempt to an outside system with ``ctx.complete_async()``; the client completes or fails it
later with the attempt's ``ctx.task_token``; the step's timeout fails an attempt still handed
off, and a retry hands off again with a new token."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from pydantic import BaseModel

from sagaloop import (
    App,
    CompleteAsync,
    RetryPolicy,
    SagaContext,
    SagaFailedError,
    StepAttemptGoneError,
    StepCancelled,
    StepContext,
    ValidationError,
)
from sagaloop.cli import main
from sagaloop.engine import history as h
from sagaloop.engine.handoff import TaskToken
from sagaloop.engine.messages import step_queue
from sagaloop.engine.transport import Delivery
from sagaloop.testing import Harness, VirtualClock, history_to_json, replay

app = App("async-completion")
tokens: list[str] = []
bodies: list[int] = []


class Receipt(BaseModel):
    code: str


@app.step(retry=RetryPolicy(max_attempts=3, initial_interval=timedelta(seconds=1)))
def ask_outside(ctx: StepContext, what: str) -> Receipt:
    bodies.append(ctx.attempt)
    tokens.append(ctx.task_token)
    ctx.complete_async()


@app.step(
    timeout=timedelta(seconds=10),
    heartbeat_timeout=timedelta(seconds=2),
    retry=RetryPolicy(max_attempts=2, initial_interval=timedelta(seconds=1)),
)
def ask_with_timeout(ctx: StepContext, what: str) -> str:
    bodies.append(ctx.attempt)
    tokens.append(ctx.task_token)
    ctx.complete_async()


@app.step(transactional=True, retry=RetryPolicy(max_attempts=1))
def in_transaction(ctx: StepContext, what: str) -> str:
    ctx.complete_async()  # refused: its writes commit with its outcome


@app.step(local=True)
def local_outside(ctx: StepContext, what: str) -> str:
    tokens.append(ctx.task_token)
    ctx.complete_async()


@app.saga()
async def transactional_hands_off(ctx: SagaContext, what: str) -> str:
    return await ctx.call(in_transaction, what)


@app.saga()
async def local_hands_off(ctx: SagaContext, what: str) -> str:
    return await ctx.call(local_outside, what)


@app.step()
def plain(ctx: StepContext, what: str) -> str:
    return what


@plain.compensation
def unplain(ctx: StepContext, what: str, result: str) -> None:
    ctx.complete_async()  # refused: a compensation cannot be handed off


@app.step()
def completes_itself(ctx: StepContext, what: str) -> str:
    """The outside system acts on the token before the hand-off reaches the engine."""
    tokens.append(ctx.task_token)
    assert outside_client is not None
    outside_client.complete_step(ctx.task_token, f"{what} at once")
    outside_client.heartbeat_step(ctx.task_token)  # before the hand-off too: taken as one
    ctx.complete_async()


outside_client: Any = None


@app.saga()
async def quick_outside(ctx: SagaContext, what: str) -> str:
    return await ctx.call(completes_itself, what)


@app.saga()
async def outside(ctx: SagaContext, what: str) -> str:
    receipt = await ctx.call(ask_outside, what)
    return receipt.code


@app.saga()
async def outside_timed(ctx: SagaContext, what: str) -> str:
    return await ctx.call(ask_with_timeout, what)


@app.saga()
async def undo_hands_off(ctx: SagaContext, what: str) -> str:
    await ctx.call(plain, what)
    raise RuntimeError("fail, so that plain is compensated")


@pytest.fixture
def harness() -> Iterator[Harness]:
    tokens.clear()
    bodies.clear()
    harness = Harness(app)
    yield harness
    harness.close()


def kinds(harness: Harness, run_id: str) -> list[str]:
    return [e.kind for e in harness.history(run_id)]


def test_a_handed_off_step_waits_until_the_client_completes_it(harness: Harness) -> None:
    run_id = harness.start(outside, "refund")
    harness.run_until_idle()
    assert harness.get(run_id).status == "running"
    assert bodies == [1] and len(tokens) == 1
    assert TaskToken.decode(tokens[0]) == TaskToken(app.name, run_id, 0, 1)
    assert h.STEP_HANDED_OFF in kinds(harness, run_id)
    waiting = " ".join(harness.status(run_id).waiting_for)
    assert f"to be completed from outside (task token {tokens[0]})" in waiting
    assert harness.status(run_id).steps[0].state == "handed off"

    harness.client.complete_step(tokens[0], Receipt(code="R-1"))
    harness.run_until_idle()
    assert harness.result(run_id) == "R-1"
    assert bodies == [1]  # the body ran once


def test_a_failure_from_outside_is_retried_with_a_new_token(harness: Harness) -> None:
    run_id = harness.start(outside, "refund")
    harness.run_until_idle()
    harness.client.fail_step(tokens[0], "the outside system said no")
    harness.run_until_idle()
    assert bodies == [1, 2] and len(set(tokens)) == 2  # the body ran again: a new token
    with pytest.raises(StepAttemptGoneError, match="attempt 2"):
        harness.client.complete_step(tokens[0], {"code": "late"})
    harness.client.complete_step(tokens[1], {"code": "R-2"})  # JSON, converted by the step
    harness.run_until_idle()
    assert harness.result(run_id) == "R-2"


def test_a_non_retryable_failure_from_outside_fails_the_run(harness: Harness) -> None:
    run_id = harness.start(outside, "refund")
    harness.run_until_idle()
    harness.client.fail_step(tokens[0], "refused for good", non_retryable=True)
    harness.run_until_idle()
    assert bodies == [1]
    with pytest.raises(SagaFailedError, match="refused for good"):
        harness.result(run_id)


def test_an_attempt_not_completed_in_time_fails_in_doubt_and_is_retried(harness: Harness) -> None:
    run_id = harness.start(outside_timed, "refund")
    harness.run_until_idle(skip_time=False)
    assert bodies == [1]
    harness.advance(timedelta(seconds=1))
    harness.client.heartbeat_step(tokens[0], {"progress": 50})  # the heartbeat_timeout restarts
    harness.advance(timedelta(seconds=1.5))  # 2.5 s after the hand-off: alive thanks to it
    assert bodies == [1]
    harness.advance(timedelta(seconds=2))  # 2 s after the heartbeat: timed out, retried 1 s later
    assert bodies == [1, 2]  # retried after 1 s: the body ran again, handing off anew
    events = harness.history(run_id)
    retrying = next(e for e in events if e.kind == h.STEP_RETRYING)
    assert retrying.data["error"]["type"] == "StepTimeoutError"
    assert retrying.data["in_doubt"] is True
    assert next(e for e in events if e.kind == h.STEP_HEARTBEAT).data["details"] == {"progress": 50}
    with pytest.raises(StepAttemptGoneError, match="timed out or was retried"):
        harness.client.complete_step(tokens[0], "too late")
    harness.client.complete_step(tokens[1], "done")
    harness.run_until_idle(skip_time=False)
    assert harness.result(run_id) == "done"


def test_the_timeout_counts_from_the_attempts_start(harness: Harness) -> None:
    run_id = harness.start(outside_timed, "refund")
    harness.run_until_idle(skip_time=False)
    for _ in range(9):  # heartbeats keep it alive, but not past its 10 s timeout
        harness.client.heartbeat_step(tokens[0])
        harness.advance(timedelta(seconds=1))
    assert len(bodies) == 1
    harness.advance(timedelta(seconds=2.5))  # 10 s from its start (1.5 s from its last beat)
    assert len(bodies) == 2
    error = next(e for e in harness.history(run_id) if e.kind == h.STEP_RETRYING).data["error"]
    assert "within its timeout of 0:00:10" in error["message"]


def test_a_repeated_completion_is_taken_once(harness: Harness) -> None:
    run_id = harness.start(outside, "refund")
    harness.run_until_idle()
    harness.client.complete_step(tokens[0], Receipt(code="first"))
    harness.client.complete_step(tokens[0], Receipt(code="first"))  # not taken yet: sent again
    harness.run_until_idle()
    assert harness.result(run_id) == "first"
    assert kinds(harness, run_id).count(h.STEP_COMPLETED) == 1
    with pytest.raises(StepAttemptGoneError, match="its run is completed"):
        harness.client.complete_step(tokens[0], Receipt(code="again"))


def test_a_late_completion_that_races_a_timeout_is_ignored(harness: Harness) -> None:
    run_id = harness.start(outside_timed, "refund")
    harness.run_until_idle(skip_time=False)
    harness.clock.advance(timedelta(seconds=3))
    assert harness.timers.fire_due() == 1  # the heartbeat_timeout's timer is queued...
    harness.client.complete_step(tokens[0], "late")  # ...and the completion after it
    harness.run_until_idle(skip_time=False)
    events = harness.history(run_id)
    assert [e.kind for e in events].count(h.STEP_COMPLETED) == 0  # the timeout won
    assert [e for e in events if e.kind == h.STEP_RETRYING]
    harness.advance(timedelta(seconds=1))
    assert bodies == [1, 2]
    harness.client.complete_step(tokens[1], "in time")
    harness.run_until_idle(skip_time=False)
    assert harness.result(run_id) == "in time"


def test_a_cancelled_run_refuses_a_completion(harness: Harness) -> None:
    run_id = harness.start(outside, "refund")
    harness.run_until_idle()
    harness.cancel(run_id)
    harness.run_until_idle()
    assert harness.get(run_id).status == "compensating"  # its step in flight is handed off
    with pytest.raises(StepCancelled, match="being cancelled"):
        harness.client.heartbeat_step(tokens[0])  # how the outside system learns it
    harness.client.fail_step(tokens[0], "stopped: the run is cancelled")
    harness.run_until_idle()
    assert harness.get(run_id).status == "cancelled"
    with pytest.raises(StepAttemptGoneError, match="cancelled"):
        harness.client.complete_step(tokens[0], Receipt(code="late"))


def test_a_compensation_cannot_hand_off(harness: Harness) -> None:
    run_id = harness.start(undo_hands_off, "x")
    harness.run_until_idle()
    assert harness.get(run_id).status == "needs_attention"
    failed = next(e for e in harness.history(run_id) if e.kind == h.COMPENSATION_FAILED)
    assert "complete_async() is for the body" in failed.data["error"]["message"]


def test_a_token_that_is_not_one_is_refused(harness: Harness) -> None:
    with pytest.raises(ValidationError, match="not a sagaloop task token"):
        harness.client.complete_step("not-a-token")


def test_complete_async_is_a_base_exception() -> None:
    """So that a step's ``except Exception`` does not swallow it, as Temporal's."""
    assert not issubclass(CompleteAsync, Exception)


def test_a_handed_off_history_replays(harness: Harness) -> None:
    run_id = harness.start(outside, "refund")
    harness.run_until_idle()
    harness.client.fail_step(tokens[0], "no")
    harness.run_until_idle()
    harness.client.complete_step(tokens[1], Receipt(code="R"))
    harness.run_until_idle()
    exported: Any = history_to_json(harness.history(run_id))
    replay(app, exported, run_id=run_id)


def test_a_completion_before_the_hand_off_is_recorded_is_taken(harness: Harness) -> None:
    global outside_client
    outside_client = harness.client
    try:
        run_id = harness.start(quick_outside, "paid")
        harness.run_until_idle()
    finally:
        outside_client = None
    assert harness.result(run_id) == "paid at once"
    kinds_seen = kinds(harness, run_id)
    assert kinds_seen.count(h.STEP_COMPLETED) == 1, kinds_seen


def test_a_transactional_step_cannot_hand_off(harness: Harness) -> None:
    run_id = harness.start(transactional_hands_off, "x")
    harness.run_until_idle()
    with pytest.raises(SagaFailedError, match="complete_async\\(\\) is for the body"):
        harness.result(run_id)


def test_an_in_process_step_hands_off_too(harness: Harness) -> None:
    run_id = harness.start(local_hands_off, "x")
    harness.run_until_idle()
    assert h.STEP_HANDED_OFF in kinds(harness, run_id)
    harness.client.complete_step(tokens[0], "done outside")
    harness.run_until_idle()
    assert harness.result(run_id) == "done outside"


def test_a_redelivered_task_does_not_run_the_body_again(harness: Harness) -> None:
    """The worker's inbox stores the ``handed_off`` reply like any other: a copy of the task
    (a relay that published it twice) gets that reply again, and hands off nothing new."""
    first: list[bytes] = []

    def keep(role: str, delivery: Delivery) -> None:
        if role == "worker":
            first.append(delivery.body)

    harness.crash_hook = keep
    run_id = harness.start(outside, "refund")
    harness.run_until_idle()
    harness.broker.publish_raw(step_queue(app.name, ask_outside.queue), first[0], trusted=True)  # type: ignore[attr-defined]
    harness.run_until_idle()
    assert len(first) == 2, "the copy was delivered to the worker"
    assert bodies == [1] and len(tokens) == 1
    assert kinds(harness, run_id).count(h.STEP_HANDED_OFF) == 1
    harness.client.complete_step(tokens[0], Receipt(code="once"))
    harness.run_until_idle()
    assert harness.result(run_id) == "once"


def test_the_cli_fails_and_completes_by_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens.clear()
    bodies.clear()
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", url)
    # the CLI's messages are stamped with the real time: the harness's clock starts there
    harness = Harness(app, url=url, clock=VirtualClock(datetime.now(UTC)))
    try:
        run_id = harness.start(outside, "refund")
        harness.run_until_idle(skip_time=False)

        def cli(*args: str) -> Result:
            return CliRunner().invoke(main.cli, ["complete-step", *args], catch_exceptions=False)

        both = cli(tokens[0], "--result", "1", "--fail", "no")
        assert both.exit_code != 0 and "not both" in both.output
        alone = cli(tokens[0], "--non-retryable")
        assert alone.exit_code != 0 and "goes with --fail" in alone.output
        bad = cli("nonsense!")
        assert bad.exit_code != 0 and "not a sagaloop task token" in bad.output
        failed = cli(tokens[0], "--fail", "the partner refused")
        assert failed.exit_code == 0, failed.output
        harness.run_until_idle()  # the retry, 1 s later: a new attempt hands off again
        assert bodies == [1, 2]
        done = cli(tokens[1], "--result", '{"code": "from the shell"}')
        assert done.exit_code == 0, done.output
        harness.run_until_idle()
        assert harness.result(run_id) == "from the shell"
        late = cli(tokens[0], "--result", '{"code": "late"}')
        assert late.exit_code != 0 and "no longer waits" in late.output
    finally:
        harness.close()
