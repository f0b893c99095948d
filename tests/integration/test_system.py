"""The core scenarios on RabbitMQ + PostgreSQL with the engine and the workers as separate OS
processes, killed with SIGKILL at named crash points. Every outcome is checked from outside
the engine: the ledger of effects, the run statuses, the dead-letter queue."""

from __future__ import annotations

import json
from pathlib import Path

import pika
import pytest
from private_rabbit import PrivateRabbit, private_rabbit  # noqa: F401  (a fixture)
from system import System, eventually

pytestmark = pytest.mark.integration


def effects(system: System) -> dict[str, int]:
    rows = system.ledger("select step, count(*) from effects group by step")
    return {str(step): int(n) for step, n in rows}


def bodies(system: System, step: str) -> int:
    rows = system.ledger("select count(*) from bodies where step = ?", step)
    return int(rows[0][0]) if rows else 0


def test_sequence_fan_out_and_compensation(system: System) -> None:
    system.engine()
    system.worker()
    seq = system.client.start("sequence", ["a", "b", "c"])
    fan = system.client.start("fan-out", ["f1", "f2", "f3"])
    bad = system.client.start("then-fail", ["x", "y"])
    assert system.wait_final([seq, fan, bad]) == {
        seq: "completed",
        fan: "completed",
        bad: "compensated",
    }
    assert system.client.get(seq).output == ["a:done", "b:done", "c:done"]
    assert effects(system) == {k: 1 for k in ("a", "b", "c", "f1", "f2", "f3", "x", "y", "refuse")}
    undone = [s for (s,) in system.ledger("select step from undos order by seq")]
    assert undone == ["y", "x"], "compensations run once each, newest first"
    system.assert_histories_sound([seq, fan, bad])
    assert system.dead_letter_count() == 0


def test_worker_killed_after_commit_before_ack_does_not_rerun_the_step(system: System) -> None:
    system.engine()
    doomed = system.worker(SAGALOOP_CRASH_AT="worker.after_commit:2")
    run = system.client.start("sequence", ["a", "b", "c"])
    system.wait_killed_by_crash_point(doomed)
    system.worker()
    assert system.wait_final([run]) == {run: "completed"}
    assert bodies(system, "b") == 1, "the redelivered message must not run the step again"
    assert effects(system) == {"a": 1, "b": 1, "c": 1}
    assert system.dead_letter_count() == 0


def test_worker_killed_after_the_effect_before_commit_reconciles(system: System) -> None:
    system.engine()
    doomed = system.worker(SAGALOOP_CRASH_AT="worker.before_commit:2")
    run = system.client.start("sequence", ["a", "b", "c"])
    system.wait_killed_by_crash_point(doomed)
    system.worker()
    assert system.wait_final([run]) == {run: "completed"}
    assert effects(system) == {"a": 1, "b": 1, "c": 1}
    assert bodies(system, "b") == 1, "the in-doubt redelivery is reconciled, not re-run"
    states = [s["state"] for s in json.loads(system.sagaloop("status", run, "--json"))["steps"]]
    assert states == ["completed", "reconciled", "completed"]


@pytest.mark.parametrize(
    "point", ["engine.after_commit", "relay.before_publish", "relay.after_publish"]
)
def test_engine_killed_between_commit_and_publish(system: System, point: str) -> None:
    doomed = system.engine(SAGALOOP_CRASH_AT=f"{point}:2")
    system.worker()
    run = system.client.start("sequence", ["a", "b", "c"])
    system.wait_killed_by_crash_point(doomed)
    system.engine()
    assert system.wait_final([run]) == {run: "completed"}
    assert effects(system) == {"a": 1, "b": 1, "c": 1}
    for step in "abc":
        assert bodies(system, step) == 1, f"step {step} ran again"
    system.assert_histories_sound([run])


def test_event_arrives_while_the_engine_is_down(system: System) -> None:
    engine = system.engine()
    system.worker()
    run = system.client.start("waiter", "w")
    eventually(lambda: system.client.get(run).status == "waiting", what="the wait")
    system.kill(engine)
    system.client.send_event(run, "go", "green")
    system.engine()
    assert system.wait_final([run]) == {run: "completed"}
    assert system.client.get(run).output == "w:done|green|w-after:done"


