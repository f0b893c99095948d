"""client.schedules: the Python API that ``sagaloop schedule`` calls. Trigger and backfill
start each run once (per trigger id; per tick, whoever fires it), and refuse what they must."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from sagaloop import App, SagaContext
from sagaloop.client.schedules import BACKFILL_LIMIT
from sagaloop.sagas.schedules import InvalidSchedule
from sagaloop.store import migrations
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def make_app() -> App:
    app = App("api")

    @app.schedule(every=timedelta(minutes=5), input=1)
    @app.saga
    async def declared(ctx: SagaContext, n: int) -> int:
        return n

    @app.saga
    async def job(ctx: SagaContext, n: int = 0) -> int:
        return n * 10

    return app


def runs_of(env: Harness) -> list[str]:
    return sorted(r.run_id for r in env.client.list(limit=2000) if ":job:" in r.run_id)


def test_create_describe_and_fire() -> None:
    env = Harness(make_app())  # the clock starts at 2026-01-01T00:00:00 UTC
    info = env.client.schedules.create("job", "job", 2, cron="*/10 * * * *")
    assert info.next_ticks[:2] == [at("2026-01-01T00:10:00"), at("2026-01-01T00:20:00")]
    assert (info.spec, info.origin, info.paused) == ("*/10 * * * *", "cli", False)
    env.clock.advance(timedelta(minutes=10))
    env.run_until_idle()
    assert runs_of(env) == ["schedule:api:job:20260101T001000Z"]
    described = env.client.schedules.describe("job")
    assert described.last_run_id == "schedule:api:job:20260101T001000Z"
    assert described.last_tick == at("2026-01-01T00:10:00")
    assert [s.name for s in env.client.schedules.list()] == ["declared", "job"]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"cron": "* * *"}, "must have 5 fields"),
        ({}, "exactly one"),
        ({"cron": "* * * * *", "every": timedelta(minutes=1)}, "exactly one"),
        ({"every": timedelta(seconds=0)}, "at least 1"),
        ({"cron": "* * * * *", "catch_up": "never"}, "choose one of"),
    ],
)
def test_create_refuses_what_the_declaration_refuses(kwargs: dict, says: str) -> None:
    env = Harness(make_app())
    with pytest.raises(InvalidSchedule, match=says):
        env.client.schedules.create("job", "job", **kwargs)


def test_create_refuses_a_taken_name_and_an_unknown_saga() -> None:
    env = Harness(make_app())
    env.run_until_idle()  # writes the declared schedule
    with pytest.raises(InvalidSchedule, match="declared in the code"):
        env.client.schedules.create("declared", "job", every=timedelta(minutes=1))
    env.client.schedules.create("job", "job", 0, every=timedelta(minutes=1))
    with pytest.raises(InvalidSchedule, match="already has a schedule 'job'"):
        env.client.schedules.create("job", "job", 0, every=timedelta(minutes=2))
    with pytest.raises(InvalidSchedule, match="has no saga 'nope'"):
        env.client.schedules.create("other", "nope", 0, every=timedelta(minutes=2))


def test_trigger_is_idempotent_per_trigger_id() -> None:
    env = Harness(make_app())
    env.client.schedules.create("job", "job", 4, every=timedelta(hours=1))
    env.client.schedules.pause("job")  # a trigger starts a run of a paused schedule too
    first = env.client.schedules.trigger("job", trigger_id="t1")
    again = env.client.schedules.trigger("job", trigger_id="t1")
    other = env.client.schedules.trigger("job")
    assert first == again == "schedule:api:job:trigger:t1"
    assert other.startswith("schedule:api:job:trigger:") and other != first
    env.run_until_idle()
    assert runs_of(env) == sorted([first, other])
    assert env.result(first) == 40


def test_backfill_overlapping_fired_ticks_starts_nothing_twice() -> None:
    env = Harness(make_app())
    env.client.schedules.create("job", "job", 1, every=timedelta(minutes=5))
    env.clock.advance(timedelta(minutes=10))
    env.run_until_idle()  # fires 00:10 (catch_up latest: not 00:05)
    fired = runs_of(env)
    assert fired == ["schedule:api:job:20260101T001000Z"]
    ids = env.client.schedules.backfill("job", at("2026-01-01T00:00:00"), at("2026-01-01T00:10:00"))
    assert ids == [
        "schedule:api:job:20260101T000000Z",
        "schedule:api:job:20260101T000500Z",
        "schedule:api:job:20260101T001000Z",
    ]
    assert (
        env.client.schedules.backfill("job", at("2026-01-01T00:00:00"), at("2026-01-01T00:10:00"))
        == ids
    )
    env.run_until_idle()
    assert runs_of(env) == ids  # one run per tick: the fired one not again
    # a backfill ahead of the clock: the scheduler's own tick then starts nothing new
    ahead = env.client.schedules.backfill(
        "job", at("2026-01-01T00:15:00"), at("2026-01-01T00:15:00")
    )
    env.clock.advance(timedelta(minutes=5))
    env.run_until_idle()
    assert runs_of(env) == [*ids, *ahead]
    assert env.client.schedules.describe("job").last_run_id == ahead[0]


def test_backfill_refuses_too_many_ticks_and_a_backward_range() -> None:
    env = Harness(make_app())
    env.client.schedules.create("job", "job", 0, every=timedelta(seconds=1))
    start = at("2025-12-31T00:00:00")
    with pytest.raises(InvalidSchedule, match=f"more than {BACKFILL_LIMIT} ticks"):
        env.client.schedules.backfill("job", start, start + timedelta(seconds=BACKFILL_LIMIT))
    with pytest.raises(InvalidSchedule, match="before the start"):
        env.client.schedules.backfill("job", start, start - timedelta(seconds=1))
    env.run_until_idle()
    assert runs_of(env) == []  # refused before any run started
    ok = env.client.schedules.backfill("job", start, start + timedelta(seconds=BACKFILL_LIMIT - 1))
    assert len(ok) == BACKFILL_LIMIT


def test_update_spec_moves_the_next_tick_and_input_applies_next() -> None:
    env = Harness(make_app())
    env.client.schedules.create("job", "job", 1, every=timedelta(minutes=5))
    env.clock.advance(timedelta(minutes=2))
    same = env.client.schedules.update("job", input=7)
    assert same.next_ticks[0] == at("2026-01-01T00:05:00") and same.input == 7
    changed = env.client.schedules.update("job", cron="0 * * * *")
    assert changed.spec == "0 * * * *" and changed.next_ticks[0] == at("2026-01-01T01:00:00")
    env.clock.advance(timedelta(minutes=58))
    env.run_until_idle()
    assert runs_of(env) == ["schedule:api:job:20260101T010000Z"]  # 00:05..00:55 of old spec: none
    assert env.result("schedule:api:job:20260101T010000Z") == 70
    with pytest.raises(InvalidSchedule, match="must have 5 fields"):
        env.client.schedules.update("job", cron="bad")
    with pytest.raises(InvalidSchedule, match="not a valid int"):
        env.client.schedules.update("job", input="ten")
    assert env.client.schedules.describe("job").input == 7  # a refused update changed nothing
    with pytest.raises(InvalidSchedule, match="change it there"):
        env.client.schedules.update("declared", input=2)


def test_pause_resume_delete() -> None:
    env = Harness(make_app())
    env.run_until_idle()
    env.client.schedules.create("job", "job", 0, every=timedelta(minutes=5))
    env.client.schedules.pause("job")
    assert env.client.schedules.describe("job").next_ticks == []
    env.clock.advance(timedelta(minutes=30))
    env.run_until_idle()
    assert runs_of(env) == []
    env.client.schedules.resume("job")
    assert env.client.schedules.describe("job").next_ticks[0] == at("2026-01-01T00:35:00")
    with pytest.raises(InvalidSchedule, match="pause it"):
        env.client.schedules.delete("declared")
    env.client.schedules.delete("job")
    with pytest.raises(InvalidSchedule, match="no schedule 'job'"):
        env.client.schedules.describe("job")


def test_pause_keeps_a_note_that_describe_tells_and_resume_clears() -> None:
    env = Harness(make_app())
    info = env.client.schedules.create("job", "job", 0, every=timedelta(minutes=5), note="first")
    assert info.note == "first"
    env.client.schedules.pause("job", note="the upstream API is down")
    assert env.client.schedules.describe("job").note == "the upstream API is down"
    env.client.schedules.resume("job")
    assert env.client.schedules.describe("job").note is None


def test_a_version_10_database_gets_the_note_column(tmp_path: Path) -> None:
    store = SqlStore(f"sqlite:///{tmp_path / 'v10.db'}")
    try:
        store.upgrade()
        with store.engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE sagaloop_schedules DROP COLUMN note"))
            conn.execute(sa.text("UPDATE sagaloop_schema SET version = 10"))
        assert store.upgrade() == (10, migrations.LATEST)
        columns = {c["name"] for c in sa.inspect(store.engine).get_columns("sagaloop_schedules")}
        assert "note" in columns
    finally:
        store.close()
