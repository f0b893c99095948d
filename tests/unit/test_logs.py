"""What a run says while it runs: one log line per event that matters, with ``run_id`` and
``saga`` in every record and the run named in its text, never repeated by replay, a restart or
an activation prepared again; tracebacks stored and shown by ``status``; ``--log-format json``;
the drivers' loggers quiet by default; a server that refuses the credentials stops a service
at once with exit status 78."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pika.exceptions
import psycopg
import pytest
from click.testing import CliRunner
from sqlalchemy import exc as sa_exc

from sagaloop import App, RetryPolicy, SagaContext, StepContext
from sagaloop.brokers.database import DatabaseDelivery
from sagaloop.brokers.rabbitmq import refused_access as broker_refusal
from sagaloop.cli.common import Obj
from sagaloop.cli.main import _ScrubbingJsonFormatter, cli
from sagaloop.cli.render import timeline_text
from sagaloop.cli.serve import _wait_for_database
from sagaloop.engine import history as h
from sagaloop.errors import (
    AccessRefusedError,
    DatabaseAccessRefused,
    TransientStoreError,
)
from sagaloop.runtime.service import EXIT_ACCESS_REFUSED
from sagaloop.store.connect import refused_access as database_refusal
from sagaloop.store.connect import translate
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness

THREE = RetryPolicy(max_attempts=3, initial_interval=timedelta(seconds=1))

app = App("logs")


@app.step(retry=THREE)
def charge(ctx: StepContext, amount: int) -> str:
    raise ValueError(f"card declined for {amount}")


@app.step(retry=THREE)
def reserve(ctx: StepContext, n: int) -> int:
    return n


@reserve.compensation
def release(ctx: StepContext, n: int, result: int) -> None:
    return None


@app.step(retry=THREE)
def book(ctx: StepContext, n: int) -> str:
    if ctx.attempt == 1:
        raise ConnectionError("the response was lost")
    return "never: the reconcile finds the booking"


@book.reconcile
def find_booking(ctx: StepContext, n: int) -> str | None:
    return f"booking-{n}"


@app.step(retry=THREE, idempotent=False)
def wire(ctx: StepContext, n: int) -> str:
    raise TimeoutError("the bank did not answer")


@app.saga(name="pay")
async def pay(ctx: SagaContext, amount: int) -> str:
    return await ctx.call(charge, amount)


@app.saga(name="wait")
async def wait(ctx: SagaContext, n: int) -> int:
    await ctx.call(reserve, n)
    await ctx.wait_for_event("go", timeout=timedelta(hours=1))
    return n


@app.saga(name="doubt")
async def doubt(ctx: SagaContext, n: int) -> str:
    return await ctx.call(book, n)


@app.saga(name="stuck")
async def stuck(ctx: SagaContext, n: int) -> str:
    return await ctx.call(wire, n)


@pytest.fixture
def env() -> Iterator[Harness]:
    harness = Harness(app)
    try:
        yield harness
    finally:
        harness.close()


def run_lines(caplog: pytest.LogCaptureFixture, run_id: str) -> list[str]:
    """The messages of the run's event records (asserting that each carries its ids): the
    engine's (``sagaloop.run``) and the worker's (``sagaloop.step``)."""
    out = []
    for r in caplog.records:
        if r.name in ("sagaloop.run", "sagaloop.step") and r.getMessage().startswith("run "):
            assert getattr(r, "run_id", None) and getattr(r, "saga", None), r.getMessage()
        if getattr(r, "run_id", None) == run_id and r.name in ("sagaloop.run", "sagaloop.step"):
            assert run_id in r.getMessage(), "the text names the run too"
            out.append(r.getMessage())
    return out


def test_a_failed_step_and_run_say_so_with_the_traceback_stored_and_shown(
    env: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sagaloop")
    run_id = env.start(pay, 7, run_id="p1")
    env.run_until_idle()

    lines = run_lines(caplog, run_id)
    assert lines == [
        "run p1 (saga pay) started",
        "run p1: step 'charge' failed (attempt 1 of 3): ValueError: card declined for 7",
        "run p1: step 'charge' failed (attempt 2 of 3): ValueError: card declined for 7",
        "run p1: step 'charge' failed (attempt 3 of 3): ValueError: card declined for 7",
        "run p1: step 'charge' failed for good after 3 attempt(s): ValueError: card declined for 7",
        "run p1 finished: failed (StepFailedError: step 'charge' failed: ValueError: card "
        "declined for 7)",
    ]
    attempt = next(r for r in caplog.records if "attempt 2 of 3" in r.getMessage())
    assert (attempt.levelname, attempt.saga, attempt.step, attempt.attempt) == (
        "WARNING",
        "pay",
        "charge",
        2,
    )
    assert attempt.exc_info is None, "the traceback is logged at DEBUG (-v) only"

    # the history keeps where the step raised (from the step's own frame) and the saga too
    failed = [e for e in env.history(run_id) if e.kind == h.STEP_FAILED]
    trace = failed[0].data["error"]["traceback"]
    assert trace.startswith("Traceback") and "in charge" in trace, trace
    assert "steps.py" not in trace, "sagaloop's frames above the step are left out"
    assert "in pay" in (env.get(run_id).error or {}).get("traceback", "")

    text = timeline_text(env.status(run_id))
    assert '          raise ValueError(f"card declined for {amount}")' in text, text
    assert "      ValueError: card declined for 7" in text
    assert "error: StepFailedError" in text and "in pay" in text


def test_debug_adds_the_traceback_to_the_attempt_line(
    env: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="sagaloop")
    run_id = env.start(pay, 1)
    env.run_until_idle()
    attempts = [r for r in caplog.records if "failed (attempt" in r.getMessage()]
    assert len(attempts) == 3 and all(r.exc_info for r in attempts)
    finished = [m for m in run_lines(caplog, run_id) if "finished: failed" in m]
    assert len(finished) == 1 and "Traceback" in finished[0] and "in pay" in finished[0]


def test_no_line_twice_after_replay_a_restart_or_a_conflict(
    env: Harness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness replays saga code on every activation; a restart empties every cache; an
    activation that loses a race is prepared again, one whose transaction fails after it was
    applied is rolled back and delivered again: each event is said once."""
    caplog.set_level(logging.INFO, logger="sagaloop")
    run_id = env.start(wait, 3, run_id="w1")
    env.run_until_idle(skip_time=False)
    env.restart()
    save_run, conflicts = env.store.save_run, [0]

    def losing_once(*args: Any, **kwargs: Any) -> bool:
        if not conflicts[0]:
            conflicts[0] += 1
            return False  # another engine changed the run meanwhile: prepare again
        return save_run(*args, **kwargs)

    settle, outages = DatabaseDelivery.settle, [0]

    def failing_once(delivery: DatabaseDelivery, tx: Any) -> None:
        if not outages[0]:  # after the activation was applied: its transaction rolls back
            outages[0] += 1
            raise TransientStoreError("the database went away")
        settle(delivery, tx)

    monkeypatch.setattr(env.store, "save_run", losing_once)
    monkeypatch.setattr(DatabaseDelivery, "settle", failing_once)
    env.send_event(run_id, "go")
    env.run_until_idle()
    assert conflicts == outages == [1] and env.result(run_id) == 3
    started, waiting, finished = run_lines(caplog, run_id)
    assert (started, finished) == ("run w1 (saga wait) started", "run w1 finished: completed")
    assert waiting.startswith("run w1 waiting for event 'go' until ") and waiting.endswith(" UTC")


