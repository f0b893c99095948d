"""Hostile input at the client and on the command line (issue 10, defects 7 and 9).

Defect 7: what the engine would refuse (NaN and Infinity, invalid UTF-8 or a lone surrogate in an
id, a name or data, NUL, an id too long or empty) used to be accepted by the client and the CLI:
the run was written as ``running`` and its start dead-lettered, so it stayed ``running`` for ever.
Now the client refuses it before anything is written, the CLI says so in one line.

Defect 9: a broker password holding ``/``, ``#`` or ``?`` leaked through pika's error text
(``Port could not be cast to integer value as 'MqS3cr'``). Now every message that quotes a URL
or a driver's error goes through ``sagaloop._secrets``, which masks the password and its pieces.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cli_env import cli_database, run
from click.testing import CliRunner
from pydantic import BaseModel

from sagaloop import App, Client, SagaContext
from sagaloop._secrets import mask_url, password_of, scrub
from sagaloop.cli.main import cli
from sagaloop.errors import RunStateError, ValidationError
from sagaloop.testing.harness import Harness, VirtualClock

app = App("hostile_client")


class Reading(BaseModel):
    value: float


@app.saga(name="anything")
async def anything(ctx: SagaContext, x: Any) -> Any:
    await ctx.wait_for_event("go")
    return x


@app.saga(name="number")
async def number(ctx: SagaContext, x: float) -> float:
    return x


@app.saga(name="reading")
async def reading(ctx: SagaContext, r: Reading) -> float:
    return r.value


NAN = math.nan
INF = math.inf
NON_FINITE = r"NaN|Infinity|Out of range float"  # the converters' words for NaN and Infinity


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness(app)
    try:
        yield harness
    finally:
        harness.close()


def nothing_written(h: Harness, *runs: str) -> bool:
    """Only ``runs`` exist, and no message is queued beyond what they queued."""
    return {r.run_id for r in h.store.list_runs(limit=1000)} == set(runs)


# --- defect 7: the client --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("saga", "value"),
    [
        ("anything", NAN),
        ("anything", INF),
        ("anything", -INF),
        ("anything", {"scores": [1.0, NAN]}),
        ("anything", [{"x": -INF}]),
        ("number", NAN),
        ("number", INF),
        ("reading", Reading(value=NAN)),
        ("reading", {"value": INF}),
    ],
)
def test_the_client_refuses_nan_and_infinity_and_writes_nothing(
    h: Harness, saga: str, value: Any
) -> None:
    """An Any input used to be stored with NaN turned into null (or kept as NaN), a float input
    was accepted: the engine then refused the start and the run stayed running for ever."""
    with pytest.raises(ValidationError, match=NON_FINITE):
        h.start(saga, value, run_id="r")
    assert nothing_written(h)
    # The same without the saga's code: a client that knows only the app's name.
    with pytest.raises(ValidationError, match=NON_FINITE):
        Client(h.store, "hostile_client").start(saga, value, run_id="r")
    assert nothing_written(h) and h.store.queue_depths() == {}


def test_the_client_refuses_nan_in_event_data(h: Harness) -> None:
    run_id = h.start(anything, 1)
    before = h.store.queue_depths()
    for data in (NAN, {"a": [INF]}, -INF):
        with pytest.raises(ValidationError, match=NON_FINITE):
            h.send_event(run_id, "go", data)
    assert h.store.queue_depths() == before


BAD_TEXT = [
    pytest.param("", id="empty"),
    pytest.param("x" * 201, id="201-chars"),
    pytest.param("a\x00b", id="NUL"),
    pytest.param("a\udcff", id="invalid-utf8-argv"),
    pytest.param("cut\ud83d", id="lone-surrogate"),
]


@pytest.mark.parametrize("bad", BAD_TEXT)
def test_ids_and_names_the_engine_refuses_are_refused_before_anything_is_written(
    h: Harness, bad: str
) -> None:
    with pytest.raises(ValidationError, match="run_id"):
        h.start(anything, 1, run_id=bad)
    with pytest.raises(ValidationError, match="saga name"):
        Client(h.store, "hostile_client").start(bad, 1)
    assert nothing_written(h)
    run_id = h.start(anything, 1)
    before = h.store.queue_depths()
    with pytest.raises(ValidationError, match="event name"):
        h.client.send_event(run_id, bad)
    with pytest.raises(ValidationError, match="event_id"):
        h.client.send_event(run_id, "go", event_id=bad)
    for call in (
        lambda: h.client.send_event(bad, "go"),
        lambda: h.client.cancel(bad),
        lambda: h.client.retry(bad),
        lambda: h.client.get(bad),
        lambda: h.client.status(bad),
        lambda: h.client.history(bad),
    ):
        with pytest.raises(ValidationError, match="run_id"):
            call()
    with pytest.raises(ValidationError, match="saga name"):
        h.client.list(saga=bad)
    assert nothing_written(h, run_id) and h.store.queue_depths() == before


def test_an_empty_run_id_is_an_error_not_a_random_id(h: Harness) -> None:
    """``run_id or uuid4()`` used to start a run under a random id."""
    with pytest.raises(ValidationError, match="run_id must be 1 to 200"):
        h.start(anything, 1, run_id="")
    assert nothing_written(h)


@pytest.mark.parametrize("text", ["cut\ud83d", "\udcff", "ok \udc80 no"])
def test_lone_surrogates_in_data_are_refused(h: Harness, text: str) -> None:
    with pytest.raises(ValidationError, match="surrogate"):
        h.start(anything, {"reply": text})
    assert nothing_written(h)
    run_id = h.start(anything, 1)
    before = h.store.queue_depths()
    with pytest.raises(ValidationError, match="surrogate"):
        h.send_event(run_id, "go", [text])
    with pytest.raises(ValidationError, match="surrogate"):
        h.cancel(run_id, reason=text)
    assert h.store.queue_depths() == before


def test_a_run_id_of_another_app_is_refused(h: Harness) -> None:
    """Run ids are unique across the apps sharing a database; starting one that another app
    holds used to return that app's run when the saga names matched."""
    other = App("hostile_client_other")

    @other.saga(name="anything")
    async def theirs(ctx: SagaContext, x: Any) -> Any:
        return x

    Client(h.store, other).start(theirs, 1, run_id="shared")
    with pytest.raises(RunStateError, match="app 'hostile_client_other'"):
        h.start(anything, 1, run_id="shared")
    with pytest.raises(RunStateError, match="app 'hostile_client_other'"):
        Client(h.store, "hostile_client").start("anything", 1, run_id="shared")
    assert [(r.run_id, r.app) for r in h.store.list_runs()] == [("shared", other.name)]
    # Its own app still gets the idempotent answer.
    assert Client(h.store, other).start(theirs, 1, run_id="shared") == "shared"


