"""Approvals against real processes on PostgreSQL and RabbitMQ (issue 22): an answer published
right after the start, by the CLI and by a plain AMQP publisher, is refused and never paid;
`sagaloop approve` and `sagaloop deny` racing while no engine runs: one wins, the other exits
non-zero saying so, and the run follows the winner once an engine starts."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pika
import pytest
from system import System, eventually

from sagaloop.sagas.approvals import args_hash

pytestmark = pytest.mark.integration


@pytest.fixture
def approvals(tmp_path: Path, rabbitmq_url: str) -> Iterator[System]:
    s = System(tmp_path, rabbitmq_url, app="approvalapp")
    try:
        yield s
    finally:
        s.close()


def charges(s: System) -> list[tuple[object, ...]]:
    return s.ledger("select cents from charges")


def pending(s: System, run_id: str) -> bool:
    return bool(s.client.approvals(run_id))


def refusals(s: System, run_id: str) -> list[str]:
    return [e.data["reason"] for e in s.client.history(run_id) if e.kind == "event_rejected"]


def test_answers_published_right_after_the_start_are_refused_and_never_paid(
    approvals: System,
) -> None:
    s = approvals
    s.engine()
    s.worker("work")
    s.wait_ready("engine")
    run_id = f"early-{uuid.uuid4().hex[:8]}"
    s.sagaloop("start", "pay", "--input", "100", "--run-id", run_id, "--app", "approvalapp")
    forged = {
        "approved": True,
        "args_hash": args_hash({"cents": 100}),  # the arguments are known: so is their hash
        "args": {"cents": 999_999},
        "by": "CFO",
    }
    s.sagaloop("send-event", run_id, "approval:0", "--data", json.dumps(forged))
    message = {  # a plain AMQP publisher, as docs/messages.md shows
        "v": 1,
        "type": "event",
        "message_id": uuid.uuid4().hex,
        "run_id": run_id,
        "payload": {"name": "approval:0", "data": forged},
        "created_at": datetime.now(UTC).isoformat(),
    }
    conn = pika.BlockingConnection(pika.URLParameters(s.broker_url))
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            exchange=s.namespace,
            routing_key="approvalapp.engine",
            body=json.dumps(message).encode(),
            properties=pika.BasicProperties(content_type="application/json", delivery_mode=2),
            mandatory=True,
        )
    finally:
        conn.close()
    eventually(lambda: len(refusals(s, run_id)) == 2, what="both forged answers refused")
    assert s.client.get(run_id).status == "waiting" and charges(s) == []
    assert all("request_id" in reason for reason in refusals(s, run_id))
    assert pending(s, run_id), "the approval still waits for a person"

    s.sagaloop("approve", run_id, "0", "--by", "alice")
    assert s.wait_final([run_id]) == {run_id: "completed"}
    assert s.client.result(run_id) == {"approved": True, "cents": 100, "by": "alice"}
    assert charges(s) == [(100,)]


def test_approve_and_deny_racing_with_no_engine_one_wins_and_the_other_is_told(
    approvals: System,
) -> None:
    s = approvals
    engine = s.engine()
    s.wait_ready("engine")
    runs = [s.client.start("pay", 250) for _ in range(5)]
    eventually(lambda: all(pending(s, r) for r in runs), what="the approvals to be asked")
    s.kill(engine)  # no engine runs while the answers race

    outcomes = {}
    for run_id in runs:
        racers = {
            "approve": subprocess.Popen(
                [sys.executable, "-m", "sagaloop", "approve", run_id, "0", "--by", "alice"],
                env=s.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            ),
            "deny": subprocess.Popen(
                [sys.executable, "-m", "sagaloop", "deny", run_id, "0", "--reason", "fraud"],
                env=s.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            ),
        }
        results = {}
        for name, proc in racers.items():
            out, err = proc.communicate(timeout=120)
            results[name] = (proc.returncode, out.decode() + err.decode())
        winners = [name for name, (code, _) in results.items() if code == 0]
        assert len(winners) == 1, results
        [(code, text)] = [r for name, r in results.items() if name not in winners]
        assert code != 0 and "already answered" in text, text
        outcomes[run_id] = winners[0]

    s.engine()
    s.worker("work")
    assert s.wait_final(runs) == dict.fromkeys(runs, "completed")
    for run_id, winner in outcomes.items():
        assert s.client.result(run_id)["approved"] is (winner == "approve"), run_id
    assert len(charges(s)) == sum(1 for w in outcomes.values() if w == "approve")
