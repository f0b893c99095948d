"""asyncio's timers in saga code are durable (tests/unit/test_asyncio_timers.py), proven on a
real process: a ``sagaloop dev`` process is SIGKILLed while its run waits on
``asyncio.wait_for`` and then on ``asyncio.sleep``; a new process finds the timers in the store
and the run ends once, its step run once, each timer fired (the process that set it is dead)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from sagaloop import Client
from sagaloop.engine import history as h
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually

pytestmark = pytest.mark.integration

APP = """
import asyncio
import os
from sagaloop import App, SagaContext, StepContext

app = App("napapp")

@app.step(local=True)
def record(ctx: StepContext, what: str) -> str:
    with open(os.environ["EFFECTS_PATH"], "a") as out:  # one line per execution of the body
        out.write(ctx.run_id + "\\n")
    return what

@app.saga(name="nap")
async def nap(ctx: SagaContext, seconds: float) -> str:
    try:
        answer = await asyncio.wait_for(ctx.wait_for_event("answer"), timeout=seconds)
    except TimeoutError:
        answer = "nobody answered"
    await asyncio.sleep(seconds)
    return await ctx.call(record, answer)
"""


class Dev:
    def __init__(self, tmp: Path) -> None:
        (tmp / "napapp.py").write_text(APP)
        self.tmp = tmp
        self.url = f"sqlite:///{tmp / 'sagaloop.db'}"
        self.effects = tmp / "effects.txt"
        self.effects.touch()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")} | {
            "SAGALOOP_DATABASE_URL": self.url,
            "SAGALOOP_RUN_DIR": str(tmp / "run"),
            "EFFECTS_PATH": str(self.effects),
            "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]),
        }
        spec = importlib.util.spec_from_file_location("napapp", tmp / "napapp.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.app = module.app
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"dev-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", "dev", "--app", "napapp"],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-1500:] for p in self.tmp.glob("dev-*.log"))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def dev(tmp_path: Path) -> Iterator[Dev]:
    d = Dev(tmp_path)
    try:
        yield d
    finally:
        d.close()


def test_asyncio_timers_outlive_the_process_that_set_them(dev: Dev) -> None:
    store = SqlStore(dev.url)
    store.upgrade()
    client = Client(store, dev.app)
    first = dev.start()
    run_id = client.start("nap", 4.0)

    def kinds() -> list[str]:
        return [e.kind for e in client.history(run_id)]

    eventually(lambda: h.EVENT_WAITING in kinds(), 60, f"the run to wait: {dev.logs()}")
    first.send_signal(signal.SIGKILL)  # the process that set wait_for's timer dies
    first.wait()
    dev.start()
    assert client.result(run_id, timeout=60) == "nobody answered", dev.logs()
    assert dev.effects.read_text().splitlines() == [run_id]  # the step ran once
    history = client.history(run_id)
    fired = [e.pos for e in history if e.kind == h.TIMER_FIRED]
    started = [e.pos for e in history if e.kind == h.TIMER_STARTED]
    assert fired == started and len(started) == 2, [(e.kind, e.pos) for e in history]
    assert store.next_timer_at() is None


def test_a_timeout_that_lost_to_its_event_leaves_no_timer_across_a_kill(dev: Dev) -> None:
    store = SqlStore(dev.url)
    store.upgrade()
    client = Client(store, dev.app)
    first = dev.start()
    run_id = client.start("nap", 30.0)
    eventually(lambda: h.EVENT_WAITING in [e.kind for e in client.history(run_id)], 60, dev.logs())
    client.send_event(run_id, "answer", "yes")
    eventually(
        lambda: h.TIMER_CANCELLED in [e.kind for e in client.history(run_id)], 60, dev.logs()
    )
    first.send_signal(signal.SIGKILL)  # while the run sleeps 30 s on asyncio.sleep
    first.wait()
    history = client.history(run_id)
    wait_timer, sleep_timer = [e for e in history if e.kind == h.TIMER_STARTED]
    cancelled = [e.pos for e in history if e.kind == h.TIMER_CANCELLED]
    assert cancelled == [wait_timer.pos]
    # one row is left, the sleep's: wait_for's was deleted with its timer_cancelled
    assert store.next_timer_at() == datetime.fromisoformat(sleep_timer.data["fire_at"])
    assert client.get(run_id).status == "waiting"
    assert any("sleeping until" in line for line in client.status(run_id).waiting_for)
    assert sum("sleeping" in line for line in client.status(run_id).waiting_for) == 1
