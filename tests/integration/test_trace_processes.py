"""One run is one trace across processes: a run started by a client (this process), activated
by an engine process, its step message published to RabbitMQ by the engine's outbox relay, and
run by a worker process; each process exports its spans with OpenTelemetry's SDK to a file of
its own (``traceapp.py``). The spans of the run form one trace whose parent links go client
start -> engine activation -> relay publish -> worker step -> the step code's own span: the
relay sets the AMQP ``traceparent`` header of what it publishes to its publish span, and the
worker continues it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from system import System

from sagaloop import tracing
from sagaloop.testing import eventually

pytestmark = pytest.mark.integration


def spans_in(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.open()]


def test_one_run_is_one_trace_across_client_engine_relay_and_worker(
    tmp_path: Path, rabbitmq_url: str
) -> None:
    folder = tmp_path / "spans"
    folder.mkdir()
    here = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(here))
    before = tracing.use_tracer_provider(provider)
    system = System(tmp_path, rabbitmq_url, app="traceapp")
    try:
        system.env["TRACE_DIR"] = str(folder)
        system.engine()
        system.worker(queues="work")
        system.wait_ready("engine")
        system.wait_ready("worker")
        run_id = system.client.start("pay", 1250)
        assert system.wait_final([run_id]) == {run_id: "completed"}, system.logs()

        def all_spans() -> list[dict[str, Any]] | None:
            found = spans_in(folder)
            names = [s["name"] for s in found if s["attributes"].get("sagaloop.run_id") == run_id]
            done = names.count(tracing.ACTIVATION) >= 2 and tracing.STEP in names
            return found if done and any(s["name"] == "charge card" for s in found) else None

        found = eventually(all_spans, 90, what="the processes' spans of the run")
    finally:
        tracing.use_tracer_provider(before)
        system.close()
    (start,) = [s for s in here.get_finished_spans() if s.name == tracing.START]
    assert start.context is not None
    trace_id = f"{start.context.trace_id:032x}"
    start_id = f"{start.context.span_id:016x}"
    of_run = [s for s in found if s["trace_id"] == trace_id]
    by_id = {s["span_id"]: s for s in of_run}

    def one(name: str, role: str, **attributes: Any) -> dict[str, Any]:
        matching = [
            s
            for s in of_run
            if s["name"] == name
            and s["role"] == role
            and all(s["attributes"].get(k) == v for k, v in attributes.items())
        ]
        assert len(matching) == 1, (name, role, attributes, found)
        return matching[0]

    # the engine's first activation (the start) and the one that took the step's result
    activations = [s for s in of_run if s["name"] == tracing.ACTIVATION]
    assert len(activations) >= 2 and {s["role"] for s in activations} == {"engine"}
    assert all(s["parent_id"] == start_id for s in activations), "children of the run's trace"
    step = one(tracing.STEP, "worker", **{"sagaloop.step": "charge"})
    publish = by_id[step["parent_id"]]
    assert (publish["name"], publish["role"], publish["kind"]) == (
        tracing.PUBLISH,
        "engine",
        "PRODUCER",
    ), "the step continues the relay's publish span (the AMQP traceparent header)"
    sender = by_id[publish["parent_id"]]
    assert (sender["name"], sender["role"]) == (tracing.ACTIVATION, "engine")
    code = one("charge card", "worker")
    assert code["parent_id"] == step["span_id"]
    # the activation that took the step's result links to the relay's span that published it,
    # whose parent is the publish of the step
    (took,) = [
        a for a in activations if a["attributes"].get("sagaloop.message_type") == "step_result"
    ]
    (linked,) = took["links"]
    assert (by_id[linked]["name"], by_id[linked]["role"]) == (tracing.PUBLISH, "worker")
    assert by_id[linked]["parent_id"] == publish["span_id"]
    # nothing of the run left its trace
    assert not [
        s for s in found if s["attributes"].get("sagaloop.run_id") == run_id and s not in of_run
    ]
