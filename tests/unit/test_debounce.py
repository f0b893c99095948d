"""Debounce (issue 25, item 6): ``@app.saga(debounce=Debounce(period, key, max_wait))``. The
starts of one key within ``period`` of each other make one run, with the last start's input,
started ``period`` after the last start (or ``max_wait`` after the first); keys are
independent; exactly one run per window however many engines look at it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cli_env import cli_database, run

from sagaloop import (
    App,
    Client,
    Debounce,
    DeclarationError,
    RunNotFoundError,
    SagaContext,
    ValidationError,
)
from sagaloop.engine import history as h
from sagaloop.engine.messages import Envelope, start_queue
from sagaloop.engine.ports import Outgoing
from sagaloop.runtime import crashpoints
from sagaloop.runtime.debounce import Debouncer
from sagaloop.store import migrations
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness, eventually
from sagaloop.testing.harness import VirtualClock

PERIOD = timedelta(seconds=5)


def debounced_app(debounce: Debounce) -> App:
    app = App("debounced")

    @app.saga(name="summarize", debounce=debounce)
    async def summarize(ctx: SagaContext, input: dict[str, Any]) -> dict[str, Any]:
        return input

    @app.saga(name="parent")
    async def parent(ctx: SagaContext, input: dict[str, Any]) -> Any:
        return await ctx.call(summarize, input)

    return app


def runs_of(env: Harness) -> list[Any]:
    return [r for r in env.store.list_runs(saga="summarize", limit=100)]


def test_starts_within_the_period_make_one_run_with_the_last_input() -> None:
    env = Harness(debounced_app(Debounce(PERIOD, key=lambda i: i["user"])))
    t0 = env.clock.now()
    first = env.start("summarize", {"user": "ann", "n": 1})
    env.advance(timedelta(seconds=3))
    assert env.start("summarize", {"user": "ann", "n": 2}) == first  # the same window
    env.advance(timedelta(seconds=4))  # 7 s after the first start, 4 after the last
    assert runs_of(env) == []
    [window] = env.client.pending()
    assert (window.run_id, window.key, window.starts) == (first, "ann", 2)
    assert window.input == {"user": "ann", "n": 2}
    assert window.due_at == t0 + timedelta(seconds=3) + PERIOD
    env.advance(timedelta(seconds=1))  # period after the last start: it runs
    [run] = runs_of(env)
    assert run.run_id == first and run.created_at == t0 + timedelta(seconds=8)
    assert env.result(first) == {"user": "ann", "n": 2}
    assert env.client.pending() == []
    history = env.history(first)
    assert history[0].kind == h.RUN_STARTED and history[0].data["input"]["n"] == 2


def test_a_start_after_the_window_ran_opens_a_new_window() -> None:
    env = Harness(debounced_app(Debounce(PERIOD)))  # one key for the saga
    first = env.start("summarize", {"user": "ann", "n": 1})
    env.run_until_idle()  # jumps to the window's due time
    assert env.result(first) == {"user": "ann", "n": 1}
    second = env.start("summarize", {"user": "bob", "n": 2})  # no key: bob joins any window
    assert second != first
    env.run_until_idle()
    assert env.result(second) == {"user": "bob", "n": 2}
    assert len(runs_of(env)) == 2


def test_two_keys_are_independent() -> None:
    env = Harness(debounced_app(Debounce(PERIOD, key=lambda i: i["user"])))
    t0 = env.clock.now()
    ann = env.start("summarize", {"user": "ann", "n": 1})
    env.advance(timedelta(seconds=2))
    bob = env.start("summarize", {"user": "bob", "n": 1})
    env.advance(timedelta(seconds=2))
    assert env.start("summarize", {"user": "bob", "n": 2}) == bob
    assert ann != bob
    assert [(w.key, w.starts) for w in env.client.pending("summarize")] == [("ann", 1), ("bob", 2)]
    env.advance(timedelta(seconds=1))  # ann's window is due (5 s after its only start)
    assert [r.run_id for r in runs_of(env)] == [ann]
    env.advance(timedelta(seconds=4))  # bob's: 5 s after his last start
    assert {r.run_id: r.created_at - t0 for r in runs_of(env)} == {
        ann: timedelta(seconds=5),
        bob: timedelta(seconds=9),
    }
    assert env.result(bob) == {"user": "bob", "n": 2}


def test_max_wait_starts_the_run_while_starts_keep_coming() -> None:
    env = Harness(debounced_app(Debounce(PERIOD, max_wait=timedelta(seconds=10))))
    t0 = env.clock.now()
    run_id = env.start("summarize", {"user": "ann", "n": 0})
    for n in range(1, 4):  # a start every 4 s: the period alone would never end
        env.advance(timedelta(seconds=4))
        if n < 3:
            assert env.start("summarize", {"user": "ann", "n": n}) == run_id
    [run] = runs_of(env)
    assert run.created_at == t0 + timedelta(seconds=10)
    assert env.result(run_id) == {"user": "ann", "n": 2}  # the last start before max_wait
    later = env.start("summarize", {"user": "ann", "n": 3})  # the next window
    assert later != run_id


def test_the_period_and_max_wait_may_be_seconds() -> None:
    debounce = Debounce(2.5, max_wait=60)
    assert (debounce.wait, debounce.bound) == (timedelta(seconds=2.5), timedelta(seconds=60))


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"period": 0}, "duration > 0"),
        ({"period": timedelta(seconds=-1)}, "duration > 0"),
        ({"period": "5s"}, "timedelta or seconds"),
        ({"period": True}, "timedelta or seconds"),
        ({"period": 1, "max_wait": 0}, "max_wait=0"),
        ({"period": 1, "key": "user"}, "function of the input"),
    ],
)
def test_bad_declarations_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(DeclarationError, match=says):
        Debounce(**kwargs)


def test_debounce_takes_a_debounce() -> None:
    app = App("bad")
    with pytest.raises(DeclarationError, match=r"debounce= takes a sagaloop\.Debounce"):

        @app.saga(debounce=5)  # type: ignore[arg-type]
        async def job(ctx: SagaContext) -> None: ...


def test_a_start_with_a_run_id_an_event_or_a_bad_key_is_refused_writing_nothing() -> None:
    app = App("keys")

    @app.saga(name="job", debounce=Debounce(1, key=lambda i: i["k"]))
    async def job(ctx: SagaContext, input: dict[str, Any]) -> None: ...

    env = Harness(app)
    with pytest.raises(ValidationError, match="its run id is its window's"):
        env.client.start("job", {"k": "a"}, run_id="mine")
    with pytest.raises(ValidationError, match="takes no event"):
        env.client.start("job", {"k": "a"}, event=("go", None))
    with pytest.raises(ValidationError, match="debounce key function raised KeyError"):
        env.client.start("job", {"other": 1})
    with pytest.raises(ValidationError, match="returned list"):
        env.client.start("job", {"k": [1]})
    assert env.client.pending() == [] and env.store.list_runs() == []


def test_a_child_run_and_a_start_message_on_the_broker_start_at_once() -> None:
    """Debounce gathers the starts of clients: a parent waits for its child, and a ``start``
    message names its run, so both start the run at once (docs/concepts/debounce.md)."""
    env = Harness(debounced_app(Debounce(PERIOD)))
    parent = env.start("parent", {"user": "ann", "n": 1})
    env.run_until_idle(skip_time=False)
    assert env.result(parent) == {"user": "ann", "n": 1}
    now = env.clock.now()
    message = Envelope(
        type="start", run_id="direct", saga="summarize", payload={"input": {"n": 2}}, created_at=now
    )
    with env.store.transaction() as tx:
        env.store.enqueue(tx, [Outgoing(start_queue("debounced"), message)], now)
    env.run_until_idle(skip_time=False)
    assert env.result("direct") == {"n": 2}
    assert env.client.pending() == []


# --- exactly one run per window across engines ---------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    store = SqlStore(f"sqlite:///{tmp_path / 'debounce.db'}")
    store.upgrade()
    yield store
    store.close()


def test_two_engines_taking_one_due_window_start_one_run(store: SqlStore) -> None:
    app = debounced_app(Debounce(PERIOD))
    clock = VirtualClock()
    run_id = Client(store, app, clock=clock).start("summarize", {"n": 1})
    clock.advance(PERIOD)
    one, two = Debouncer(app, store, clock), Debouncer(app, store, clock)
    [seen_by_one] = store.due_debounced(app.name, clock.now())
    [seen_by_two] = store.due_debounced(app.name, clock.now())
    assert one._start(seen_by_one, clock.now()) == 1
    assert two._start(seen_by_two, clock.now()) == 0  # taken: it starts nothing
    assert [r.run_id for r in store.list_runs()] == [run_id]
    assert [e.kind for e in store.load_history(None, run_id)] == [h.RUN_STARTED]
    assert two.fire_due() == 0 and store.pending_debounced() == []


def test_a_start_between_the_read_and_the_take_moves_the_window_on(store: SqlStore) -> None:
    app = debounced_app(Debounce(PERIOD))
    clock = VirtualClock()
    client = Client(store, app, clock=clock)
    run_id = client.start("summarize", {"n": 1})
    clock.advance(PERIOD)
    debouncer = Debouncer(app, store, clock)
    [due] = store.due_debounced(app.name, clock.now())
    assert client.start("summarize", {"n": 2}) == run_id  # lands before the engine's take
    assert debouncer._start(due, clock.now()) == 0  # as read, it is gone: nothing started
    assert store.list_runs() == []
    clock.advance(PERIOD)
    assert debouncer.fire_due() == 1
    [run] = store.list_runs()
    assert (run.run_id, run.input) == (run_id, {"n": 2})  # the last input, in the same run


def test_an_engine_killed_before_its_commit_leaves_the_window_to_the_next(
    store: SqlStore,
) -> None:
    app = debounced_app(Debounce(PERIOD))
    clock = VirtualClock()
    run_id = Client(store, app, clock=clock).start("summarize", {"n": 1})
    clock.advance(PERIOD)
    dying = Debouncer(app, store, clock)
    crashpoints.arm("debounce.before_commit:raise")
    try:
        with pytest.raises(crashpoints.CrashPointRaised):
            dying.fire_due()
    finally:
        crashpoints.disarm()
    assert store.list_runs() == [] and len(store.pending_debounced()) == 1  # rolled back
    assert Debouncer(app, store, clock).fire_due() == 1
    assert [r.run_id for r in store.list_runs()] == [run_id]


def test_concurrent_starts_and_engines_on_postgresql(postgres_url: str) -> None:
    """Threads starting one key while two debouncers fire: every start lands in a window,
    each window becomes one run, and the last start of each window is its run's input."""
    app = App(f"pg{threading.get_ident()}")

    @app.saga(name="job", debounce=Debounce(timedelta(milliseconds=1)))
    async def job(ctx: SagaContext, input: dict[str, Any]) -> None: ...

    store = SqlStore(postgres_url)
    try:
        client = Client(store, app, start_backlog=0)
        clock = client.clock
        debouncers = [Debouncer(app, store, clock) for _ in range(2)]
        stop = threading.Event()
        returned: list[tuple[str, int]] = []
        lock = threading.Lock()

        def start(worker: int) -> None:
            for i in range(20):
                run_id = client.start("job", {"w": worker, "i": i})
                with lock:
                    returned.append((run_id, worker * 100 + i))

        def fire(d: Debouncer) -> None:
            while not stop.is_set():
                d.fire_due()

        firing = [threading.Thread(target=fire, args=(d,)) for d in debouncers]
        starting = [threading.Thread(target=start, args=(w,)) for w in range(3)]
        for thread in (*firing, *starting):
            thread.start()
        for thread in starting:
            thread.join()
        try:
            eventually(lambda: not store.pending_debounced(app.name), 30, "every window to run")
        finally:
            stop.set()
        for thread in firing:
            thread.join()
        runs = {r.run_id: r for r in store.list_runs(saga="job", app=app.name, limit=1000)}
        assert store.pending_debounced(app.name) == []
        assert {run_id for run_id, _ in returned} == set(runs), "every start got its window's run"
        for run_id, run in runs.items():
            inputs = [n for r, n in returned if r == run_id]
            assert run.input["w"] * 100 + run.input["i"] in inputs
            history = store.load_history(None, run_id)
            assert [e.kind for e in history][:1] == [h.RUN_STARTED]
    finally:
        store.close()


