"""What an agent turn stores (issue 27): a model's response once (the model step's result; the
next request refers to it), the tool definitions once per change (``"same"``), a tool call's
run context without its defaults; and runs recorded before that (the old shape, captured in
``data/pydantic_ai_history_v1.json``) still replay, resume on new workers and read in the
console."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from sagaloop.agents import transcript
from sagaloop.client.fork import fork_history
from sagaloop.engine import history as h
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.messages import Envelope, derived_id, start_queue
from sagaloop.engine.ports import Outgoing
from sagaloop.engine.records import RunRecord
from sagaloop.testing import Harness
from sagaloop.testing.histories import history_from_json, replay
from sagaloop.ui.transcript import requests_of
from tests.unit import test_agents_openai as oa
from tests.unit import test_agents_pydantic_ai as pa

OLD = Path(__file__).parent / "data" / "pydantic_ai_history_v1.json"
"""A completed run of :func:`old_script` recorded by sagaloop before this change: every
request with its tool definitions, each response again in the next request, whole contexts."""
MODEL = "agent__refunds__model_request"


def old_script() -> pa.Script:
    return pa.Script(
        [("add", {"a": 1, "b": 2}), ("greet", {"who": "ann"})], [("greet", {"who": "bob"})]
    )


def requests(events: list[Event]) -> list[dict[str, Any]]:
    return [
        e.data["args"]["request"] for e in events if e.kind == h.STEP_SCHEDULED and e.name == MODEL
    ]


def shown(events: list[Event]) -> list[tuple[str, str, str]]:
    """What the console shows of each request, without the ids the model makes up."""
    return [
        (p.kind, p.label if p.kind != "tool call" else "", p.text)
        for r in requests_of(events)
        for p in (*r.new, *r.response)
    ]


def test_a_response_is_stored_once_and_tool_definitions_once() -> None:
    app, _, _ = pa.refund_app(old_script())
    env = Harness(app)
    run_id = env.start("ask", "refund please")
    env.run_until_idle()
    assert env.result(run_id) == json.dumps(["hi bob"])
    made = requests(env.history(run_id))
    # settings None: not recorded; the tool definitions once
    assert [sorted(r) for r in made] == [["params", "transcript"]] + 2 * [["transcript"]]
    for n, request in enumerate(made[1:], start=1):
        delta = request["transcript"]
        assert delta["same"] == {"params": 0}
        assert delta["append"][0] is None  # the response to request n - 1, by reference
        assert delta["refs"]["0"]["n"] == n - 1 and delta["refs"]["0"]["path"] == ["response"]
    # the console shows what a run of the old shape showed
    assert shown(env.history(run_id)) == shown(history_from_json(json.loads(OLD.read_text())))


def test_a_worker_without_its_cache_rebuilds_references_from_the_history() -> None:
    from sagaloop.agents.pydantic_ai import agent as adapter

    script = old_script()
    app, _, _ = pa.refund_app(script)
    env = Harness(app)
    run_id = env.start("ask", "refund please")
    while not any(r["transcript"]["n"] == 1 for r in requests(env.history(run_id))):
        env.step_once()
    adapter._decoder._last.clear()  # another worker, or this one restarted
    adapter._decoder._responses.clear()
    adapter._decoder._extras.clear()
    adapter._decoder._strings.clear()
    env.run_until_idle()
    assert env.result(run_id) == json.dumps(["hi bob"])
    assert script.requests == 3


def test_a_cached_response_that_is_not_the_recorded_one_is_not_used() -> None:
    """An attempt whose result was not the one recorded (another attempt's was) leaves its
    result in the cache: the reference's digest sends the worker to the history."""
    decoder = transcript.Decoder()
    encoder = transcript.Encoder(lambda ms: [dict(m) for m in ms], same=lambda a, b: a == b)
    first = [{"role": "user", "content": "hi"}]
    d0 = encoder.delta(first)
    d0.update(conversation="c", n=0)
    recorded = {"response": {"role": "assistant", "content": "recorded answer " * 8}}
    encoder.sent(0, first)
    encoder.answered(0, [(["response"], recorded["response"])])
    second = [*first, dict(recorded["response"]), {"role": "user", "content": "more"}]
    d1 = encoder.delta(second)
    d1.update(conversation="c", n=1)
    assert d1["append"][0] is None
    events = [
        Event(
            1, h.STEP_SCHEDULED, at=None, pos=0, name="m", data={"args": {"r": {"transcript": d0}}}
        ),  # type: ignore[arg-type]
        Event(2, h.STEP_COMPLETED, at=None, pos=0, name="m", data={"result": recorded}),  # type: ignore[arg-type]
    ]
    decoder.messages("run", d0, step="m", history=lambda _: events)
    decoder.responded("run", d0, {"response": {"role": "assistant", "content": "lost attempt"}})
    assert decoder.messages("run", d1, step="m", history=lambda _: events) == second


def test_a_tool_call_stores_its_context_without_defaults() -> None:
    app, _, effects = pa.refund_app(old_script())
    env = Harness(app)
    run_id = env.start("ask", "refund please")
    env.run_until_idle()
    assert effects["add 1 2"] == 1  # the tool read ctx.deps through the rebuilt context
    calls = [
        e.data["args"]["call"]
        for e in env.history(run_id)
        if e.kind == h.STEP_SCHEDULED and "__tool__" in (e.name or "")
    ]
    for call in calls:
        assert len(json.dumps(call["context"])) < 500, call["context"]
        assert {"tool_call_id", "tool_name", "run_step"} <= set(call["context"])


def test_an_old_format_history_replays() -> None:
    app, _, _ = pa.refund_app(old_script())
    replay(app, OLD.read_text())


def _in_flight(env: Harness, at: int) -> str:
    """The old run as an upgrade finds it in flight: its history up to command position ``at``
    (what :func:`fork_history` keeps), under its own id, its engine about to activate it."""
    doc = json.loads(OLD.read_text())
    run_id = doc["run_id"]
    events = fork_history(history_from_json(doc), at, run_id=run_id)
    now = env.clock.now()
    input_json = events[0].data.get("input")
    record = RunRecord(run_id, doc["app"], doc["saga"], "running", input_json, now, now)
    record.last_seq = len(events)
    record.processed_seq = len(events) - 1  # as a fork leaves it: the last event to process
    start = Envelope(
        type="start",
        message_id=derived_id("start", run_id),
        run_id=run_id,
        saga=doc["saga"],
        payload={"input": input_json},
        created_at=now,
    )
    with env.store.transaction() as tx:
        assert env.store.create_run(tx, record)
        after = 0
        for when, group in itertools.groupby(events, key=lambda e: e.at):
            batch = [NewEvent(e.kind, e.pos, e.name, e.data) for e in group]
            after = env.store.append_events(tx, run_id, after, batch, when)[-1].seq
        env.store.enqueue(tx, [Outgoing(start_queue(doc["app"]), start)], now)
    return run_id


def test_a_run_in_flight_in_the_old_format_resumes_on_new_code() -> None:
    """The old run cut before its second, then its third request: the code as it is now
    records those requests referring to requests of the old shape (their tool definitions,
    their responses), and a worker without a cache reads them from that history."""
    from sagaloop.agents.pydantic_ai import agent as adapter

    for at, asked in ((4, 2), (7, 1)):
        script = old_script()
        script.requests = 3 - asked
        app, _, effects = pa.refund_app(script)
        env = Harness(app)
        run_id = _in_flight(env, at)
        adapter._decoder._last.clear()
        adapter._decoder._responses.clear()
        adapter._decoder._extras.clear()
        adapter._decoder._strings.clear()
        env.run_until_idle()
        assert env.get(run_id).status == "completed", env.get(run_id)
        assert env.result(run_id) == json.dumps(["hi bob"])
        assert script.requests == 3, "only the requests after the cut were made"
        made = requests(env.history(run_id))
        assert "params" in made[0] and "params" not in made[-1]
        assert made[-1]["transcript"]["same"]["params"] < made[-1]["transcript"]["n"]
        assert sum(effects.values()) == (1 if at == 4 else 0)


def test_openai_agents_output_items_are_stored_once_and_tools_once() -> None:
    model = oa.two_tools_then_answer()
    app, _, _, _ = oa.refund_app(model)
    env = Harness(app)
    run_id = env.start("ask", "refund please")
    env.run_until_idle()
    assert json.loads(env.result(run_id)) == ["13", "hi ann"]
    second = [
        e.data["args"]["request"]
        for e in env.history(run_id)
        if e.kind == h.STEP_SCHEDULED and e.name == "agent__refunds__model_request"
    ][1]
    assert "tools" not in second and second["transcript"]["same"]["tools"] == 0
    assert second["transcript"]["refs"]["0"]["path"] == ["response", "output", 0]


def test_a_long_tool_result_is_stored_once_and_shown_whole() -> None:
    """The tool's result is its step's result; the next request names it by digest, the model
    step gets it whole (the model sees it), and so does the console."""
    app, saga, script = pa.loop_app(3, result_bytes=600)
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert script.requests == 4
    events = env.history(run_id)
    results = [
        e.data["result"]["value"]
        for e in events
        if e.kind == h.STEP_COMPLETED and "__tool__" in (e.name or "")
    ]
    assert len(results) == 3 and all(len(r) > 600 for r in results)
    for request in requests(events)[1:]:
        assert "values" in request["transcript"]
    asked = json.dumps(requests(events))
    assert not any(r in asked for r in results), "no result stored again with a request"
    assert [p.text for r in requests_of(events) for p in r.new if p.kind == "tool result"] == (
        results
    )


def test_openai_agents_a_long_tool_output_is_stored_once() -> None:
    from benchmarks.agent_transcript import _openai_agents_storage_app

    app, saga = _openai_agents_storage_app(3)
    env = Harness(app)
    run_id = env.start(saga)
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    events = env.history(run_id)
    text = json.dumps([e.data for e in events])
    outputs = [
        e.data["result"]["value"]
        for e in events
        if e.kind == h.STEP_COMPLETED and "__tool__" in (e.name or "")
    ]
    assert len(outputs) == 3 and all(text.count(o) == 1 for o in outputs)
    shown_results = [p.text for r in requests_of(events) for p in r.new if p.kind == "tool result"]
    assert shown_results == outputs


def test_a_turn_stores_at_most_one_and_a_half_times_what_it_adds() -> None:
    """The target of issue 27, as ``make bench`` measures it (from the store's tables), on a
    short loop of each adapter."""
    from benchmarks.agent_transcript import STORAGE_TARGET, measure_storage, storage_figures

    results = measure_storage(turns=20)
    for adapter in ("Pydantic AI", "OpenAI Agents"):
        assert results[adapter]["ratio"] <= STORAGE_TARGET, results[adapter]
    assert [f.met for f in storage_figures(results)] == [True, True]


def test_a_history_that_started_again_is_read_whole() -> None:
    """A run that continued as new starts its history again from seq 1: a worker that read
    up to a later seq before reads the whole history when what it needs is not after it."""
    long_a, long_b = "a" * 300, "b" * 300
    current: list[Event] = []

    def history(run_id: str, *, after: int = 0) -> list[Event]:
        return [e for e in current if e.seq > after]

    def completed(seq: int, text: str) -> Event:
        return Event(
            seq, h.STEP_COMPLETED, at=None, pos=seq, name="t", data={"result": {"value": text}}
        )  # type: ignore[arg-type]

    decoder = transcript.Decoder()
    for generation, text in enumerate((long_a, long_b)):
        encoder = transcript.Encoder(lambda ms: [dict(m) for m in ms])
        encoder.received({"value": text})
        messages = [{"role": "tool", "content": text}]
        delta = encoder.delta(messages)
        delta.update(conversation=f"c{generation}", n=0)
        assert delta["append"] == [{"role": "tool", "content": None}]
        current = [completed(seq, "x") for seq in range(1, 5)] if generation == 0 else []
        current.append(completed(len(current) + 1, text))
        assert decoder.messages("run", delta, step=None, history=history) == messages


def test_a_compacted_run_context_is_rebuilt_as_it_was() -> None:
    """Each tool call's context of the old run (stored whole) compacts and comes back on the
    worker as the same context."""
    import pydantic_core
    from pydantic_ai.durable_exec import DurableRunContext

    from sagaloop.agents.pydantic_ai.run import compact_context, run_context

    contexts = [
        e.data["args"]["call"]["context"]
        for e in history_from_json(json.loads(OLD.read_text()))
        if e.kind == h.STEP_SCHEDULED and "__tool__" in (e.name or "")
    ]
    assert len(contexts) == 3
    for whole in [*contexts, {**contexts[0], "tool_call_approved": True, "retry": 2}]:
        small = compact_context(whole)
        assert len(json.dumps(small)) < len(json.dumps(whole)) / 2
        rebuilt = run_context(pa.Deps, {"deps": {"base": 10}, "context": small})
        again = DurableRunContext.serialize_run_context(rebuilt)
        assert unordered(pydantic_core.to_jsonable_python(again, fallback=str)) == unordered(whole)


def unordered(context: dict[str, Any]) -> dict[str, Any]:
    """A context with its sets (lists of names, in no order once rebuilt) sorted."""
    return {k: sorted(v) if isinstance(v, list) else v for k, v in context.items()}
