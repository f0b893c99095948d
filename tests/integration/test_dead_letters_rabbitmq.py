"""RabbitMQ's dead letters through the CLI: one that sagaloop dead-lettered (a stamped id) and
one that RabbitMQ dead-lettered over the delivery limit (a derived id) are listed, shown,
counted by ``health``, resent (and consumed, still trusted) and purged."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pika
import pytest
from click.testing import CliRunner, Result

from sagaloop.brokers.rabbitmq import RabbitBroker
from sagaloop.cli.main import cli
from sagaloop.engine.ports import Delivery
from sagaloop.store.sql import SqlStore
from sagaloop.testing import VirtualClock, eventually

pytestmark = pytest.mark.integration

LEASE = timedelta(seconds=30)
QUEUE = "dlshop.steps.pay"
STEP = b'{"type":"step","run_id":"r1","message_id":"step:r1:0:1"}'
HANGS = b'{"type":"step","run_id":"r2","message_id":"step:r2:0:1"}'


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


class Rabbit:
    def __init__(self, url: str, store: SqlStore, namespace: str) -> None:
        self.clock = VirtualClock()
        self.broker = RabbitBroker(
            url,
            namespace=namespace,
            delivery_limit=2,
            clock=self.clock,
            lease=LEASE,
            signing_key=store.signing_key(),
        )
        self.broker.declare([QUEUE])

    def receive(self, n: int) -> list[Delivery]:
        out: list[Delivery] = []
        deadline = time.monotonic() + 10
        while len(out) < n and time.monotonic() < deadline:
            out += self.broker.receive([QUEUE], n - len(out), 0.5)
        assert len(out) == n, f"expected {n} deliveries, got {len(out)}"
        return out


@pytest.fixture
def rabbit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rabbitmq_url: str) -> Iterator[Rabbit]:
    """A fresh namespace and database, named by the SAGALOOP_ settings the CLI reads."""
    for name in list(os.environ):
        if name.startswith("SAGALOOP_"):
            monkeypatch.delenv(name)
    namespace = f"test-dl-{uuid.uuid4().hex[:10]}"
    url = f"sqlite:///{tmp_path / 'dl.db'}"
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", url)
    monkeypatch.setenv("SAGALOOP_BROKER_URL", rabbitmq_url)
    monkeypatch.setenv("SAGALOOP_NAMESPACE", namespace)
    store = SqlStore(url)
    store.upgrade()
    r = Rabbit(rabbitmq_url, store, namespace)
    try:
        yield r
    finally:
        r.broker.close()
        store.close()
        connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
        channel = connection.channel()
        for q in (QUEUE, "dead"):
            channel.queue_delete(f"{namespace}.{q}")
        for exchange in ("", ".internal", ".dlx"):
            channel.exchange_delete(namespace + exchange)
        connection.close()


def test_dead_letters_on_rabbitmq_through_the_cli(rabbit: Rabbit) -> None:
    broker = rabbit.broker
    broker.publish([(QUEUE, STEP), (QUEUE, HANGS)])
    unknown, hangs = rabbit.receive(2)
    assert unknown.trusted and hangs.trusted, "signed by the broker"
    unknown.dead_letter("worker does not know step 'pay'")
    for _ in range(2):  # a worker that never acks: each lease expiry is a delivery
        rabbit.clock.advance(LEASE + timedelta(seconds=1))
        (hangs,) = rabbit.receive(1)
    rabbit.clock.advance(LEASE + timedelta(seconds=1))
    eventually(lambda: broker.count_dead_letters() == 2, 10, "RabbitMQ dead-letters it")

    listed = run("dead-letters", "list", "--json")
    assert listed.exit_code == 0, listed.output
    first, second = json.loads(listed.output)["dead_letters"]
    assert all(re.fullmatch("[0-9a-f]{12}", d["id"]) for d in (first, second)), (first, second)
    assert (first["queue"], first["type"], first["run_id"]) == (QUEUE, "step", "r1")
    assert first["reason"] == "worker does not know step 'pay'"
    assert (second["queue"], second["message_id"]) == (QUEUE, "step:r2:0:1")
    assert "delivery limit" in second["reason"] and second["at"] is not None
    assert json.loads(run("dead-letters", "list", "--json").output)["dead_letters"] == [
        first,
        second,
    ], "the same ids on every read"
    table = run("dead-letters", "list").output
    assert table.splitlines()[2].startswith(first["id"]) and "2 dead letters" in table

    report = json.loads(run("health", "--json").output)
    assert (report["dead_letters"], report["outbox_dead_letters"]) == (2, 0), report
    assert report["broker"] == "ok"
    assert "dead_letters             2" in run("health").output.splitlines()
    shown = json.loads(run("dead-letters", "show", second["id"], "--json").output)
    assert shown["envelope"] == json.loads(HANGS)

    missing = run("dead-letters", "resend", "0123456789ab")
    assert missing.exit_code == 1 and "no dead letter with id '0123456789ab'" in missing.output
    for letter, body in ((second, HANGS), (first, STEP)):
        resent = run("dead-letters", "resend", letter["id"])
        assert resent.output == f"resent {letter['id']} to {QUEUE}\n", resent.output
        (back,) = rabbit.receive(1)
        assert (back.body, back.trusted) == (body, True), "unchanged, and still sagaloop's"
        back.ack()
    assert run("dead-letters", "list").output == "no dead letters\n"

    broker.publish([(QUEUE, STEP)])
    (again,) = rabbit.receive(1)
    again.dead_letter("poison")
    assert json.loads(run("health", "--json").output)["dead_letters"] == 1
    assert run("dead-letters", "purge", "--all", "--yes").output == "purged 1 dead letter\n"
    assert broker.count_dead_letters() == 0


def test_the_console_lists_the_dead_letters_of_rabbitmq(rabbit: Rabbit) -> None:
    """The console run as ``sagaloop ui`` is (settings naming RabbitMQ) lists the dead letter
    that ``health`` counts, not the database's empty table (issue 26)."""
    from starlette.testclient import TestClient

    from sagaloop.cli.common import Obj
    from sagaloop.cli.ui import console
    from sagaloop.client import Client

    rabbit.broker.publish([(QUEUE, STEP)])
    (unknown,) = rabbit.receive(1)
    unknown.dead_letter("worker does not know step 'pay'")
    eventually(lambda: rabbit.broker.count_dead_letters() == 1, 10, "RabbitMQ dead-letters it")
    assert json.loads(run("health", "--json").output)["dead_letters"] == 1

    obj = Obj()
    store = obj.store()
    try:
        page = TestClient(console(obj, Client(store), None, None), base_url="http://127.0.0.1")
        html = page.get("/dead-letters").text
    finally:
        store.close()
    assert "No dead letter." not in html
    assert "worker does not know step &#39;pay&#39;" in html and f"<code>{QUEUE}</code>" in html
    assert "<code>r1</code>" in html and "step:r1:0:1" in html