def test_valid_unusual_text_still_works(h: Harness) -> None:
    run_id = "r" * 200
    assert h.start(anything, {"emoji": "\U0001f600", "nul": "a\x00b", "big": 10**30}, run_id=run_id)
    h.send_event(run_id, "go" * 100, {"x": 1.5})
    h.client.send_event(run_id, "go", None, event_id="e" * 200)
    h.run_until_idle()
    assert h.get(run_id).status == "completed"


# --- defect 7: the command line --------------------------------------------------------------

CLI_APP = textwrap.dedent(
    """
    from typing import Any
    from pydantic import BaseModel
    from sagaloop import App, SagaContext, StepContext

    app = App("hostile_client_cli")

    @app.step(queue="q")
    def step(ctx: StepContext, n: int) -> int:
        return n

    @app.saga(name="s")
    async def s(ctx: SagaContext, x: Any) -> Any:
        await ctx.wait_for_event("go")
        return x

    @app.saga(name="f")
    async def f(ctx: SagaContext, x: float) -> float:
        return x

    class Reply(BaseModel):
        text: str
        accepted: bool

    @app.saga(name="ask")
    async def ask(ctx: SagaContext) -> Any:
        return (await ctx.wait_for_event("reply", model=Reply)).text
    """
)


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return cli_database(tmp_path, monkeypatch, "hostile_client_cli", CLI_APP)