def test_in_doubt_reconciled_and_needs_attention(
    env: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sagaloop")
    reconciled = env.start(doubt, 5, run_id="d1")
    halted = env.start(stuck, 6, run_id="s1")
    env.run_until_idle()
    assert env.result(reconciled) == "booking-5"
    said = "run d1: step 'book' reconciled (attempt 2): an earlier attempt took effect, so it"
    assert f"{said} was not run again" in run_lines(caplog, reconciled)
    lines = run_lines(caplog, halted)
    assert lines[-1].startswith("run s1 needs attention: step 'wire' (idempotent=False, no ")
    record = next(r for r in caplog.records if r.getMessage() == lines[-1])
    assert record.levelname == "WARNING" and record.saga == "stuck"


def test_json_lines_parse_carry_the_run_and_hide_passwords() -> None:
    secret = 'pa"ss\\wörd'
    formatter = _ScrubbingJsonFormatter(lambda text: text.replace(secret, "***"))
    record = logging.LogRecord(
        "sagaloop.run", logging.WARNING, __file__, 1, "run %s: %s", ("r1", secret), None
    )
    record.__dict__.update(run_id="r1", saga="pay", detail={"url": f"x://u:{secret}@h"})
    line = formatter.format(record)
    data = json.loads(line)
    assert data["run_id"] == "r1" and data["saga"] == "pay" and data["level"] == "WARNING"
    assert data["message"] == "run r1: ***" and data["detail"] == {"url": "x://u:***@h"}
    assert secret not in line and "wörd" not in json.loads(line)["message"]


@pytest.fixture
def driver_levels() -> Iterator[None]:
    before = {name: logging.getLogger(name).level for name in ("pika", "kombu")}
    yield
    for name, level in before.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize(
    ("flags", "level"),
    [([], logging.CRITICAL), (["-v"], logging.WARNING), (["-v", "-v"], logging.DEBUG)],
)
def test_verbosity_sets_the_drivers_loggers(
    driver_levels: None, flags: list[str], level: int
) -> None:
    assert CliRunner().invoke(cli, [*flags, "schema"]).exit_code == 0
    assert logging.getLogger("pika").level == level
    assert logging.getLogger("kombu").level == level


def test_log_format_comes_from_the_environment_too(driver_levels: None) -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["schema"], env={"SAGALOOP_LOG_FORMAT": "json"}).exit_code == 0
    refused = runner.invoke(cli, ["schema"], env={"SAGALOOP_LOG_FORMAT": "xml"})
    assert refused.exit_code == 2 and "--log-format" in refused.output