def test_sagaloop_ui_lists_rabbitmqs_dead_letters(rabbit: Rabbit, tmp_path: Path) -> None:
    """The process: ``sagaloop ui`` started with the settings that name RabbitMQ serves the
    dead letter that ``health`` counts on its Dead letters page."""
    import socket
    import subprocess
    import sys

    import httpx2

    rabbit.broker.publish([(QUEUE, STEP)])
    (unknown,) = rabbit.receive(1)
    unknown.dead_letter("worker does not know step 'pay'")
    eventually(lambda: rabbit.broker.count_dead_letters() == 1, 10, "RabbitMQ dead-letters it")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [str(Path(sys.executable).with_name("sagaloop")), "ui", "--port", str(port)]
    log = tmp_path / "ui.log"
    with log.open("wb") as out:
        ui = subprocess.Popen(command, env=dict(os.environ), stdout=out, stderr=out)
    try:

        def page() -> str | None:
            try:
                return httpx2.get(f"http://127.0.0.1:{port}/dead-letters", timeout=5).text
            except httpx2.HTTPError:
                assert ui.poll() is None, log.read_text()
                return None

        html = eventually(page, 60, "sagaloop ui serves")
        assert "worker does not know step &#39;pay&#39;" in html, html
        assert "<code>r1</code>" in html and "No dead letter." not in html
    finally:
        ui.terminate()
        ui.wait(timeout=30)


def test_the_console_resends_a_dead_letter_of_rabbitmq(rabbit: Rabbit) -> None:
    """Resend in the console run as ``sagaloop ui`` is: after the confirmation, the letter
    goes back to its queue unchanged and still sagaloop's, and leaves RabbitMQ's dead letters
    (what ``sagaloop dead-letters resend ID`` does, through the same ``resend_one``)."""
    import re as regex

    from starlette.testclient import TestClient

    from sagaloop.cli.common import Obj
    from sagaloop.cli.ui import console
    from sagaloop.client import Client

    rabbit.broker.publish([(QUEUE, STEP)])
    (unknown,) = rabbit.receive(1)
    unknown.dead_letter("worker does not know step 'pay'")
    eventually(lambda: rabbit.broker.count_dead_letters() == 1, 10, "RabbitMQ dead-letters it")

    obj = Obj()
    store = obj.store()
    try:
        base = "http://127.0.0.1"
        page = TestClient(console(obj, Client(store), None, None), base_url=base)
        html = page.get("/dead-letters").text
        (letter_id,) = regex.findall(r'name="id" value="([^"]+)"', html)
        csrf = regex.search(r'name="csrf" value="([^"]+)"', html)
        assert csrf is not None
        form = {"id": letter_id, "csrf": csrf.group(1)}
        headers = {"origin": base}
        asked = page.post("/dead-letters/resend", data=form, headers=headers)
        assert asked.status_code == 200 and "Resend dead letter" in asked.text
        assert rabbit.broker.count_dead_letters() == 1, "nothing done before the confirmation"
        done = page.post(
            "/dead-letters/resend",
            data={**form, "confirmed": "1"},
            headers=headers,
            follow_redirects=False,
        )
        assert done.status_code == 303, done.text
        (back,) = rabbit.receive(1)
        assert (back.body, back.trusted) == (STEP, True), "unchanged, and still sagaloop's"
        back.ack()
        assert rabbit.broker.count_dead_letters() == 0
        assert "No dead letter." in page.get("/dead-letters").text
        gone = page.post("/dead-letters/resend", data={**form, "confirmed": "1"}, headers=headers)
        assert gone.status_code == 409 and "no dead letter with id" in gone.text
    finally:
        store.close()


def test_rabbitmq_tells_a_queues_depth_by_a_passive_declare(rabbit: Rabbit) -> None:
    broker = rabbit.broker
    assert broker.queue_depth(QUEUE) == 0
    broker.publish([(QUEUE, STEP), (QUEUE, HANGS)])
    eventually(lambda: broker.queue_depth(QUEUE) == 2, 10, "the two messages counted")
    assert broker.queue_depth("dlshop.steps.nobody-declared-it") is None
    assert broker.queue_depth(QUEUE) == 2, "the channel the unknown queue closed is not reused"
