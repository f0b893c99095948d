"""The internal payloads as typed models (issue 24): the JSON on the wire is what the engine
and the worker wrote by hand before, key for key and byte for byte."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.contract import DO, UNDO, Direction
from sagaloop.engine.history import NewEvent
from sagaloop.engine.messages import (
    ChildResult,
    ChildStart,
    Envelope,
    Outcome,
    StepReply,
    StepTask,
    TimerKind,
    TimerPayload,
    UndoRun,
    step_result,
)
from sagaloop.engine.ports import RunRecord, Timer
from sagaloop.errors import MessageError
from sagaloop.store.sql import SqlStore

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def wire(payload: dict[str, Any]) -> bytes:
    env = Envelope(type="step", message_id="m", run_id="r", payload=payload, created_at=NOW)
    return env.to_bytes()


@pytest.mark.parametrize(
    ("task", "before"),
    [
        (
            StepTask(step="s", direction=DO, args={"a": 1}, in_doubt=False),
            {"step": "s", "direction": "do", "args": {"a": 1}, "in_doubt": False},
        ),
        (
            StepTask(
                step="s",
                direction=DO,
                args={},
                in_doubt=True,
                schedule_deadline=NOW + timedelta(seconds=1.5),
                force=True,
            ),
            {
                "step": "s",
                "direction": "do",
                "args": {},
                "in_doubt": True,
                "schedule_deadline": (NOW + timedelta(seconds=1.5)).isoformat(),
                "force": True,
            },
        ),
        (
            StepTask(step="s", direction=UNDO, args={"a": None}, in_doubt=False, result=None),
            {
                "step": "s",
                "direction": "undo",
                "args": {"a": None},
                "in_doubt": False,
                "result": None,
            },
        ),
    ],
)
def test_a_step_task_is_on_the_wire_as_the_dict_it_replaces(
    task: StepTask, before: dict[str, Any]
) -> None:
    assert task.to_payload() == before
    assert wire(task.to_payload()) == wire(before)
    assert json.dumps(task.to_payload()) == json.dumps(before)  # the same keys, in order
    assert StepTask.parse(Envelope.from_bytes(wire(before))) == task


@pytest.mark.parametrize(
    ("reply", "before"),
    [
        (
            StepReply(
                direction=DO, worker="w", outcome=Outcome.COMPLETED, result=None, took_s=0.25
            ),
            {
                "direction": "do",
                "worker": "w",
                "outcome": "completed",
                "result": None,
                "took_s": 0.25,
            },
        ),
        (
            StepReply(
                direction=DO,
                worker="w",
                outcome=Outcome.COMPLETED,
                result=[1],
                reconciled=True,
                took_s=1,
            ),
            {
                "direction": "do",
                "worker": "w",
                "outcome": "completed",
                "result": [1],
                "reconciled": True,
                "took_s": 1,
            },
        ),
        (
            StepReply(
                direction=UNDO,
                worker="w",
                outcome=Outcome.COMPLETED,
                result=None,
                skipped=True,
                took_s=0.5,
            ),
            {
                "direction": "undo",
                "worker": "w",
                "outcome": "completed",
                "result": None,
                "skipped": True,
                "took_s": 0.5,
            },
        ),
        (
            StepReply(direction=DO, worker="w", outcome=Outcome.HALTED, error={"type": "InDoubt"}),
            {"direction": "do", "worker": "w", "outcome": "halted", "error": {"type": "InDoubt"}},
        ),
    ],
)
def test_a_step_reply_is_on_the_wire_as_the_dict_it_replaces(
    reply: StepReply, before: dict[str, Any]
) -> None:
    task = Envelope(type="step", message_id="m", run_id="r", position=1, attempt=1)
    assert reply.to_payload() == before
    typed, by_hand = step_result(task, reply, NOW), step_result(task, before, NOW)
    assert typed.to_bytes() == by_hand.to_bytes()
    assert json.dumps(reply.to_payload()) == json.dumps(before)  # stored in the inbox so
    assert StepReply.parse(by_hand) == reply


@pytest.mark.parametrize(
    "payload",
    [
        {"outcome": "done"},
        {"outcome": "halted"},
        {"outcome": "failed", "error": "boom"},
        {"outcome": "completed", "reconciled": {"x": 1}},
        {"outcome": "completed", "took_s": "long"},
    ],
)
def test_a_malformed_reply_is_a_message_error(payload: dict[str, Any]) -> None:
    with pytest.raises(MessageError, match="invalid step_result payload"):
        StepReply.parse(Envelope(type="step_result", run_id="r", payload=payload))


@pytest.mark.parametrize(
    ("payload", "before"),
    [
        (TimerPayload(kind="retry"), {"kind": "retry"}),
        (ChildStart(input={"n": 1}, parent="p"), {"input": {"n": 1}, "parent": "p"}),
        (ChildStart(input=None, parent="p"), {"input": None, "parent": "p"}),
        (
            ChildResult(child="c", status="completed", output=[1], error=None),
            {"child": "c", "status": "completed", "output": [1], "error": None},
        ),
        (UndoRun(parent="p", position=3), {"parent": "p", "position": 3}),
    ],
)
def test_the_other_internal_payloads_are_on_the_wire_as_the_dicts_they_replace(
    payload: TimerPayload | ChildStart | ChildResult | UndoRun, before: dict[str, Any]
) -> None:
    assert payload.to_payload() == before
    assert wire(payload.to_payload()) == wire(before)
    assert json.dumps(payload.to_payload()) == json.dumps(before)
    env = Envelope(type="timer", run_id="r", payload=before)
    assert type(payload).parse(env) == payload


@pytest.mark.parametrize(
    ("model", "payload"),
    [
        (TimerPayload, {}),
        (ChildStart, {"input": 1}),
        (ChildResult, {"child": 7, "status": "failed"}),
        (ChildResult, {"child": "c", "error": "boom"}),
        (UndoRun, {"parent": "p", "position": "third"}),
    ],
)
def test_a_malformed_internal_payload_is_a_message_error(
    model: type[TimerPayload | ChildStart | ChildResult | UndoRun], payload: dict[str, Any]
) -> None:
    with pytest.raises(MessageError, match="invalid child_start payload"):
        model.parse(Envelope(type="child_start", run_id="r", payload=payload))


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlStore]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'enums.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    store = SqlStore(url)
    store.upgrade()
    try:
        yield store
    finally:
        store.close()


def test_the_str_enums_are_stored_and_read_back_as_plain_strings(store: SqlStore) -> None:
    run_id = f"enums-{uuid.uuid4().hex}"
    run = RunRecord(run_id, run_id, "saga", s.RunStatus.RUNNING, None, NOW, NOW)  # its own app
    data = {"status": s.FAILED, "direction": Direction.UNDO, "outcome": Outcome.HALTED}
    with store.transaction() as tx:
        assert store.create_run(tx, run)
        store.append_events(tx, run_id, 0, [NewEvent(h.EventKind.RUN_FINISHED, data=data)], NOW)
        store.save_run(tx, dataclasses.replace(run, status=s.RunStatus.COMPENSATED, last_seq=1))
    stored = store.get_run(run_id)
    assert stored is not None and type(stored.status) is str and stored.status == "compensated"
    [event] = store.load_history(None, run_id)
    assert type(event.kind) is str and event.kind == "run_finished"
    assert event.data == {"status": "failed", "direction": "undo", "outcome": "halted"}
    assert all(type(value) is str for value in event.data.values())
    assert store.count_runs(app=run_id) == {"compensated": 1}
    with store.transaction() as tx:
        store.add_timer(tx, Timer(run_id, 1, TimerKind.UNDO_RETRY, NOW, 2))
    with store.transaction() as tx:
        [timer] = store.take_due_timers(tx, NOW, 10, app=run_id)
    assert type(timer.kind) is str and timer.kind == "undo_retry"
