"""The app of the cross-process trace test (``test_trace_processes.py``): a saga that calls one
step on the queue ``work``, a step whose code opens a span of its own. Every process that
imports it with ``TRACE_DIR`` set traces with OpenTelemetry's SDK and writes each finished
span, as one JSON line, to ``TRACE_DIR/<role>-<pid>.jsonl`` (a real exporter of the SDK's
interface, the file as its collector)."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from sagaloop import App, SagaContext, StepContext

app = App("traceapp")


@app.step(queue="work")
def charge(ctx: StepContext, cents: int) -> str:
    with trace.get_tracer("traceapp").start_as_current_span("charge card"):
        return f"charged {cents}"


@app.saga(name="pay")
async def pay(ctx: SagaContext, cents: int) -> str:
    return await ctx.call(charge, cents)


class JsonLinesExporter(SpanExporter):
    """Each finished span as a JSON line: name, kind, ids (hex), parent, links, attributes."""

    def __init__(self, path: Path, role: str) -> None:
        self._path = path
        self._role = role
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            context = span.get_span_context()
            assert context is not None
            lines.append(
                json.dumps(
                    {
                        "role": self._role,
                        "pid": os.getpid(),
                        "name": span.name,
                        "kind": span.kind.name,
                        "trace_id": f"{context.trace_id:032x}",
                        "span_id": f"{context.span_id:016x}",
                        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
                        "links": [f"{link.context.span_id:016x}" for link in span.links],
                        "attributes": dict(span.attributes or {}),
                    }
                )
            )
        with self._lock, self._path.open("a") as out:
            out.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS


if os.environ.get("TRACE_DIR"):
    role = sys.argv[1] if len(sys.argv) > 1 else "python"
    provider = TracerProvider(resource=Resource.create({"service.name": f"traceapp-{role}"}))
    path = Path(os.environ["TRACE_DIR"]) / f"{role}-{os.getpid()}.jsonl"
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path, role)))
    trace.set_tracer_provider(provider)
