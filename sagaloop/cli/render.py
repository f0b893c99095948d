"""Plain-text rendering of timelines and run lists for terminals."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sagaloop.engine.ports import RunRecord
from sagaloop.engine.timeline import Timeline, short_json


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*headers), line.format(*("-" * w for w in widths))]
    out += [line.format(*row) for row in rows]
    return "\n".join(x.rstrip() for x in out)


def _t(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def timeline_text(tl: Timeline) -> str:
    head = [
        f"run       {tl.run_id}",
        f"saga      {tl.saga}",
        f"status    {tl.status}",
        f"started   {_t(tl.created_at)} UTC    updated {_t(tl.updated_at)} UTC",
    ]
    if tl.reason:
        head.append(f"reason    {tl.reason}")
    rows = [
        [
            str(s.position),
            s.step,
            s.state,
            str(s.attempts),
            f"{s.duration_s:.3f} s" if s.duration_s is not None else "-",
            s.worker or "-",
            s.compensation or "-",
            s.idempotency_key,
        ]
        for s in tl.steps
    ]
    parts = ["\n".join(head)]
    if rows:
        headers = ["#", "step", "state", "tries", "took", "worker", "undo", "idempotency key"]
        parts.append(_table(headers, rows))
    errors = [
        f"  #{s.position} {s.step}: {s.error}"
        + (f"\n{_indent(s.traceback)}" if s.traceback else "")
        for s in tl.steps
        if s.error
    ]
    if errors:
        parts.append("last errors:\n" + "\n".join(errors))
    if tl.waiting_for:
        parts.append("why it waits:\n" + "\n".join(f"  - {w}" for w in tl.waiting_for))
    if tl.published:
        values = [
            f"  {key} = {short_json(value, 120)}" for key, value in sorted(tl.published.items())
        ]
        parts.append("published:\n" + "\n".join(values))
    if tl.status == "completed":
        parts.append("output: " + json.dumps(tl.output))
    elif tl.error:
        error = f"error: {tl.error.get('type')}: {tl.error.get('message')}"
        trace = tl.error.get("traceback")
        parts.append(error + (f"\n{_indent(str(trace))}" if trace else ""))
    return "\n\n".join(parts)


def _indent(text: str, by: str = "      ") -> str:
    """A stored traceback, indented under the error it belongs to."""
    return "\n".join(by + line for line in text.splitlines())


def runs_text(runs: Sequence[RunRecord], counts: dict[str, int]) -> str:
    rows = [[r.run_id, r.saga, r.status, _t(r.created_at), _t(r.updated_at)] for r in runs]
    table = _table(["run", "saga", "status", "started (UTC)", "updated (UTC)"], rows)
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "no runs"
    return f"{table}\n\n{summary} (total {sum(counts.values())})"


def stream_line(item: dict[str, Any]) -> str:
    """One line of ``sagaloop tail``: a history event, or an item a step streamed live."""
    if item.get("source") == "history":
        name = f" {item['name']}" if item.get("name") else ""
        return f"#{item.get('seq')} {item.get('kind')}{name} {short_json(item.get('data'))}"
    data = item.get("data")
    text = data.get("text") if isinstance(data, dict) else None
    shown = text if isinstance(text, str) else short_json(data)
    return f"~ {item.get('step')}: {shown}"
