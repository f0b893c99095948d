"""Large payloads on RabbitMQ + PostgreSQL with the engine and the worker as separate OS
processes: a 3 MiB step result and a 2 MiB step argument (over RabbitMQ's 1 MiB message limit:
the relay used to dead-letter them and the run waited for ever) complete, across an engine
killed while the run waits; rows stay small; a value over the hard limit fails its step."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from payloadapp import MiB, text_of
from system import System, eventually

from sagaloop.sagas.convert import MAX_VALUE_BYTES
from sagaloop.store.payloads import OFFLOAD_BYTES

pytestmark = pytest.mark.integration


def largest(system: System, table: str, column: str) -> int:
    with system.store.engine.connect() as conn:
        sql = f"select coalesce(max(length({column})), 0) from sagaloop_{table}"
        return int(conn.execute(sa.text(sql)).scalar_one())


def test_large_payloads_on_rabbitmq_and_postgresql(tmp_path: Path, rabbitmq_url: str) -> None:
    system = System(tmp_path, rabbitmq_url, app="payloadapp")
    try:
        engine = system.engine()
        system.worker("work")
        run = system.client.start("agent", 3 * MiB)
        eventually(lambda: system.client.get(run).status == "waiting", 90, "the transcript")
        system.kill(engine)  # the next engine replays the run from the database
        system.engine()
        system.client.send_event(run, "go")
        over = system.client.start("overflow", MAX_VALUE_BYTES + 1)
        statuses = system.wait_final([run, over], timeout=120)
        assert statuses[run] == "completed", system.logs()
        assert system.client.get(run).output == [3 * MiB, 2 * MiB]
        history = system.client.history(run)
        results = {e.name: e.data["result"] for e in history if e.kind == "step_completed"}
        assert results == {"transcript": text_of(3 * MiB), "measure": 2 * MiB}

        assert statuses[over] in ("failed", "compensated")
        failed = [e for e in system.client.history(over) if e.kind == "step_failed"]
        assert failed and str(MAX_VALUE_BYTES) in str(failed[-1].data)

        assert system.dead_letter_count() == 0
        assert largest(system, "dead_letters", "body") == 0
        for table, column in [("history", "data"), ("runs", "input"), ("runs", "output")]:
            assert largest(system, table, column) < OFFLOAD_BYTES, f"{table}.{column}"
        assert largest(system, "inbox", "result") < OFFLOAD_BYTES
        assert largest(system, "outbox", "body") < OFFLOAD_BYTES + 2048
        with system.store.engine.connect() as conn:
            sizes = "select max(size), max(length(data)) from sagaloop_payloads"
            size, stored = conn.execute(sa.text(sizes)).one()
        assert size >= 3 * MiB and stored < size / 10, "payloads are stored compressed"
    finally:
        system.close()
