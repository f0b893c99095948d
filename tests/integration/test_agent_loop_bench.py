"""``benchmarks.agent_loop`` (issue 27) measures what it says: on the embedded setup (in this
process) and on broker steps (``sagaloop engine`` and ``sagaloop worker`` processes), a few runs
of each case give figures whose relations must hold whatever the machine's load: every gap
between step bodies is positive (the bodies of one run ran one after the other), the time
outside steps covers the time to the first step, no streamed chunk is lost, the agent loop's
wall time covers its model's and tools' own, and the rows carry a verdict for each target."""

from __future__ import annotations

import pytest

from benchmarks import agent_loop, loopapp


def _check(kind: str) -> None:
    with agent_loop.setup(kind) as s:
        seq = agent_loop.sequential(s, 2)
        stream = agent_loop.streamed(s, 1)
        fan = agent_loop.fanned(s, 1, 16)
        agent = agent_loop.agent(s, 1)
    gaps = seq["gaps"]
    assert gaps["n"] == 18  # 9 gaps in each of 2 runs of 10 steps
    assert 0 < gaps["p50_ms"] <= gaps["p75_ms"] <= gaps["p99_ms"] < 5_000
    first, outside = seq["first_step"], seq["outside"]
    assert 0 < first["p50_ms"] < outside["p99_ms"]
    assert stream["lost"] == 0 and stream["chunks"] == loopapp.CHUNKS
    assert 0 < stream["first_chunk"]["p50_ms"] < 1_000
    assert -loopapp.CHUNK_EVERY * 1000 < stream["overhead"]["p50_ms"] < 1_000
    assert fan["overhead"]["n"] == 1 and fan["overhead"]["p50_ms"] > 0
    # the scripted model and tools sleep 0.4 s in all: a wall time below it did not run them
    assert agent["wall"]["p50_ms"] > loopapp.MODEL_S * 1000 + loopapp.TOOLS_S * 1000
    results = {"plan": {"fanout": 16}, kind: {"load": [1.0, 1.0], "sequential": seq}}
    results[kind] |= {"stream": stream, "fanout": fan, "agent": agent}
    rows = agent_loop.figures(results)
    assert len(rows) == 6
    with_target = [r for r in rows if r.target]
    assert len(with_target) == 4 and all(r.verdict in ("met", "MISSED") for r in with_target)


def test_embedded_figures_hold_together() -> None:
    _check("embedded")


@pytest.mark.integration
def test_broker_figures_hold_together() -> None:
    _check("broker")