def test_engine_restart_mid_loop_resumes(system: System) -> None:
    engine = system.engine()
    system.worker()
    run = system.client.start("loop", 40)
    eventually(lambda: bodies(system, "it10") == 1, what="ten iterations")
    system.kill(engine)
    system.engine()
    assert system.wait_final([run]) == {run: "completed"}
    assert system.client.get(run).output == 40
    assert all(n == 1 for n in effects(system).values()) and len(effects(system)) == 40
    system.assert_histories_sound([run])


def test_a_changed_saga_parks_the_in_flight_run(system: System) -> None:
    engine = system.engine()
    system.worker(STEP_DELAY="0.3")
    run = system.client.start("sequence", ["a", "b", "c"])
    eventually(lambda: bodies(system, "a") == 1, what="step a")
    system.kill(engine)
    system.engine(ITAPP_CHANGED="1")
    eventually(lambda: system.client.get(run).status == "needs_attention", what="the park")
    reason = system.client.get(run).reason or ""
    assert "call('effect') at position 0" in reason and "call('audit')" in reason, reason
    assert bodies(system, "b") == 0, "nothing runs past the divergence"


def test_two_engines_two_workers_many_runs(system: System) -> None:
    for _ in range(2):
        system.engine()
        system.worker()
    runs = [system.client.start("sequence", [f"r{i}-a", f"r{i}-b"]) for i in range(200)]
    statuses = system.wait_final(runs, timeout=180)
    assert set(statuses.values()) == {"completed"}
    assert len(effects(system)) == 400 and set(effects(system).values()) == {1}
    system.assert_histories_sound(runs)
    assert system.dead_letter_count() == 0


POISON = [
    (b"not json at all", "application/json", "not JSON"),
    (b"\x80\x04K\x01.", "application/x-python-pickle", "content type"),
    (json.dumps({"type": "start", "run_id": "p1", "saga": "nope"}).encode(), None, "unknown saga"),
    (
        json.dumps(
            {"type": "start", "run_id": "p2", "saga": "loop", "payload": {"input": "x"}}
        ).encode(),
        None,
        "not a valid",
    ),
    (
        b'{"type": "start", "run_id": "p3", "saga": "loop", "payload": {"input": "'
        + b"x" * 2_000_000
        + b'"}}',
        None,
        "exceeds",
    ),
]


def test_poison_messages_are_dead_lettered_and_the_engine_keeps_going(system: System) -> None:
    system.engine()
    system.worker()
    conn = pika.BlockingConnection(pika.URLParameters(system.broker_url))
    ch = conn.channel()
    system.wait_ready()
    for body, content_type, _ in POISON:
        props = pika.BasicProperties(content_type=content_type or "application/json")
        ch.basic_publish(system.namespace, "itapp.engine", body, props)
    valid = {"type": "start", "run_id": "valid-1", "saga": "loop", "payload": {"input": 2}}
    ch.basic_publish(
        system.namespace,
        "itapp.engine",
        json.dumps(valid).encode(),
        pika.BasicProperties(content_type="application/json", delivery_mode=2),
    )
    assert system.wait_final(["valid-1"]) == {"valid-1": "completed"}
    eventually(lambda: system.dead_letter_count() == len(POISON), what="the dead letters")
    reasons = []
    for _ in POISON:
        method, props, _body = ch.basic_get(f"{system.namespace}.dead", auto_ack=True)
        assert method is not None
        reasons.append(str((props.headers or {}).get("x-sagaloop-reason")))
    conn.close()
    for _, _, expected in POISON:
        assert any(expected in r for r in reasons), (expected, reasons)


@pytest.mark.long  # make chaos: the suite's time budget
def test_private_broker_restart_with_50_runs_in_flight(
    tmp_path: Path,
    private_rabbit: PrivateRabbit,  # noqa: F811
) -> None:
    system = System(tmp_path, private_rabbit.url)
    try:
        system.engine()
        system.worker(STEP_DELAY="0.02")
        runs = [
            system.client.start("sequence", [f"r{i}-a", f"r{i}-b", f"r{i}-c"]) for i in range(50)
        ]
        eventually(lambda: len(effects(system)) >= 20, what="work in flight")
        private_rabbit.restart()
        statuses = system.wait_final(runs, timeout=180)
        assert set(statuses.values()) == {"completed"}
        assert len(effects(system)) == 150 and set(effects(system).values()) == {1}
        system.assert_histories_sound(runs)
        assert system.dead_letter_count() == 0
    finally:
        system.close()