DEV_APP = """
from sagaloop import App, RetryPolicy, SagaContext, StepContext
from sagaloop.brokers.database import DatabaseDelivery

app = App("devlogs")


@app.step(retry=RetryPolicy(max_attempts=2, initial_interval=0.01))
def charge(ctx: StepContext, amount: int) -> str:
    raise ValueError("card declined")


@app.saga(name="pay")
async def pay(ctx: SagaContext, amount: int) -> str:
    return await ctx.call(charge, amount)
"""


def test_dev_writes_json_lines_that_name_the_run(tmp_path: Path) -> None:
    """A real ``sagaloop --log-format json dev``: every line on stderr is a JSON object; the
    ready line, each attempt and the end name the run; no line of pika."""
    (tmp_path / "devlogs.py").write_text(DEV_APP)
    url = f"sqlite:///{tmp_path / 'dev.db'}"
    store = SqlStore(url)
    store.upgrade()
    sys.path.insert(0, str(tmp_path))
    try:
        import devlogs

        from sagaloop.client import Client

        run_id = Client(store, devlogs.app).start("pay", 3, run_id="dev-run")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("devlogs", None)
        store.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")}
    env.update(SAGALOOP_DATABASE_URL=url, SAGALOOP_LOG_FORMAT="json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sagaloop", "dev", "--app", "devlogs", "--poll", "0.02"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while not any("finished: failed" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, lines
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, lines
        reader.join(5)
    records = [json.loads(line) for line in lines]
    assert not [r for r in records if r["logger"].startswith(("pika", "kombu"))]
    ready = "dev: app 'devlogs' ready: database sqlite:///"
    # logged once the threads run: the engine may log the queued run's start first
    assert [r for r in records if r["message"].startswith(ready)], records
    ours = [r["message"] for r in records if r.get("run_id") == run_id]
    assert ours == [
        "run dev-run (saga pay) started",
        "run dev-run: step 'charge' failed (attempt 1 of 2): ValueError: card declined",
        "run dev-run: step 'charge' failed (attempt 2 of 2): ValueError: card declined",
        "run dev-run: step 'charge' failed for good after 2 attempt(s): ValueError: card declined",
        "run dev-run finished: failed (StepFailedError: step 'charge' failed: ValueError: card "
        "declined)",
    ]
    assert all(r.get("saga") == "pay" for r in records if r.get("run_id") == run_id)


# --- servers that refuse the credentials ---------------------------------------------------


def psycopg_error(message: str) -> sa_exc.OperationalError:
    return sa_exc.OperationalError("connect", None, psycopg.OperationalError(message))


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (
            'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  '
            'password authentication failed for user "app"',
            "the password of user 'app' was refused",
        ),
        ('... failed: FATAL:  role "app" does not exist', "the role 'app' does not exist"),
        (
            '... failed: FATAL:  database "runs" does not exist',
            "the database 'runs' does not exist",
        ),
        (
            'FATAL:  no pg_hba.conf entry for host "10.0.0.1", user "app", database "runs"',
            "pg_hba.conf lets no such connection in",
        ),
        ("... port 5432 failed: Connection refused\n\tIs the server running on that host", None),
        ("... failed: FATAL:  sorry, too many clients already", None),
        ("... failed: FATAL:  the database system is starting up", None),
        ("connection timeout expired", None),
    ],
)
def test_the_database_refusals_that_waiting_does_not_fix(message: str, reason: str | None) -> None:
    error = psycopg_error(message)
    assert database_refusal(error) == reason
    url = SqlStore("postgresql://app:s3cr3t@db/runs").engine.url
    translated = translate(error, url, "connect")
    assert isinstance(translated, TransientStoreError), "a running service waits for the fix"
    assert isinstance(translated, AccessRefusedError) == (reason is not None)
    if reason is not None:
        assert isinstance(translated, DatabaseAccessRefused) and translated.reason == reason
        assert "s3cr3t" not in str(translated) and "app:***@db/runs" in translated.where


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (
            pika.exceptions.ProbableAuthenticationError(
                "ConnectionClosedByBroker: (403) 'ACCESS_REFUSED - Login was refused using "
                "authentication mechanism PLAIN.'"
            ),
            "the user name or password was refused",
        ),
        (
            pika.exceptions.ProbableAccessDeniedError(
                "ConnectionClosedByBroker: (530) 'NOT_ALLOWED - vhost prod not found'"
            ),
            "the virtual host 'prod' does not exist",
        ),
        (
            pika.exceptions.ProbableAccessDeniedError(
                "ConnectionClosedByBroker: (530) \"NOT_ALLOWED - access to vhost '/' refused\""
            ),
            "the user may not use this virtual host",
        ),
        (
            "(403, \"ACCESS_REFUSED - access to exchange 'sagaloop' in vhost '/' refused for "
            "user 'app'\")",
            "the user lacks a permission (configure, write or read) in this virtual host",
        ),
        (pika.exceptions.AMQPConnectionError("ConnectionRefusedError(111)"), None),
        (pika.exceptions.ConnectionClosedByBroker(320, "CONNECTION_FORCED - shutdown"), None),
    ],
)
def test_the_broker_refusals_that_waiting_does_not_fix(
    error: BaseException | str, reason: str | None
) -> None:
    assert broker_refusal(error) == reason