def written(path: Path) -> tuple[int, int, int]:
    """Rows in the runs, history and outbox tables."""
    with sqlite3.connect(path) as conn:
        return tuple(  # type: ignore[return-value]
            conn.execute(f"select count(*) from sagaloop_{table}").fetchone()[0]
            for table in ("runs", "history", "outbox")
        )


def assert_one_line_error(output: str, exit_code: int, *words: str) -> None:
    assert exit_code not in (0, None), output
    assert "Traceback" not in output, output
    lines = [x for x in output.strip().splitlines() if x.startswith("Error")]
    assert len(lines) == 1, output
    for word in words:
        assert word in lines[0], output


def started(db: Path) -> str:
    result = run("start", "s", "--input", "1", "--app", "hostile_client_cli")
    assert result.exit_code == 0, result.output
    return result.output.strip()


APP_OPT = ["--app", "hostile_client_cli"]
SURROGATE = "a\udcff"  # how Python hands over the argv bytes b"a\xff" (invalid UTF-8)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["start", "s", "--input", "NaN", *APP_OPT], ["--input", "NaN"]),
        (["start", "s", "--input", "Infinity", *APP_OPT], ["--input", "Infinity"]),
        (["start", "s", "--input", "-Infinity", *APP_OPT], ["--input", "-Infinity"]),
        (["start", "s", "--input", '{"a": [1, NaN]}', *APP_OPT], ["--input", "NaN"]),
        (["start", "f", "--input", "1e999", *APP_OPT], ["--input", "Infinity"]),
        (["start", "s", "--input", "1", "--run-id", "", *APP_OPT], ["run_id"]),
        (["start", "s", "--input", "1", "--run-id", SURROGATE, *APP_OPT], ["run_id"]),
        (["start", SURROGATE, "--input", "1", *APP_OPT], ["saga"]),
        (["start", "s", "--input", json.dumps(SURROGATE), *APP_OPT], ["surrogate"]),
        (["start", "s", "--input", '"cut\\ud83d"', *APP_OPT], ["surrogate"]),
        (["start", "s", "--input", f'"{SURROGATE}"', *APP_OPT], ["input", "surrogate"]),
        (["send-event", "RUN", "go", "--data", "NaN"], ["--data", "NaN"]),
        (["send-event", "RUN", "go", "--data", "[Infinity]"], ["--data", "Infinity"]),
        (["send-event", "RUN", "go", "--data", '"\\udcff"'], ["surrogate"]),
        (["send-event", "RUN", SURROGATE], ["event name"]),
        (["send-event", "RUN", "a\x00b"], ["event name"]),
        (["send-event", "RUN", "go", "--event-id", ""], ["event_id"]),
        (["send-event", "RUN", "go", "--event-id", SURROGATE], ["event_id"]),
        (["send-event", "RUN", "go", "--event-id", "e" * 201], ["event_id"]),
        (["send-event", SURROGATE, "go"], ["run_id"]),
        (["send-event", "", "go"], ["run_id"]),
        (["cancel", SURROGATE], ["run_id"]),
        (["cancel", "RUN", "--reason", SURROGATE], ["surrogate"]),
        (["retry", SURROGATE], ["run_id"]),
        (["retry", ""], ["run_id"]),
        (["status", SURROGATE], ["run_id"]),
        (["status", "x" * 201], ["run_id"]),
        (["status", "a\x00b"], ["run_id"]),
        (["list", "--saga", SURROGATE], ["saga"]),
        (["list", "--saga", ""], ["saga"]),
    ],
)
def test_cli_refuses_what_the_engine_would_in_one_line_and_writes_nothing(
    db: Path, args: list[str], words: list[str]
) -> None:
    run_id = started(db)
    before = written(db)
    result = run(*[run_id if a == "RUN" else a for a in args])
    assert_one_line_error(result.output, result.exit_code, *words)
    assert written(db) == before


