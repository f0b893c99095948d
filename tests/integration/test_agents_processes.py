"""Agents run as sagas by real processes that are SIGKILLed: separate `sagaloop engine` and
`sagaloop worker` processes on RabbitMQ + PostgreSQL, and one `sagaloop dev` process on a SQLite
file. The runs alternate between agent_app.py's two agents, the same shop as a Pydantic AI agent
(`SagaAgent`, saga ``checkout``) and as an OpenAI Agents SDK agent (`SagaRunner`, saga
``checkout_oa``): turn 0 calls ``charge`` and ``note`` in parallel, turn 1 ``ship``, turn 2
answers with the results.

Checked from the ledger outside the engine: each model request served once per (run, turn) --
never paid twice --, each tool's effect once per run, the non-idempotent charge made once (an
attempt in doubt is reconciled, not repeated), and every run's answer the same (the parallel tool
calls replay deterministically)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from agent_app import Ledger
from system import HERE, ROOT, System

from sagaloop.client import Client
from sagaloop.engine import history as h
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually, services

pytestmark = pytest.mark.integration
APP = "agent_app"
RUNS = 5
ORDER = {"order": "o-7", "amount": 42}
ANSWER = json.dumps(["charge: charged o-7 42", "note: noted charge o-7", "ship: shipped o-7"])
TURNS = 3  # model requests per run
TOOLS = ("charge", "note", "ship")
SAGAS = ("checkout", "checkout_oa")
MODEL_STEPS = {
    "checkout": "agent__shop__model_request",
    "checkout_oa": "agent__shop_oa__model_request",
    "checkout_here": "agent__shop_here__model_request",
}
CHARGE_STEPS = {"agent__shop__tool__charge", "agent__shop_oa__tool__charge"}
FINAL = {"completed", "failed", "compensated", "cancelled"}


def statuses(client: Client, run_ids: list[str]) -> dict[str, str]:
    runs = {r: client.store.get_run(r) for r in run_ids}
    return {r: run.status if run else "absent" for r, run in runs.items()}


def assert_each_once(
    ledger: Ledger, client: Client, run_ids: list[str], roles: dict[int, str] | None = None
) -> None:
    """What the ledger and the histories must show once every run completed. ``roles`` names
    the processes by pid, for the message of a charge made twice."""
    calls = Counter((str(r), int(t)) for r, t in ledger.query("select * from model_calls"))
    paid_twice = {k: n for k, n in calls.items() if n > 1}
    assert not paid_twice, f"model requests paid more than once, (run, turn): times: {paid_twice}"
    assert set(calls) == {(r, t) for r in run_ids for t in range(TURNS)}, sorted(calls)

    made = ledger.query("select run_id, key, pid, at from charges order by at")
    charges = Counter(str(r) for r, *_ in made)
    if charges != Counter(dict.fromkeys(run_ids, 1)):
        twice = [
            (r, k, (roles or {}).get(int(pid), pid), f"{at:.3f}")
            for r, k, pid, at in made
            if charges[str(r)] > 1
        ]
        states = {r: charge_states(client, [r]) for r, _, _, _ in twice}
        raise AssertionError(
            f"a charge made more than once (run, tool call, by, at): {twice}; the charge "
            f"step's state: {states}"
        )
    effects = Counter((str(r), str(n)) for r, n in ledger.query("select run_id, name from effects"))
    assert effects == Counter({(r, t): 1 for r in run_ids for t in TOOLS}), (
        f"a tool's effect twice (under two keys: the tool called again): {effects}"
    )

    answers = {r: client.get(r).output for r in run_ids}
    assert set(answers.values()) == {ANSWER}, answers
    for run_id in run_ids:
        events = client.history(run_id)
        assert [e.seq for e in events] == list(range(1, len(events) + 1)), run_id
        commands = [e.pos for e in events if e.kind in h.COMMAND_KINDS]
        assert len(commands) == len(set(commands)), f"{run_id}: a position twice: {commands}"
        steps = Counter(e.name for e in events if e.kind == h.STEP_COMPLETED)
        assert steps[MODEL_STEPS[client.get(run_id).saga]] == TURNS, (run_id, steps)
        assert [e.kind for e in events].count(h.RUN_FINISHED) == 1, run_id
    assert client.store.dead_letters() == []


def charge_states(client: Client, run_ids: list[str]) -> list[str]:
    return [
        line.state for r in run_ids for line in client.status(r).steps if line.step in CHARGE_STEPS
    ]


# --- separate engine and workers on RabbitMQ and PostgreSQL --------------------------------------


@pytest.fixture(scope="module")
def rabbit(
    tmp_path_factory: pytest.TempPathFactory, rabbitmq_url: str
) -> Iterator[tuple[System, Ledger]]:
    ledger_url, drop = services.fresh_database(services.postgres_url())
    system = System(tmp_path_factory.mktemp("rabbit"), rabbitmq_url, app=APP)
    try:
        system.env["LEDGER_URL"] = ledger_url  # the processes' ledger: PostgreSQL
        ledger = Ledger(url=ledger_url)
        ledger.create()
        yield system, ledger
    finally:
        system.close()
        drop()


def test_engine_and_workers_sigkilled_at_crash_points(rabbit: tuple[System, Ledger]) -> None:
    """Four processes, each armed with a crash point, each restarted unarmed once it died:

    - the engine, before committing its 5th activation batch (its outbox relay dies with it,
      wherever it is: rows published and not yet deleted are published again);
    - the model worker, right after committing its 4th model response, before the ack. It runs
      one step at a time, so no other model request is in flight when it dies (a request cut
      off half-way is paid again: a model step is at least once);
    - the "tools" worker, after its 3rd tool body ran (note or ship), before its result is
      committed: run again with the same key, the effect recorded once;
    - the "payments" worker, after its 2nd charge, before the commit: the redelivered attempt
      is in doubt, and reconciled instead of charging again."""
    system, ledger = rabbit

    def model_worker(**env: str) -> subprocess.Popen[bytes]:
        args = ["worker", "--queue", "model", "--concurrency", "1", "--poll", "0.05"]
        return system._spawn("worker", args, env)

    respawn: dict[str, Callable[[], subprocess.Popen[bytes]]] = {
        "engine": system.engine,
        "model": model_worker,
        "tools": lambda: system.worker(queues="tools"),
        "payments": lambda: system.worker(queues="payments"),
    }
    armed = {
        "engine": system.engine(SAGALOOP_CRASH_AT="engine.before_commit:5"),
        "model": model_worker(SAGALOOP_CRASH_AT="worker.after_commit:4"),
        "tools": system.worker(queues="tools", SAGALOOP_CRASH_AT="worker.before_commit:3"),
        "payments": system.worker(queues="payments", SAGALOOP_CRASH_AT="worker.before_commit:2"),
    }
    eventually(
        lambda: system.logs().count("worker: app") == 3 and "engine: app" in system.logs(),
        120,  # four processes importing the agent frameworks at once, on a busy machine
        what="the engine and the three workers to start",
    )
    run_ids = [system.client.start(SAGAS[i % 2], ORDER) for i in range(RUNS)]
    roles = {p.pid: role for role, p in armed.items()}

    unfinished_at_death: dict[str, int] = {}

    def supervise() -> bool:
        """Restart (unarmed) each armed process its crash point killed; done when all died
        and every run is over."""
        for role, proc in list(armed.items()):
            if proc.poll() is None:
                continue
            assert proc.returncode == -signal.SIGKILL, f"{role} exited\n{system.logs()}"
            unfinished = statuses(system.client, run_ids).values()
            unfinished_at_death[role] = sum(s not in FINAL for s in unfinished)
            del armed[role]
            roles[respawn[role]().pid] = f"{role} (restarted)"
        return not armed and set(statuses(system.client, run_ids).values()) <= FINAL

    try:
        eventually(supervise, timeout=180, what=f"crash points {sorted(armed)} and the runs")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{statuses(system.client, run_ids)}\n{system.logs()}") from None

    assert statuses(system.client, run_ids) == dict.fromkeys(run_ids, "completed"), system.logs()
    assert all(unfinished_at_death.values()), (
        f"a process died after the runs: {unfinished_at_death}"
    )
    assert_each_once(ledger, system.client, run_ids, roles)
    assert "reconciled" in charge_states(system.client, run_ids), (
        "the charge cut off after its body ran was reconciled"
    )
    assert system.dead_letter_count() == 0, system.logs()
    dead = [p.returncode for p in system.procs if p.poll() is not None]
    assert dead == [-signal.SIGKILL] * 4, f"only the armed processes died\n{system.logs()}"


def test_an_agent_of_in_process_steps_runs_in_the_engine_killed_mid_run(
    tmp_path: Path, rabbitmq_url: str
) -> None:
    """``SagaAgent(..., local=True)`` (saga ``checkout_here``): its model requests and the tools
    ``charge`` and ``note`` run in `sagaloop engine`'s process, which no worker helps (one
    worker runs "tools", for ``ship``, an app step of its own). The engine is SIGKILLed right
    after its 4th in-process checkpoint, before its ack, and restarted: the runs go on from their
    histories and every effect happens once."""
    ledger_url, drop = services.fresh_database(services.postgres_url())
    system = System(tmp_path, rabbitmq_url, app=APP)
    try:
        system.env["LEDGER_URL"] = ledger_url
        ledger = Ledger(url=ledger_url)
        ledger.create()
        armed = system.engine(SAGALOOP_CRASH_AT="local.after_commit:4")
        worker = system.worker(queues="tools")
        run_ids = [system.client.start("checkout_here", ORDER) for _ in range(3)]
        eventually(lambda: armed.poll() is not None, 120, what="the armed engine to die")
        assert armed.returncode == -signal.SIGKILL, system.logs()
        assert {s for s in statuses(system.client, run_ids).values()} - FINAL, "runs left"
        engine = system.engine()
        eventually(
            lambda: set(statuses(system.client, run_ids).values()) <= FINAL,
            120,
            what="the runs to finish after the restart",
        )
        assert statuses(system.client, run_ids) == dict.fromkeys(run_ids, "completed")
        assert_each_once(ledger, system.client, run_ids)
        # where each body ran (an idempotent body in flight when the engine died ran again:
        # its effect is once, checked above)
        where = {
            (str(r), str(n), "engine" if int(pid) in (armed.pid, engine.pid) else "worker")
            for r, n, pid in ledger.query("select run_id, name, pid from bodies")
        }
        expected = {(r, "charge", "engine") for r in run_ids}
        expected |= {(r, "note", "engine") for r in run_ids}
        assert where == expected | {(r, "ship", "worker") for r in run_ids}, where
        assert worker.poll() is None
    finally:
        system.close()
        drop()


# --- one `sagaloop dev` process on a SQLite file -------------------------------------------------


class DevProcesses:
    """`sagaloop dev` processes, one after the other, on one SQLite database and ledger."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ledger = Ledger(path=str(tmp / "ledger.db"))
        self.env = {
            **os.environ,
            "SAGALOOP_DATABASE_URL": f"sqlite:///{tmp / 'sagaloop.db'}",
            "SAGALOOP_LEASE": "2",
            "LEDGER_PATH": str(tmp / "ledger.db"),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
        }
        self.env.pop("LEDGER_URL", None)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(self, **env: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"dev-{len(self.procs)}.log"
        self.logs.append(log)
        # more step threads than runs: the charges that hang leave threads for the rest
        args = ["dev", "--app", APP, "--poll", "0.05", "--concurrency", str(RUNS + 3)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", *args],
            env={**self.env, **env},
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
        )
        self.procs.append(proc)
        eventually(lambda: "dev: app" in log.read_text(errors="replace"), 120, "dev to start")
        return proc

    def log_text(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self.logs
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevProcesses]:
    d = DevProcesses(tmp_path_factory.mktemp("dev"))
    try:
        yield d
    finally:
        d.close()


def test_dev_sigkilled_mid_run_and_restarted(dev: DevProcesses) -> None:
    """Every charge hangs right after it is made; once every run's first model response is
    committed and every run's charge made, no model request can be in flight (each run waits
    for its charge): SIGKILL then. The restarted process finds each charge in doubt and
    reconciles it; the model requests already answered are not made again."""
    dev.ledger.create()
    first = dev.start(AGENT_HANG_AT="charge")
    store = SqlStore(dev.env["SAGALOOP_DATABASE_URL"])
    try:
        client = Client(store, APP)
        run_ids = [client.start(SAGAS[i % 2], ORDER) for i in range(RUNS)]

        def answered_and_charged() -> bool:
            answered = all(
                any(
                    e.kind == h.STEP_COMPLETED and e.name in MODEL_STEPS.values()
                    for e in client.history(r)
                )
                for r in run_ids
            )
            charged = dev.ledger.query("select count(*) from charges")[0][0]
            return answered and charged == RUNS

        try:
            eventually(answered_and_charged, timeout=90, what="every run to hang in its charge")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{dev.log_text()}") from None
        assert set(statuses(client, run_ids).values()) == {"running"}, statuses(client, run_ids)
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL

        second = dev.start()
        try:
            eventually(
                lambda: set(statuses(client, run_ids).values()) <= FINAL,
                timeout=40,
                what="the runs to finish after the restart",
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n{statuses(client, run_ids)}\n{dev.log_text()}") from None
        assert statuses(client, run_ids) == dict.fromkeys(run_ids, "completed"), dev.log_text()
        assert_each_once(dev.ledger, client, run_ids)
        assert charge_states(client, run_ids) == ["reconciled"] * RUNS, (
            "each charge cut off after it was made is reconciled, not made again"
        )
        assert second.poll() is None, dev.log_text()
    finally:
        store.close()