def test_migration_9_adds_the_debounce_windows_to_a_version_7_database(tmp_path: Path) -> None:
    store = SqlStore(f"sqlite:///{tmp_path / 'old.db'}")
    try:
        store.upgrade()
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE sagaloop_debounced")
            conn.exec_driver_sql("UPDATE sagaloop_schema SET version = 7")
        assert store.upgrade() == (7, migrations.LATEST)
        app = debounced_app(Debounce(PERIOD))
        run_id = Client(store, app).start("summarize", {"n": 1})
        assert [w.run_id for w in store.pending_debounced()] == [run_id]
    finally:
        store.close()


# --- what clients and the CLI say of a start not started yet ---------------------------------


def test_a_pending_run_id_is_not_found_yet_and_result_waits_for_it() -> None:
    env = Harness(debounced_app(Debounce(PERIOD, key=lambda i: i["user"])))
    run_id = env.start("summarize", {"user": "ann", "n": 1})
    env.start("summarize", {"user": "ann", "n": 2})
    with pytest.raises(RunNotFoundError, match="a debounced start of saga 'summarize'") as e:
        env.client.status(run_id)
    assert "key 'ann', 2 starts gathered" in str(e.value)
    with pytest.raises(TimeoutError, match="debounced start"):
        env.client.result(run_id, timeout=0)  # waits, rather than saying there is no run
    with pytest.raises(RunNotFoundError, match=r"^no run with id 'other'$"):
        env.client.result("other", timeout=0)
    env.run_until_idle()
    assert env.client.result(run_id, timeout=0) == {"user": "ann", "n": 2}


CLI_APP = """
from typing import Any
from sagaloop import App, Debounce, SagaContext

app = App("bounce")

@app.saga(name="digest", debounce=Debounce(60, key=lambda i: i["user"]))
async def digest(ctx: SagaContext, input: dict[str, Any]) -> None: ...
"""


def test_the_cli_starts_a_debounced_saga_and_lists_its_pending_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cli_database(tmp_path, monkeypatch, "bounce", CLI_APP)
    first = run("start", "digest", "--input", '{"user": "ann"}', "--app", "bounce")
    again = run("start", "digest", "--input", '{"user": "ann", "n": 2}', "--app", "bounce")
    assert first.exit_code == 0 and again.output == first.output  # one window: one run id
    run_id = first.output.strip()
    listed = run("list")
    assert "pending debounced starts:" in listed.output and run_id in listed.output
    assert "digest" in listed.output and "ann" in listed.output
    data = json.loads(run("list", "--json").output)
    assert [(p["run_id"], p["key"], p["starts"]) for p in data["pending"]] == [(run_id, "ann", 2)]
    status = run("status", run_id)
    assert status.exit_code != 0 and "a debounced start of saga 'digest'" in status.output