def test_cli_start_with_nan_leaves_no_run(db: Path) -> None:
    """The reported case: ``sagaloop start S --input NaN`` made a run that stayed running."""
    result = run("start", "s", "--input", "NaN", *APP_OPT)
    assert_one_line_error(result.output, result.exit_code, "NaN")
    assert written(db) == (0, 0, 0)


@pytest.mark.parametrize(
    "args",
    [
        [b"start", b"s", b"--input", b"1", b"--run-id", b"a\xff", *map(str.encode, APP_OPT)],
        [b"start", b"s\xff", b"--input", b"1", *map(str.encode, APP_OPT)],
        [b"start", b"s", b"--input", b'"a\xff"', *map(str.encode, APP_OPT)],
        [b"send-event", b"a\xfe", b"go"],
        [b"send-event", b"RUN", b"go\xff"],
        [b"send-event", b"RUN", b"go", b"--data", b'{"t": "\xc3"}'],
        [b"cancel", b"a\xff"],
        [b"retry", b"a\xff"],
        [b"status", b"a\xff"],
        [b"list", b"--saga", b"a\xff"],
    ],
)
def test_invalid_utf8_argv_is_one_line_in_a_real_process(db: Path, args: list[bytes]) -> None:
    run_id = started(db).encode()
    before = written(db)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(db.parent), *sys.path])}
    proc = subprocess.run(
        [
            sys.executable.encode(),
            b"-m",
            b"sagaloop",
            *[run_id if a == b"RUN" else a for a in args],
        ],
        env=env,
        cwd=db.parent,
        capture_output=True,
        timeout=60,
    )
    output = (proc.stdout + proc.stderr).decode("utf-8", "backslashreplace")
    assert_one_line_error(output, proc.returncode)
    assert written(db) == before


# --- defect 9: passwords ---------------------------------------------------------------------

PASSWORDS = [
    pytest.param("Mq5ecr/Et9zk", id="slash"),
    pytest.param("Mq5ecr#Et9zk", id="hash"),
    pytest.param("Mq5ecr?Et9zk", id="question"),
    pytest.param("Mq5ecr@Et9zk", id="at"),
    pytest.param("Mq5ecr:Et9zk", id="colon"),
    pytest.param("Mq5ecr%Et9zk", id="percent"),
    pytest.param("Mq5ecr%2FEt9zk%23Qx7", id="percent-encoded"),
]
PIECES = ("Mq5ecr", "Et9zk", "Qx7")


def assert_no_piece(text: str) -> None:
    for piece in PIECES:
        assert piece not in text, f"{piece!r} leaked in:\n{text}"


@pytest.mark.parametrize("password", PASSWORDS)
def test_the_one_masking_function_hides_the_password_and_its_pieces(password: str) -> None:
    for url in (f"amqp://u:{password}@127.0.0.1:1/", f"postgresql://u:{password}@db:5432/x"):
        assert password_of(url) == password
        masked = mask_url(url)
        assert masked.startswith(url.split(":")[0] + "://u:***@") and "***@" in masked, masked
        assert_no_piece(masked)
        pika_like = f"Port could not be cast to integer value as 'Mq5ecr'; host 'Et9zk@db' {url}"
        assert_no_piece(scrub(pika_like, password_of(url)))
        assert_no_piece(scrub(f"connecting to {url} failed"))  # an unknown URL in a text
    assert mask_url("amqp://u:p@127.0.0.1:1/") == "amqp://u:***@127.0.0.1:1/"
    assert mask_url("postgresql://u@h/x?password=Mq5ecr&sslmode=disable") == (
        "postgresql://u@h/x?password=***&sslmode=disable"
    )
    assert mask_url("amqp://localhost/") == "amqp://localhost/"


