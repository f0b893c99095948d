"""The console's operations on the database broker, through its test client (issue 26): the
Workers page from the process registry and the queue table, Resend of a dead letter, approve
with edited arguments, and Cancel "now"."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from sagaloop.engine import history as h
from sagaloop.engine.messages import engine_queue, step_queue
from sagaloop.sagas.approvals import args_hash
from sagaloop.store.processes import Identity
from sagaloop.testing import Harness, services
from sagaloop.ui import create_app
from tests.ui import console_app
from tests.ui.test_ui_app import HERE, REFUND, csrf_of, post, waiting_refund

APP = "console-shop"


@pytest.fixture(params=["sqlite", "postgresql"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """The console's database on SQLite, and on a fresh PostgreSQL database."""
    if request.param == "sqlite":
        url, drop = f"sqlite:///{tmp_path / 'ops.db'}", None
    else:
        url, drop = services.fresh_database(services.postgres_url())
    harness = Harness(console_app.app, url=url)
    try:
        yield harness
    finally:
        harness.close()
        if drop is not None:
            drop()


def browser(env: Harness) -> TestClient:
    return TestClient(create_app(env.client, console_app.app), base_url=HERE)


def rows(html: str, kind: str) -> dict[str, str]:
    """``data-name``/``data-queue`` -> ``data-alive``/``data-depth`` of the Workers page."""
    key, value = ("name", "alive") if kind == "process" else ("queue", "depth")
    found = re.findall(rf'<tr class="{kind}" data-{key}="([^"]+)" data-{value}="([^"]+)"', html)
    return dict(found)


# --- workers and queues ---------------------------------------------------------------------------


def test_the_workers_page_judges_the_registry_and_counts_the_queue_table(env: Harness) -> None:
    store, now = env.store, env.clock.now()
    work = step_queue(APP, "work")
    engine = engine_queue(APP)
    declared = Identity(queues=[engine], app_queues=[work])
    store.process_started("engine@h:1", APP, "engine", now, declared)
    store.process_started("worker@h:2", APP, "worker", now, Identity(queues=[work]))
    store.process_started("worker@h:3", "another-app", "worker", now)  # not this console's
    env.clock.advance(timedelta(seconds=20))
    store.process_seen("engine@h:1", env.clock.now(), None)  # the worker is not seen since
    store.enqueue_raw([(work, b"{}"), (work, b"{}")], now)  # waiting since `now`

    client = browser(env)
    page = client.get("/workers")
    assert page.status_code == 200 and 'href="/workers" aria-current="page"' in page.text
    assert rows(page.text, "process") == {"engine@h:1": "yes", "worker@h:2": "no"}
    assert "not seen for 20 s" in page.text
    assert rows(page.text, "queue") == {engine: "0", work: "2"}
    assert "20.0 s" in page.text, "the age of the oldest message on the table"
    assert "no live process" in page.text  # work has no consumer
    assert "another-app" not in page.text

    stamp = re.search(r"/workers/live\?v=([0-9a-f]+)", page.text)
    assert stamp is not None
    assert client.get(f"/workers/live?v={stamp.group(1)}").status_code == 204
    store.process_seen("worker@h:2", env.clock.now(), None)  # it comes back
    moved = client.get(f"/workers/live?v={stamp.group(1)}")
    assert moved.status_code == 200 and rows(moved.text, "process")["worker@h:2"] == "yes"


