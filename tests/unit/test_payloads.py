"""Large payloads (issue 10, defect 6): a step result or argument over the message limit (an
LLM transcript) used to be dead-lettered by the engine's consumer, and its run waited for ever.
Values over the threshold now travel by reference to the payload table; messages, history,
run and inbox rows stay small; a value over the hard limit fails whoever produced it."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from sagaloop import App, RetryPolicy, SagaContext, StepContext
from sagaloop.engine.history import NewEvent
from sagaloop.engine.messages import MAX_MESSAGE_BYTES, Envelope
from sagaloop.engine.ports import Outgoing, RunRecord
from sagaloop.errors import MessageError
from sagaloop.sagas.convert import MAX_VALUE_BYTES
from sagaloop.store.payloads import MARK, OFFLOAD_BYTES
from sagaloop.store.sql import SqlStore
from sagaloop.testing.harness import Harness

MiB = 1024 * 1024
SMALL = OFFLOAD_BYTES + 2048  # what a row or body holding a reference must stay under
ONCE = RetryPolicy(max_attempts=1)

app = App("payloads")


def text_of(n: int) -> str:
    """``n`` characters of transcript-like text (not one repeated byte), some not ASCII."""
    line = "user: où est ma commande 7? assistant: elle arrive demain ✓\n"
    return (line * (n // len(line) + 1))[:n]


@app.step(queue="q")
def transcript(ctx: StepContext, n: int) -> str:
    return text_of(n)


@app.step(queue="q")
def measure(ctx: StepContext, text: str) -> int:
    return len(text)


@app.step(queue="q")
def echo(ctx: StepContext, value: Any) -> Any:
    return value


@app.step(queue="q", retry=ONCE)
def flood(ctx: StepContext, n: int) -> str:
    return "x" * n


@app.saga(name="agent")
async def agent(ctx: SagaContext, n: int) -> list[int]:
    """A 3 MiB step result, then a 2 MiB step argument."""
    text = await ctx.call(transcript, n)
    return [len(text), await ctx.call(measure, text[: 2 * MiB])]


@app.saga(name="patient")
async def patient(ctx: SagaContext, n: int) -> int:
    text = await ctx.call(transcript, n)
    await ctx.wait_for_event("go")
    return await ctx.call(measure, text) + len(text)


@app.saga(name="mirror")
async def mirror(ctx: SagaContext, value: Any) -> Any:
    got = await ctx.call(echo, value)
    assert await ctx.wait_for_event("data") == value == got
    return got


@app.saga(name="overflow")
async def overflow(ctx: SagaContext, n: int) -> int:
    return len(await ctx.call(flood, n))


@app.saga(name="oversend")
async def oversend(ctx: SagaContext, n: int) -> int:
    return await ctx.call(measure, "y" * n)


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture(params=["database", "memory"])
def h(request: pytest.FixtureRequest) -> Iterator[Harness]:
    harness = Harness(app, broker=request.param)
    yield harness
    harness.close()


def scalar(store: SqlStore, sql: str) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text(sql)).scalar() or 0)


def drive(h: Harness, max_steps: int = 2000) -> int:
    """Process until idle; the largest outbox body seen after any step."""
    largest = 0
    for _ in range(max_steps):
        work = h.step_once()
        body = "select max(length(body)) from sagaloop_outbox"
        largest = max(largest, scalar(h.store, body))
        if not work:
            return largest
    raise AssertionError(f"still busy after {max_steps} steps")


def largest_rows(store: SqlStore) -> dict[str, int]:
    """The longest stored JSON text of every column that holds values."""
    return {
        column: scalar(store, f"select max(length({column})) from sagaloop_{table}")
        for table, column in [
            ("history", "data"),
            ("runs", "input"),
            ("runs", "output"),
            ("inbox", "result"),
        ]
    }


@contextlib.contextmanager
def statements(store: SqlStore) -> Iterator[collections.Counter[str]]:
    """Count the statements that touch the payload table, by kind (SELECT, INSERT...)."""
    counts: collections.Counter[str] = collections.Counter()

    def seen(conn: Any, cursor: Any, sql: str, *args: Any) -> None:
        counts["all"] += 1
        if "sagaloop_payloads" in sql:
            counts[sql.split()[0].upper()] += 1

    event.listen(store.engine, "before_cursor_execute", seen)
    try:
        yield counts
    finally:
        event.remove(store.engine, "before_cursor_execute", seen)


# --- regression: large values complete -------------------------------------------------------


def test_a_3_mib_result_and_a_2_mib_argument_complete_and_rows_stay_small(h: Harness) -> None:
    h.start(agent, 3 * MiB, run_id="big")
    largest_body = drive(h)
    run = h.get("big")
    assert (run.status, run.output) == ("completed", [3 * MiB, 2 * MiB]), run.error
    assert h.store.dead_letters() == []
    assert 0 < largest_body < SMALL, "a body holds a large value inline"
    assert all(n < SMALL for n in largest_rows(h.store).values()), largest_rows(h.store)
    # The result is in the payload table once, compressed; the argument (a prefix) once more.
    sizes = scalar(h.store, "select sum(size) from sagaloop_payloads where run_id = 'big'")
    stored = scalar(h.store, "select sum(length(data)) from sagaloop_payloads")
    assert sizes >= 5 * MiB and stored < sizes / 10
    results = {e.name: e.data["result"] for e in h.history("big") if e.kind == "step_completed"}
    assert results == {"transcript": text_of(3 * MiB), "measure": 2 * MiB}


def test_small_values_never_touch_the_payload_table(h: Harness) -> None:
    """No round trip is added on the hot path: not one statement on the payload table."""
    with statements(h.store) as counts:
        h.start(agent, 1000, run_id="small")
        drive(h)
        assert h.get("small").output == [1000, 1000]
        h.history("small")
    assert counts["all"] > 20 and set(counts) == {"all"}, counts


def test_replay_after_a_restart_loads_the_history_payloads_in_one_query() -> None:
    h = Harness(app)
    h.start(patient, 3 * MiB, run_id="replayed")
    drive(h)
    assert h.get("replayed").status == "waiting"
    h.restart()  # the engine's cache is gone: the next activation replays from the database
    with statements(h.store) as counts:
        events = h.store.load_history(None, "replayed")
    assert counts["SELECT"] == 1
    assert any(e.data.get("result") == text_of(3 * MiB) for e in events)
    h.send_event("replayed", "go")
    drive(h)
    assert (h.get("replayed").status, h.get("replayed").output) == ("completed", 6 * MiB)


# --- values that look like references --------------------------------------------------------

SHAPED = [
    {MARK: "payload", "sha256": "0" * 64, "size": 3},
    {MARK: "literal", "value": 1},
    {MARK: "something else", "and": [1, 2]},
    {MARK: "payload", "sha256": "0" * 64, "pad": "z" * (OFFLOAD_BYTES * 2)},  # large too
]


@pytest.mark.parametrize("value", SHAPED, ids=["ref", "literal", "other", "large"])
def test_a_user_value_shaped_like_a_reference_round_trips_unchanged(
    h: Harness, value: dict[str, Any]
) -> None:
    h.start(mirror, value, run_id="shaped")
    drive(h)
    h.send_event("shaped", "data", value)
    drive(h)
    run = h.get("shaped")
    assert (run.status, run.input, run.output) == ("completed", value, value), run.error
    events = h.history("shaped")
    assert [e.data["result"] for e in events if e.kind == "step_completed"] == [value]
    assert [e.data["data"] for e in events if e.kind == "event_arrived"] == [value]


# --- the hard limit --------------------------------------------------------------------------


def test_a_step_result_over_the_hard_limit_fails_the_step_and_the_run_ends() -> None:
    h = Harness(app)
    h.start(overflow, MAX_VALUE_BYTES + 1, run_id="flood")
    drive(h)
    run = h.get("flood")
    assert run.status in ("failed", "compensated"), run.status
    failures = [e for e in h.history("flood") if e.kind == "step_failed"]
    assert failures and str(MAX_VALUE_BYTES) in str(failures[-1].data), failures
    assert h.store.dead_letters() == []


def test_a_step_argument_over_the_hard_limit_fails_the_saga_and_the_run_ends() -> None:
    h = Harness(app)
    h.start(oversend, MAX_VALUE_BYTES + 1, run_id="oversend")
    drive(h)
    run = h.get("oversend")
    assert run.status in ("failed", "compensated"), run.status
    assert str(MAX_VALUE_BYTES) in str(run.error)


def test_a_body_over_the_message_limit_even_by_reference_is_refused_and_nothing_written() -> None:
    store = SqlStore("sqlite://")
    store.upgrade()
    many = {f"field{i}": "v" * 100 for i in range(MAX_MESSAGE_BYTES // 100)}  # none is large
    env = Envelope(type="step", run_id="r", payload=many)
    with (
        pytest.raises(MessageError, match=f"limit of {MAX_MESSAGE_BYTES}"),
        store.transaction() as tx,
    ):
        store.enqueue(tx, [Outgoing("q", env)], _now())
    assert store.queue_depths() == {}
    assert scalar(store, "select count(*) from sagaloop_payloads") == 0


# --- the store -------------------------------------------------------------------------------


def _now() -> Any:
    from datetime import UTC, datetime

    return datetime(2030, 1, 1, tzinfo=UTC)


def test_history_rows_hold_references_and_one_query_resolves_them_all() -> None:
    store = SqlStore("sqlite://")
    store.upgrade()
    now, big = _now(), [text_of(OFFLOAD_BYTES + i) for i in range(5)]
    with store.transaction() as tx:
        store.create_run(tx, RunRecord("r", "a", "s", "running", big[0], now, now))
        events = [NewEvent("step_completed", i, "s", {"result": v}) for i, v in enumerate(big)]
        store.append_events(tx, "r", 0, events, now)
    assert largest_rows(store)["data"] < 200 and largest_rows(store)["input"] < 200
    assert scalar(store, "select count(*) from sagaloop_payloads") == 5  # big[0] stored once
    with statements(store) as counts:
        loaded = store.load_history(None, "r")
    assert [e.data["result"] for e in loaded] == big and counts["SELECT"] == 1
    assert store.get_run("r") is not None and store.get_run("r").input == big[0]  # type: ignore[union-attr]


def test_prune_deletes_the_payloads_of_pruned_runs_and_inbox_rows() -> None:
    from datetime import timedelta

    store = SqlStore("sqlite://")
    store.upgrade()
    now, big = _now(), text_of(OFFLOAD_BYTES * 2)
    with store.transaction() as tx:
        for run_id, status in [("old", "completed"), ("live", "running")]:
            store.create_run(tx, RunRecord(run_id, "a", "s", status, big + run_id, now, now))
        store.inbox_put(tx, "worker", "m1", {"result": big}, now)
    assert store.inbox_get(None, "worker", "m1") == (True, {"result": big})
    assert scalar(store, "select count(*) from sagaloop_payloads") == 3
    store.prune(before=now + timedelta(seconds=1))
    owners = "select run_id from sagaloop_payloads"
    with store.engine.connect() as conn:
        assert [r for (r,) in conn.execute(sa.text(owners))] == ["live"]
    assert store.get_run("live").input == big + "live"  # type: ignore[union-attr]