@pytest.mark.parametrize("password", PASSWORDS)
def test_health_prints_no_piece_of_the_password(
    db: Path, monkeypatch: pytest.MonkeyPatch, password: str
) -> None:
    monkeypatch.setenv("SAGALOOP_BROKER_URL", f"amqp://u:{password}@127.0.0.1:1/")
    result = CliRunner().invoke(cli, ["health", "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["database"] == "ok" and report["broker"].startswith("error"), report
    assert_no_piece(result.output)
    monkeypatch.setenv("SAGALOOP_BROKER_URL", "database")
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", f"postgresql://u:{password}@127.0.0.1:1/x")
    result = CliRunner().invoke(cli, ["health"])
    assert result.exit_code == 1 and "error" in result.output, result.output
    assert_no_piece(result.output)


def test_services_print_no_piece_of_the_password(tmp_path: Path) -> None:
    """``engine`` (database URL) and ``worker`` (broker URL) with a password of every kind, and
    ``dev`` with three, in real processes: whether they give up at once (pika cannot parse the
    URL) or retry (unreachable), nothing they print holds the password or a piece of it."""
    (tmp_path / "hostile_client_cli.py").write_text(CLI_APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    sqlite = f"sqlite:///{tmp_path / 'services.db'}"
    cases: list[tuple[str, dict[str, str], list[str]]] = []
    for n, param in enumerate(PASSWORDS):
        password = str(param.values[0])
        broker = {
            "SAGALOOP_DATABASE_URL": sqlite,
            "SAGALOOP_BROKER_URL": f"amqp://u:{password}@127.0.0.1:1/",
        }
        database = {"SAGALOOP_DATABASE_URL": f"postgresql://u:{password}@127.0.0.1:1/x"}
        cases += [
            (f"worker-{n}", broker, ["worker", "--queue", "q"]),
            (f"engine-{n}", database, ["engine"]),
        ]
        if param.id in ("slash", "at", "percent-encoded"):  # parse error, retries, decoded
            cases.append((f"dev-{n}", broker, ["dev"]))
    assert (
        subprocess.run(
            [sys.executable, "-m", "sagaloop", "db", "upgrade"],
            env={**env, "SAGALOOP_DATABASE_URL": sqlite},
            cwd=tmp_path,
            capture_output=True,
        ).returncode
        == 0
    )
    logs = {name: tmp_path / f"{name}.log" for name, _, _ in cases}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, extra, args in cases:
            with logs[name].open("wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "sagaloop", "-v", *args, "--app", "hostile_client_cli"],
                    env={**env, **extra},
                    cwd=tmp_path,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

        def settled(name: str) -> bool:  # gave up, or retried
            text = logs[name].read_text()
            return procs[name].poll() is not None or "retry" in text or "next try" in text

        deadline = time.monotonic() + 90
        while not all(settled(name) for name in procs):
            assert time.monotonic() < deadline, {n: logs[n].read_text()[-2000:] for n in procs}
            time.sleep(0.2)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    for name, path in logs.items():
        text = path.read_text()
        assert "***" in text, f"{name} printed no masked URL:\n{text}"
        assert_no_piece(text)


def test_cli_send_event_refuses_data_that_does_not_fit_the_wait(db: Path) -> None:
    """`send-event RUN reply --data '{"msg":"typo"}'` against `wait_for_event("reply",
    model=Reply)`: one line, a non-zero exit, nothing sent; a fitting event is sent."""
    import hostile_client_cli as module  # the fixture's app, importable as the CLI's is

    h = Harness(module.app, url=f"sqlite:///{db}", clock=VirtualClock(datetime.now(UTC)))
    run_id = h.start(module.ask)
    h.run_until_idle(skip_time=False)
    before = written(db)
    result = run("send-event", run_id, "reply", "--data", '{"msg": "typo"}')
    assert result.exit_code != 0
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "accepted" in result.output and "nothing was sent" in result.output
    assert written(db) == before
    assert (
        run("send-event", run_id, "reply", "--data", '{"text": "yes", "accepted": true}').exit_code
        == 0
    )
    h.clock.set(datetime.now(UTC))  # the CLI stamped its message with the real time
    h.run_until_idle(skip_time=False)
    assert h.result(run_id) == "yes"