def test_a_run_whose_step_waits_on_an_unconsumed_queue_is_listed(env: Harness) -> None:
    """Temporal's "no pollers": a live engine, no live consumer of the step's queue."""
    env.queues = [engine_queue(APP)]  # this harness is the engine only: no worker of `default`
    env.start("charge", 30, run_id="stuck-1")
    env.run_until_idle(skip_time=False)
    page = browser(env).get("/workers").text
    assert "stuck-1" not in page, "nothing registered: nothing can be told"

    default = step_queue(APP, "default")
    declared = Identity(queues=[engine_queue(APP)], app_queues=[default])
    env.store.process_started("engine@h:1", APP, "engine", env.clock.now(), declared)
    page = browser(env).get("/workers").text
    stranded = page[page.index("Steps waiting on a queue nobody consumes") :]
    assert '<a href="/run?id=stuck-1">' in stranded
    assert "no live process consumes queue &#39;default&#39;" in stranded, "as status says"
    assert f"no live process consumes queue(s) {default}" in page
    assert rows(page, "queue")[default] == "1"

    env.store.process_started("worker@h:2", APP, "worker", env.clock.now(), Identity([default]))
    page = browser(env).get("/workers").text
    assert "stuck-1" not in page, "served again"


# --- dead letters -----------------------------------------------------------------------------


def test_a_dead_letter_is_resent_after_confirmation(env: Harness) -> None:
    queue = engine_queue(APP)
    env.store.enqueue_raw([(queue, b'{"run_id": "r-9"}')], env.clock.now())
    env.run_until_idle()
    client = browser(env)
    page = client.get("/dead-letters").text
    (letter_id,) = re.findall(r'name="id" value="([^"]+)"', page)
    csrf = csrf_of(page)
    form = {"id": letter_id, "csrf": csrf}

    assert post(client, "/dead-letters/resend", {**form, "csrf": "forged"}).status_code == 403
    asked = post(client, "/dead-letters/resend", form)
    assert asked.status_code == 200 and f"Resend dead letter {letter_id}" in asked.text
    assert 'href="/dead-letters">No, back' in asked.text
    assert len(env.store.dead_letters()) == 1, "nothing done before the confirmation"

    done = post(client, "/dead-letters/resend", {**form, "confirmed": "1"})
    assert done.status_code == 303 and done.headers["location"] == "/dead-letters?done=resent"
    assert env.store.dead_letters() == []
    assert env.store.queue_depths() == {queue: 1}, "back on the queue it came from"
    assert "Resent: the message is back" in client.get(done.headers["location"]).text

    again = post(client, "/dead-letters/resend", {**form, "confirmed": "1"})
    assert again.status_code == 409 and f"no dead letter with id {letter_id!r}" in (
        again.text.replace("&#39;", "'")
    )
    env.run_until_idle()  # still not a run's message: dead-lettered again, with a new id
    assert len(env.store.dead_letters()) == 1


# --- approve with edited arguments ------------------------------------------------------------


def approve_form(client: TestClient, run_id: str) -> dict[str, str]:
    page = client.get(f"/run?id={run_id}").text
    assert 'class="edit-args"' in page and "Approve with these arguments" in page
    prefilled = re.search(r'<textarea name="args"[^>]*>([^<]*)<', page)
    assert prefilled and json.loads(html.unescape(prefilled.group(1))) == REFUND
    return {
        "run_id": run_id,
        "call_id": "refund",
        "args_hash": args_hash(REFUND),
        "csrf": csrf_of(page),
        "by": "ann",
    }


def test_approve_with_edited_arguments_runs_the_edit(env: Harness) -> None:
    run_id = waiting_refund(env)
    client = browser(env)
    form = approve_form(client, run_id)
    edited = {"order": "B-2", "amount": 500}

    not_json = post(client, "/approve", {**form, "args": "{'amount': 5"})
    assert not_json.status_code == 400 and "the edit of the arguments is not valid JSON" in (
        not_json.text
    )
    empty = post(client, "/approve", {**form, "args": "  "})
    assert empty.status_code == 400 and "the edit of the arguments is empty" in empty.text
    null = post(client, "/approve", {**form, "args": "null"})
    assert null.status_code == 400 and "null cannot replace the arguments" in null.text
    misfit = post(client, "/approve", {**form, "args": '{"order": "B-2", "amount": "lots"}'})
    assert misfit.status_code == 409 and "amount" in misfit.text, misfit.text
    stale = post(client, "/approve", {**form, "args_hash": "0" * 64, "args": json.dumps(edited)})
    assert stale.status_code == 409 and "not those the page showed" in stale.text
    assert env.approvals(run_id), "refused edits leave the approval waiting"

    done = post(client, "/approve", {**form, "args": json.dumps(edited)})
    assert done.status_code == 303, done.text
    env.run_until_idle(skip_time=False)  # on to the wait for the parcel
    env.send_event(run_id, "parcel_returned")
    env.run_until_idle()
    assert env.result(run_id) == {"refunded": True, "refund_id": "rf-B-2-500"}
    answer = env.get_published(run_id, "approval:refund")
    assert answer["edited"] is True and answer["edited_args"] == edited and answer["by"] == "ann"


