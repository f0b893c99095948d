"""Published events on real processes (issue 25 item 1), on the embedded default (one `sagaloop
dev` process on a SQLite file): two runs waiting on one key each take the event once, a
predicate picks the event its run takes, a subscription keeps what is published while its run
does something else, and a publish sent again under its id starts one run. The process is
SIGKILLed between publishes and restarted: the subscriptions are the database's, not the
process's. (The kill in the middle of a fan-out is the crash matrix's:
tests/chaos/test_crash_publish.py.)"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from test_hostile_saga_processes import Dev

from sagaloop.client import Client
from sagaloop.engine import history as h
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually

pytestmark = pytest.mark.integration
APP = "publish_app"
FINAL = {"completed", "failed", "compensated", "cancelled"}


def _status(client: Client, run_id: str) -> str:
    run = client.store.get_run(run_id)
    return run.status if run is not None else "absent"


def _arrived(client: Client, run_id: str) -> list[object]:
    return [e.data["data"] for e in client.history(run_id) if e.kind == h.EVENT_ARRIVED]


def test_published_events_reach_their_runs_once_across_a_sigkill(tmp_path: Path) -> None:
    dev = Dev(tmp_path, APP)
    store = SqlStore(dev.env["SAGALOOP_DATABASE_URL"])
    client = Client(store, APP)
    try:
        eventually(lambda: "dev: app" in dev.log.read_text(), what="dev to start")
        for run_id, saga, value in [
            ("w1", "waiter", "K"),
            ("w2", "waiter", "K"),
            ("w3", "waiter", "OTHER"),
            ("u1", "watcher", "ada"),
            ("c1", "collector", 2),
        ]:
            client.start(saga, value, run_id=run_id)
        eventually(
            lambda: all(_status(client, r) == "waiting" for r in ("w1", "w2", "w3", "u1", "c1")),
            60,
            "the runs to wait",
        )
        dev.proc.send_signal(signal.SIGKILL)  # the subscriptions outlive the process
        assert dev.proc.wait(timeout=30) == -signal.SIGKILL
        dev = Dev(tmp_path, APP)

        client.publish_event("order.paid", {"amount": 5}, key="K", event_id="pay-1")
        client.publish_event("order.paid", {"amount": 5}, key="K", event_id="pay-1")  # again
        client.publish_event("user.signed_up", {"user": "bob"})
        client.publish_event("user.signed_up", {"user": "ada"})
        client.publish_event("tick", 1, key="clock")
        client.publish_event("tick", 2, key="clock")
        client.publish_event("order.placed", {"id": 7}, event_id="placed-7")
        client.publish_event("order.placed", {"id": 7}, event_id="placed-7")  # a retry

        done = ("w1", "w2", "u1", "c1", "placed-7")
        eventually(
            lambda: all(_status(client, r) in FINAL for r in done),
            90,
            f"{done} to finish\n{dev.log.read_text(errors='replace')[-4000:]}",
        )
        assert client.result("w1", timeout=0) == client.result("w2", timeout=0) == {"amount": 5}
        assert _arrived(client, "w1") == _arrived(client, "w2") == [{"amount": 5}]  # once each
        assert _status(client, "w3") == "waiting" and _arrived(client, "w3") == []
        assert client.result("u1", timeout=0) == {"user": "ada"}
        assert sorted(client.result("c1", timeout=0)) == [1, 2]  # no order between publishes
        assert client.result("placed-7", timeout=0) == {"id": 7}
        assert [r.run_id for r in client.list(saga="on_order")] == ["placed-7"]
        assert store.dead_letters() == []
        assert dev.proc.poll() is None
    finally:
        dev.close()
        store.close()
