"""examples/raw_openai_loop in real `sagaloop dev` processes on a SQLite file, SIGKILLed at crash
points and restarted, against the OpenAI-compatible server of tests/unit/openai_server.py run
as a process of its own (the real `openai` client, streaming, on 127.0.0.1).

Counted outside the engine: the requests the server received (by turn: the number of assistant
messages a request holds) and the shop's SQLite file (refunds, which the shop does not
deduplicate, and mails). Each `chat` request records only its new messages (``Conversation``):
a process started after a kill rebuilds the full list from the run's history."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples.raw_openai_loop.shop import Shop
from sagaloop.client import Client
from sagaloop.engine import history as h
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually
from tests.unit.openai_server import call, reply

ROOT = Path(__file__).resolve().parents[2]
APP = "examples.raw_openai_loop.app"
pytestmark = pytest.mark.chaos

SCRIPT = [
    reply("Looking it up.", tool_calls=[call("call_1", "lookup_order", {"order_id": "o-17"})]),
    reply(
        tool_calls=[
            call("call_2", "issue_refund", {"order_id": "o-17", "cents": 4200, "reason": "damaged"})
        ]
    ),
    reply(tool_calls=[call("call_3", "mail_customer", {"order_id": "o-17", "text": "Refunded."})]),
    reply("Refunded 42.00 for o-17 and mailed Ann."),
]


class Processes:
    """The model server, then `sagaloop dev` processes one after the other, on one database."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        script = tmp / "script.json"
        script.write_text(json.dumps(SCRIPT))
        server = subprocess.Popen(
            [sys.executable, "-m", "tests.unit.openai_server", "--port", "0", "--script", script],
            cwd=ROOT,
            stdout=subprocess.PIPE,
        )
        self.procs.append(server)
        assert server.stdout is not None
        self.base_url = server.stdout.readline().decode().strip()
        assert self.base_url.startswith("http://127.0.0.1:"), self.base_url
        self.env = {
            **os.environ,
            "SAGALOOP_DATABASE_URL": f"sqlite:///{tmp / 'sagaloop.db'}",
            "SAGALOOP_LEASE": "2",
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": "test-key",
            "RAW_LOOP_MODEL": "scripted-model",
            "RAW_LOOP_DATA": str(tmp),
            "PYTHONPATH": str(ROOT),
        }
        self.env.pop("SAGALOOP_CRASH_AT", None)

    def dev(self, crash_at: str = "") -> subprocess.Popen[bytes]:
        log = self.tmp / f"dev-{len(self.logs)}.log"
        self.logs.append(log)
        proc = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", "dev", "--app", APP, "--poll", "0.05"],
            cwd=self.tmp,
            env={**self.env, "SAGALOOP_CRASH_AT": crash_at},
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
        )
        self.procs.append(proc)
        return proc

    def requests(self) -> list[dict[str, Any]]:
        """The model requests the server received, in order (``turn``, ``messages``, ...)."""
        url = self.base_url.removesuffix("/v1") + "/_requests"
        with urllib.request.urlopen(url, timeout=10) as response:
            requests: list[dict[str, Any]] = json.load(response)
        return requests

    def turns(self) -> Counter[int]:
        """How many model requests reached the server, by turn."""
        return Counter(r["turn"] for r in self.requests())

    def log_text(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.logs
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    p = Processes(tmp_path)
    try:
        yield p
    finally:
        p.close()


def test_model_and_tool_calls_once_across_sigkills_of_dev(processes: Processes) -> None:
    """Three `sagaloop dev` processes die by SIGKILL at crash points, a fourth finishes the run:

    1. the model's first reply reached the step, not yet recorded: that request is in flight
       at the kill, so it is sent again (a model step runs at least once; it has no reconcile);
    2. ``issue_refund`` made the refund, its result not yet recorded: the redelivered attempt
       is in doubt and its reconcile finds the refund by the step's key, so no second refund;
    3. the model's third reply recorded, the process dies right after: not asked again.

    Every model request whose reply was recorded reached the server once; every tool's effect
    happened once. The third and fourth requests ran in processes that had not seen the
    previous one: their steps rebuilt the message list from the run's history, and the model
    got it whole."""
    store = SqlStore(processes.env["SAGALOOP_DATABASE_URL"])
    shop = Shop(processes.tmp / "shop.db")
    try:
        store.upgrade()
        client = Client(store, "shop-support")
        run_id = client.start("support", "My order o-17 arrived broken.")

        def completed(step: str) -> int:
            events = client.history(run_id)
            return sum(e.kind == h.STEP_COMPLETED and e.name == step for e in events)

        def killed(proc: subprocess.Popen[bytes], what: str) -> None:
            try:
                eventually(lambda: proc.poll() is not None, timeout=30, what=what)
            except AssertionError as e:
                raise AssertionError(f"{e}\n{processes.log_text()}") from None
            assert proc.returncode == -signal.SIGKILL, processes.log_text()

        # 1. dies after the first model reply arrived, before recording it
        killed(processes.dev("worker.before_commit:1"), "the crash after the first reply")
        assert processes.turns() == Counter({0: 1}) and completed("chat") == 0

        # 2. its commits: the first request (sent again), lookup_order, the second request,
        # then issue_refund, which dies after the refund was made
        killed(processes.dev("worker.before_commit:4"), "the crash inside issue_refund")
        assert processes.turns() == Counter({0: 2, 1: 1})
        assert len(shop.refunds()) == 1 and completed("issue_refund") == 0

        # 3. the refund reconciled, then the third reply recorded (the worker committed it
        # with the result message for the engine): dies right after
        killed(processes.dev("worker.after_commit:2"), "the crash after the third reply")
        assert processes.turns() == Counter({0: 2, 1: 1, 2: 1})
        assert len(shop.refunds()) == 1

        last = processes.dev()
        try:
            eventually(
                lambda: client.get(run_id).status not in ("pending", "running"),
                timeout=30,
                what="the run to finish",
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n{processes.log_text()}") from None
        assert client.result(run_id, timeout=0) == "Refunded 42.00 for o-17 and mailed Ann."
        last.send_signal(signal.SIGTERM)
        assert last.wait(timeout=30) == 0, "dev stops cleanly on SIGTERM"

        assert processes.turns() == Counter({0: 2, 1: 1, 2: 1, 3: 1}), (
            "each recorded reply was asked for once; only the request in flight at the first "
            "kill was sent again"
        )
        assert completed("chat") == 4
        # the model got each turn's full list; the history holds each message once
        requests = processes.requests()
        by_turn = {r["turn"]: r["messages"] for r in requests}
        assert all(r["messages"] == by_turn[r["turn"]] for r in requests)
        assert [len(by_turn[t]) for t in range(4)] == [2, 4, 6, 8]
        for turn in range(1, 4):
            assert by_turn[turn][: 2 * turn] == by_turn[turn - 1]
        deltas = [
            e.data["args"]["request"]["transcript"]
            for e in client.history(run_id)
            if e.kind == h.STEP_SCHEDULED and e.name == "chat"
        ]
        assert [(d["keep"], len(d["append"])) for d in deltas] == [(0, 2), (2, 2), (4, 2), (6, 2)]
        [refund] = shop.refunds()
        [mail] = shop.mails()
        steps = {line.step: line for line in client.status(run_id).steps}
        assert steps["issue_refund"].state == "reconciled", "found by its key, not made again"
        assert refund[1] == steps["issue_refund"].idempotency_key == f"{run_id}/5/do"
        assert mail[0] == steps["mail_customer"].idempotency_key
    finally:
        store.close()
