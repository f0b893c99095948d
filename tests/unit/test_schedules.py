"""Schedules (issue 25): a cron parser in UTC, declared schedules fired by the harness's
virtual clock, exactly one run per tick across engines, and the catch-up policies."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sagaloop import App, DeclarationError, SagaContext
from sagaloop.runtime.schedules import Scheduler
from sagaloop.sagas.schedules import (
    CATCH_UP_LIMIT,
    Cron,
    Every,
    InvalidSchedule,
    tick_run_id,
)
from sagaloop.testing import Harness
from sagaloop.testing.harness import VirtualClock


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


# --- cron parsing ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "after", "expected"),
    [
        ("*/5 * * * *", "2026-01-01T00:00:00", "2026-01-01T00:05:00"),
        ("*/5 * * * *", "2026-01-01T00:03:59", "2026-01-01T00:05:00"),
        ("0 * * * *", "2026-01-01T00:00:00", "2026-01-01T01:00:00"),
        ("30 6 * * mon-fri", "2026-01-02T07:00:00", "2026-01-05T06:30:00"),  # Fri -> Mon
        ("0 0 29 feb *", "2026-01-01T00:00:00", "2028-02-29T00:00:00"),
        ("0 12 1 */3 *", "2026-02-10T00:00:00", "2026-04-01T12:00:00"),
        ("15,45 9-10 * * *", "2026-01-01T09:46:00", "2026-01-01T10:15:00"),
        ("0 0 * * 7", "2026-01-01T00:00:00", "2026-01-04T00:00:00"),  # 7 is Sunday too
        # both days restricted: either matches (the 13th, or a Friday)
        ("0 0 13 * fri", "2026-01-01T00:00:00", "2026-01-02T00:00:00"),
        ("@daily", "2026-12-31T23:59:00", "2027-01-01T00:00:00"),
        ("5/20 * * * *", "2026-01-01T00:26:00", "2026-01-01T00:45:00"),
        ("59 23 31 dec *", "2026-12-31T23:59:00", "2027-12-31T23:59:00"),
    ],
)
def test_cron_next_tick(expr: str, after: str, expected: str) -> None:
    assert Cron.parse(expr).next_after(at(after)) == at(expected)


@pytest.mark.parametrize(
    ("expr", "says"),
    [
        ("* * * *", "5 fields"),
        ("60 * * * *", "minute 60 is not within 0-59"),
        ("* 24 * * *", "hour 24"),
        ("* * 0 * *", "day of month 0"),
        ("* * * 13 *", "month 13"),
        ("* * * * 8", "day of week 8"),
        ("*/0 * * * *", "at least 1"),
        ("5-1 * * * *", "goes backwards"),
        ("* * * foo *", "'foo' is not a valid month"),
        ("0 0 30 2 *", "never fires"),
        ("1,,2 * * * *", "not a valid minute"),
    ],
)
def test_bad_cron_is_refused_at_declaration(expr: str, says: str) -> None:
    app = App("bad")

    @app.saga
    async def job(ctx: SagaContext) -> None:
        return None

    with pytest.raises(InvalidSchedule, match=says) as e:
        app.schedule(expr)
    assert isinstance(e.value, DeclarationError) and isinstance(e.value, ValueError)


def test_bad_declarations_are_refused() -> None:
    app = App("bad")

    @app.saga
    async def job(ctx: SagaContext, n: int) -> int:
        return n

    with pytest.raises(InvalidSchedule, match="exactly one"):
        app.schedule("* * * * *", every=timedelta(minutes=1))
    with pytest.raises(InvalidSchedule, match="exactly one"):
        app.schedule()
    with pytest.raises(InvalidSchedule, match="whole seconds"):
        app.schedule(every=timedelta(milliseconds=500))
    with pytest.raises(InvalidSchedule, match="catch_up='sometimes'"):
        app.schedule(every=timedelta(seconds=5), catch_up="sometimes")
    with pytest.raises(InvalidSchedule, match="input of schedule 'job'"):
        app.schedule(every=timedelta(seconds=5), input="not a number")(job)
    with pytest.raises(InvalidSchedule, match=r"above @app\.saga"):
        app.schedule(every=timedelta(seconds=5))(App("other").saga(job.fn))
    app.schedule(every=timedelta(seconds=5), input=1)(job)
    with pytest.raises(InvalidSchedule, match="already declared"):
        app.schedule(every=timedelta(seconds=5), input=2)(job)
    app.schedule(every=timedelta(seconds=7), input=2, name="job.other")(job)
    assert sorted(app.schedules) == ["job", "job.other"]


def test_every_ticks_at_multiples_since_the_epoch() -> None:
    every = Every(timedelta(minutes=10))
    assert every.next_after(at("2026-01-01T00:07:30")) == at("2026-01-01T00:10:00")
    assert every.next_after(at("2026-01-01T00:10:00")) == at("2026-01-01T00:20:00")


def test_tick_run_id_is_bounded() -> None:
    tick = at("2026-01-01T00:05:00")
    assert tick_run_id("a", "s", tick) == "schedule:a:s:20260101T000500Z"
    long = tick_run_id("a" * 200, "s" * 200, tick)
    assert len(long) <= 200 and long.endswith(":20260101T000500Z")


# --- firing ----------------------------------------------------------------------------------


def scheduled_app(catch_up: str = "latest", **every: Any) -> App:
    app = App("sched")

    @app.schedule(every=timedelta(**(every or {"minutes": 5})), input=3, catch_up=catch_up)
    @app.saga
    async def tick(ctx: SagaContext, n: int) -> int:
        return n * 2

    return app


def runs_of(env: Harness) -> list[str]:
    return sorted(r.run_id for r in env.client.list(limit=1000))


def test_declared_schedule_starts_one_run_per_tick() -> None:
    env = Harness(scheduled_app())  # the clock starts at 2026-01-01T00:00:00 UTC
    env.run_until_idle()
    assert runs_of(env) == []  # the first tick is the next one: 00:05
    for _ in range(3):
        env.clock.advance(timedelta(minutes=5))
        env.run_until_idle()
    assert runs_of(env) == [
        "schedule:sched:tick:20260101T000500Z",
        "schedule:sched:tick:20260101T001000Z",
        "schedule:sched:tick:20260101T001500Z",
    ]
    assert all(env.result(r) == 6 for r in runs_of(env))
    (row,) = env.store.list_schedules("sched")
    assert row.next_tick == at("2026-01-01T00:20:00")
    assert row.last_run_id == "schedule:sched:tick:20260101T001500Z"


def test_two_engines_firing_the_same_tick_start_one_run() -> None:
    app = scheduled_app()
    env = Harness(app)
    other = Scheduler(app, env.store, env.clock)  # a second engine on the same database
    env.run_until_idle()
    env.clock.advance(timedelta(minutes=5))
    due = env.store.due_schedules("sched", env.clock.now())
    assert len(due) == 1
    # Both start the tick's run before either moves the next tick on: the store refuses a
    # second run of that id, and only one compare-and-set of the next tick wins.
    first = env.parts.schedules
    assert first is not None
    assert first._fire(due[0], env.clock.now()) == 1
    assert other._fire(due[0], env.clock.now()) == 0
    assert other.fire_due() == 0  # nothing is due any more
    env.run_until_idle()
    (run_id,) = runs_of(env)
    started = [e for e in env.history(run_id) if e.kind == "run_started"]
    assert len(started) == 1 and env.result(run_id) == 6


def test_an_engine_that_dies_before_moving_the_tick_on_leaves_it_to_the_next() -> None:
    app = scheduled_app()
    env = Harness(app)
    env.run_until_idle()
    env.clock.advance(timedelta(minutes=5))
    (due,) = env.store.due_schedules("sched", env.clock.now())
    scheduler = env.parts.schedules
    assert scheduler is not None
    # the run was started, then the engine died: the next tick was not moved on
    scheduler.client.start("tick", 3, run_id=tick_run_id("sched", "tick", due.next_tick))
    env.run_until_idle()  # another engine fires the same tick: the same run, no second one
    assert runs_of(env) == ["schedule:sched:tick:20260101T000500Z"]
    (row,) = env.store.list_schedules("sched")
    assert row.next_tick == at("2026-01-01T00:10:00")


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("latest", ["schedule:sched:tick:20260101T010000Z"]),
        ("skip", []),
        (
            "all",
            [f"schedule:sched:tick:20260101T00{m:02d}00Z" for m in range(5, 60, 5)]
            + ["schedule:sched:tick:20260101T010000Z"],
        ),
    ],
)
def test_catch_up_after_downtime(policy: str, expected: list[str]) -> None:
    env = Harness(scheduled_app(catch_up=policy))
    env.run_until_idle()
    env.clock.advance(timedelta(minutes=62))  # no engine ran for an hour
    env.run_until_idle()
    assert runs_of(env) == sorted(expected)
    (row,) = env.store.list_schedules("sched")
    assert row.next_tick == at("2026-01-01T01:05:00")
    env.clock.advance(timedelta(minutes=3))  # then on time again, whatever the policy
    env.run_until_idle()
    assert "schedule:sched:tick:20260101T010500Z" in runs_of(env)


def test_catch_up_all_is_bounded() -> None:
    env = Harness(scheduled_app(catch_up="all", seconds=1))
    env.run_until_idle()
    env.clock.advance(timedelta(days=2))
    env.run_until_idle()
    runs = runs_of(env)
    assert len(runs) == CATCH_UP_LIMIT
    assert runs[-1] == "schedule:sched:tick:20260103T000000Z"


def test_a_paused_schedule_starts_nothing_and_resumes_without_catching_up() -> None:
    env = Harness(scheduled_app())
    env.run_until_idle()
    now = env.clock.now()
    assert env.store.pause_schedule("sched", "tick", paused=True, now=now, next_tick=None)
    env.clock.advance(timedelta(minutes=30))
    env.run_until_idle()
    assert runs_of(env) == []
    resume_at = Every(timedelta(minutes=5)).next_after(env.clock.now())
    env.store.pause_schedule(
        "sched", "tick", paused=False, now=env.clock.now(), next_tick=resume_at
    )
    env.run_until_idle()
    assert runs_of(env) == []
    env.clock.advance(timedelta(minutes=5))
    env.run_until_idle()
    assert runs_of(env) == ["schedule:sched:tick:20260101T003500Z"]


def test_a_changed_declaration_replaces_the_stored_schedule() -> None:
    clock = VirtualClock()
    env = Harness(scheduled_app(), clock=clock)
    env.run_until_idle()
    changed = scheduled_app(minutes=10)
    Scheduler(changed, env.store, clock).sync()
    (row,) = env.store.list_schedules("sched")
    assert row.spec == "every:600" and row.next_tick == at("2026-01-01T00:10:00")


def test_upgrade_from_version_5_adds_the_schedules_table(tmp_path: Any) -> None:
    import sqlalchemy as sa

    from sagaloop.store import migrations
    from sagaloop.store.sql import SqlStore

    store = SqlStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.upgrade()
    with store.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE sagaloop_schedules"))
        conn.execute(sa.text("UPDATE sagaloop_schema SET version = 5"))
    assert store.upgrade() == (5, migrations.LATEST)
    app = scheduled_app()
    Scheduler(app, store, VirtualClock()).sync()
    assert [s.name for s in store.list_schedules()] == ["tick"]
    store.close()


# --- sagaloop schedule -----------------------------------------------------------------------


def test_the_cli_adds_lists_pauses_resumes_and_deletes_schedules(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from click.testing import CliRunner

    from sagaloop.cli.main import cli
    from sagaloop.store.sql import SqlStore

    (tmp_path / "schedapp.py").write_text(
        "from datetime import timedelta\n"
        "from sagaloop import App, SagaContext\n"
        "app = App('schedapp')\n"
        "@app.schedule('0 6 * * *', input=0)\n"
        "@app.saga(name='report')\n"
        "async def report(ctx: SagaContext, n: int = 0) -> int:\n"
        "    return n\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    url = f"sqlite:///{tmp_path / 's.db'}"
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", url)

    def run(*args: str) -> Any:
        return CliRunner().invoke(cli, list(args), catch_exceptions=False)

    assert run("db", "upgrade").exit_code == 0
    assert "no schedule" in run("schedule", "list").output
    added = run("schedule", "add", "often", "report", "--every", "30", "--input", "2",
                "--app", "schedapp")  # fmt: skip
    assert added.exit_code == 0, added.output
    assert "schedule often added: next tick" in added.output
    for args, says in [
        (["often", "report", "--every", "30", "--input", "1"], "already has a schedule 'often'"),
        (["bad", "report", "--cron", "61 * * * *", "--input", "1"], "minute 61 is not within 0-59"),
        (["bad", "nope", "--every", "5", "--input", "1"], "has no saga 'nope'"),
        (["bad", "report", "--every", "5", "--input", '"x"'], "input of schedule 'bad'"),
        (["report", "report", "--every", "5", "--input", "1"], "declared in the code"),
    ]:
        refused = run("schedule", "add", *args, "--app", "schedapp")
        assert refused.exit_code == 1 and says in refused.output, refused.output
    listed = json.loads(run("schedule", "list", "--json").output)
    assert [(s["name"], s["spec"], s["input"], s["paused"]) for s in listed] == [
        ("often", "every:30", 2, False)
    ]
    assert "often" in run("schedule", "list").output
    assert run("schedule", "pause", "often", "--note", "maintenance").exit_code == 0
    store = SqlStore(url)
    schedule = store.get_schedule("schedapp", "often")
    assert schedule is not None and schedule.paused and schedule.note == "maintenance"
    assert "paused" in run("schedule", "list").output
    assert run("schedule", "resume", "often").exit_code == 0
    schedule = store.get_schedule("schedapp", "often")
    assert schedule is not None and not schedule.paused and schedule.note is None
    missing = run("schedule", "pause", "nope")
    assert missing.exit_code == 1 and "no schedule 'nope'" in missing.output
    assert run("schedule", "delete", "often").exit_code == 0
    assert store.list_schedules() == []
    store.close()


def test_a_code_schedule_is_paused_not_deleted(tmp_path: Any) -> None:
    from sagaloop.client.schedules import delete_schedule, find_schedule
    from sagaloop.store.sql import SqlStore

    store = SqlStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.upgrade()
    Scheduler(scheduled_app(), store, VirtualClock()).sync()
    with pytest.raises(InvalidSchedule, match="pause it"):
        delete_schedule(store, find_schedule(store, "tick", None))
    store.close()


def test_on_the_timers_thread_a_failing_scheduler_holds_nothing_up_and_is_said_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = Harness(scheduled_app())
    env.run_until_idle()  # the schedule is stored, its first tick at 00:05
    scheduler = env.parts.schedules
    assert scheduler is not None
    timer_steps: list[int] = []

    def timers() -> int:
        timer_steps.append(1)
        return 1

    def broken() -> int:
        raise RuntimeError("database gone")

    fire = scheduler.beside(timers)
    monkeypatch.setattr(scheduler, "fire_due", broken)
    assert [fire(), fire(), fire()] == [1, 1, 1] and len(timer_steps) == 3
    said = [r for r in caplog.records if "could not fire" in r.getMessage()]
    assert len(said) == 1 and "database gone" in said[0].getMessage()
    monkeypatch.undo()
    env.clock.advance(timedelta(minutes=5))
    assert fire() == 2  # the timers' step and the tick


def test_an_idle_scheduler_reads_once_per_relook_and_fires_on_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 27: a look reads RELOOK ahead of the clock; until the next tick it found (or
    RELOOK passes) the scheduler reads nothing, and the tick fires at its time."""
    from sagaloop.runtime import schedules as schedules_module

    mono = [1000.0]
    monkeypatch.setattr(schedules_module.time, "monotonic", lambda: mono[0])
    env = Harness(scheduled_app(seconds=10))
    scheduler = env.parts.schedules
    assert scheduler is not None
    reads: list[int] = []
    look = env.store.due_schedules

    def counted(app: str, now: datetime) -> Any:
        reads.append(1)
        return look(app, now)

    monkeypatch.setattr(env.store, "due_schedules", counted)
    assert scheduler.fire_due() == 0 and len(reads) == 1
    for _ in range(9):
        env.clock.advance(timedelta(milliseconds=100))
        mono[0] += 0.1
        assert scheduler.fire_due() == 0
    assert len(reads) == 1, "nothing due within RELOOK: no read"
    mono[0] += schedules_module.RELOOK
    assert scheduler.fire_due() == 0 and len(reads) == 2, "looked again after RELOOK"
    env.clock.set(at("2026-01-01T00:00:10"))
    assert scheduler.fire_due() == 1, "the tick fires at its time"
    assert runs_of(env) == ["schedule:sched:tick:20260101T000010Z"]