def test_a_refusal_at_start_up_stops_the_service_with_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", "postgresql://app:hunter2@db.internal/runs")
    obj = Obj(None)
    calls = []

    def refuse(**kwargs: Any) -> SqlStore:
        calls.append(kwargs)
        raise DatabaseAccessRefused(
            "...", reason="the password of user 'app' was refused", where="ignored"
        )

    monkeypatch.setattr(obj, "store", refuse)
    with pytest.raises(SystemExit) as exited:
        _wait_for_database(obj, threading.Event(), upgrade=False, role="engine", connections=16)
    assert exited.value.code == EXIT_ACCESS_REFUSED == 78 and len(calls) == 1, "no retry"
    assert calls == [{"upgrade": False, "connections": 16}], "the pool sized for the service"
    (line,) = [r.getMessage() for r in caplog.records if r.name == "sagaloop.service"]
    assert line.startswith(
        "engine: cannot connect to the database postgresql://app:***@db.internal/runs: the "
        "password of user 'app' was refused; check SAGALOOP_DATABASE_URL (or --database-url)"
    ), line


def test_a_cancelled_run_says_what_it_undoes(
    env: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sagaloop")
    run_id = env.start(wait, 4, run_id="c1")
    env.run_until_idle(skip_time=False)
    env.cancel(run_id, "the customer changed their mind")
    env.run_until_idle(skip_time=False)
    assert run_lines(caplog, run_id)[2:] == [
        "run c1 cancelling (the customer changed their mind): its saga code may clean up "
        "until 2026-01-01 00:05:00 UTC",
        "run c1 compensating: undoing step 'reserve'",
        "run c1 finished: cancelled (the customer changed their mind)",
    ]