def test_an_unchanged_edit_form_approves_the_arguments_asked_about(env: Harness) -> None:
    run_id = waiting_refund(env)
    client = browser(env)
    form = approve_form(client, run_id)
    done = post(client, "/approve", {**form, "args": json.dumps(REFUND, indent=2)})
    assert done.status_code == 303
    env.run_until_idle()
    answer = env.get_published(run_id, "approval:refund")
    assert answer["status"] == "approved" and not answer.get("edited"), answer


# --- cancel now -------------------------------------------------------------------------------


def test_cancel_now_is_offered_on_the_confirmation_and_skips_the_cleanup(env: Harness) -> None:
    polite, hasty = waiting_refund(env, "polite"), waiting_refund(env, "hasty")
    client = browser(env)
    page = client.get(f"/run?id={hasty}").text
    assert 'name="now" value="1"' in page
    csrf = csrf_of(page)

    asked = post(client, "/run/cancel", {"run_id": hasty, "csrf": csrf, "now": "1"})
    assert asked.status_code == 200 and 'id="confirm-now" checked' in asked.text
    assert asked.text.count('name="now"') == 1, "the choice, not a hidden copy of it"
    for run_id, now in ((polite, {}), (hasty, {"now": "1"})):
        form = {"run_id": run_id, "csrf": csrf, "confirmed": "1", **now}
        assert post(client, "/run/cancel", form).status_code == 303
    env.run_until_idle()
    assert env.get(polite).status == env.get(hasty).status == "cancelled"
    assert h.CANCEL_DELIVERED in [e.kind for e in env.history(polite)]
    assert h.CANCEL_DELIVERED not in [e.kind for e in env.history(hasty)]


def test_a_broker_that_cannot_be_reached_is_said_not_hidden(env: Harness) -> None:
    """RabbitMQ down (nothing listens on the port): the Workers page still shows the registry
    and says why it has no depths; Resend says it was not done."""
    from contextlib import contextmanager

    from sagaloop.brokers.rabbitmq import RabbitBroker

    @contextmanager
    def unreachable() -> Iterator[RabbitBroker]:
        broker = RabbitBroker(
            "amqp://guest:guest@127.0.0.1:1/", connect_timeout=timedelta(seconds=2)
        )
        try:
            yield broker
        finally:
            broker.close()

    now = env.clock.now()
    env.store.process_started("engine@h:1", APP, "engine", now, Identity([engine_queue(APP)]))
    client = TestClient(create_app(env.client, console_app.app, broker=unreachable), base_url=HERE)
    page = client.get("/workers").text
    assert rows(page, "process") == {"engine@h:1": "yes"}
    assert "the broker could not be asked" in page and rows(page, "queue") == {
        engine_queue(APP): "-"
    }
    listed = client.get("/dead-letters")
    assert listed.status_code == 409 and "127.0.0.1:1" in listed.text
    csrf = csrf_of(client.get(f"/run?id={waiting_refund(env)}").text)
    resend = post(client, "/dead-letters/resend", {"id": "abc", "csrf": csrf, "confirmed": "1"})
    assert resend.status_code == 409 and "127.0.0.1:1" in resend.text
