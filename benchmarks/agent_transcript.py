"""Issue 12, "transcripts stored once, payloads bounded": a Pydantic AI agent under
``SagaAgent`` whose model (a ``FunctionModel``) calls one tool per turn, the tool answering
2 KB, then finishes; 20, 200 and 1,000 turns.

    python -m benchmarks.agent_transcript [--quick] [--profile TURNS] [--json PATH]

Driven offline by ``sagaloop.testing.Harness`` with ``cache=True`` (a production engine keeps
suspended runs in memory), on in-memory SQLite, no network. Per turn (a model request and a
tool call, each a step):

- **history bytes**: the JSON size of every event's data of the run, as the store holds it
  (read back through the harness once the run finished), divided by the number of turns;
- **engine CPU**: thread CPU time (``time.thread_time``) spent in the engine consumer's
  ``process``: the activations, not the steps nor the harness's polling (the harness runs
  everything on one thread and hands each message to the engine's or the worker's consumer).
  Split into the saga code (``DeterministicLoop.run_until_blocked``: Pydantic AI's agent loop,
  the adapter's hooks, the replayer answering their calls) and the rest (reading the run,
  recording the decisions, the transaction); and put next to the same agent run plainly, in
  process, without a saga: what Pydantic AI itself costs per turn;
- **steps' CPU**, for context: the worker consumer's (the model request, which rebuilds the
  transcript and runs the model, and the tool).

Each figure is put next to the 20-turn run's, measured in the same run; the target is that the
1,000-turn run's history bytes and engine CPU per turn are within 1.25x of it.

**Storage per agent turn** (issue 27), for the Pydantic AI and the OpenAI Agents adapter: a
loop of :data:`STORAGE_TURNS` turns (one tool call of a 2 KB result per turn, then an answer),
its bytes in the store's own tables (``sagaloop_history``'s ``data`` of the run, plus its rows
of ``sagaloop_payloads``, where large values go) per turn, next to the **new content** per
turn: the JSON of the conversation's messages, each counted once, as the framework serializes
them at the end of the run (Pydantic AI's ``all_messages()``, the Agents SDK's
``to_input_list()``), divided by the turns. That is what the turns bring: each model response,
and each new message of a request (the tool's result in its message; the prompt once). The
target: at most :data:`STORAGE_TARGET` times the new content. For contrast, the
history the run would have had if each model request stored its full transcript: the recorded
deltas replaced by the full message lists they stand for. ``--profile TURNS`` prints cProfile's
view of the engine side of one loop.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import math
import pstats
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import Figure, fmt_ratio
from sagaloop import App, SagaContext  # module level: the saga's annotations resolve here
from sagaloop.engine.loop import DeterministicLoop

TURNS = [20, 200, 1000]
QUICK_TURNS = [20, 200]
RESULT_BYTES = 2048
FLAT = 1.25
TOOL_RESULT_PREFIX = "result {i}: "
MODEL_STEP = "agent__loop__model_request"  # SagaAgent's step for the agent named "loop"
STORAGE_TURNS = 50
STORAGE_TARGET = 1.5


def _agent(turns: int, result_bytes: int, requests: list[int]) -> Any:
    """The plain agent: its model calls ``lookup`` once per turn for ``turns`` turns, then
    answers. Model and tool are ``async``: Pydantic AI runs a sync one on a thread, where this
    thread's CPU clock would not see it. The response carries its usage, as a provider's does
    (``FunctionModel`` would otherwise estimate it by scanning the whole transcript: a cost of
    the test model, not of an agent)."""
    from pydantic_ai import Agent, models
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel
    from pydantic_ai.usage import RequestUsage

    models.ALLOW_MODEL_REQUESTS = False

    async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        requests[0] += 1
        turn = len(messages) // 2  # request, response, request, ...: O(1), not a scan
        usage = RequestUsage(input_tokens=60 + 520 * turn, output_tokens=20)
        if turn < turns:
            call = ToolCallPart("lookup", {"i": turn})
            return ModelResponse(parts=[TextPart(f"turn {turn}"), call], usage=usage)
        return ModelResponse(parts=[TextPart("done")], usage=usage)

    agent = Agent(FunctionModel(model), name="loop")

    @agent.tool_plain
    async def lookup(i: int) -> str:
        """Look the record up."""
        return TOOL_RESULT_PREFIX.format(i=i).ljust(result_bytes, "x")

    return agent


def loop_app(turns: int, result_bytes: int = RESULT_BYTES) -> tuple[App, Any, list[int]]:
    """An app whose saga runs the agent under ``SagaAgent``. Returns the app, the saga and a
    counter of model requests (kept outside the engine)."""
    from pydantic_ai.usage import UsageLimits

    from sagaloop.agents.pydantic_ai import SagaAgent  # the optional extra sagaloop[pydantic-ai]

    requests = [0]
    app = App("bench_agent")
    saga_agent = SagaAgent(_agent(turns, result_bytes, requests), app=app)

    @app.saga(name="loop")
    async def loop(ctx: SagaContext) -> int:
        result = await saga_agent.run("go", usage_limits=UsageLimits(request_limit=None))
        return len(result.all_messages())

    return app, loop, requests


def run_plain(turns: int, result_bytes: int = RESULT_BYTES) -> dict[str, Any]:
    """The same agent run plainly, in process (no saga, no store): what Pydantic AI itself
    costs per turn, the floor of the engine's figure."""
    from pydantic_ai.usage import UsageLimits

    requests = [0]
    agent = _agent(turns, result_bytes, requests)
    t0 = time.thread_time()
    result = asyncio.run(agent.run("go", usage_limits=UsageLimits(request_limit=None)))
    cpu = time.thread_time() - t0
    if requests[0] != turns + 1 or len(result.all_messages()) != 2 * (turns + 1):
        raise RuntimeError(f"the plain {turns}-turn loop made {requests[0]} requests")
    return {"cpu_ms_per_turn": cpu * 1000 / turns}


class _Clocks:
    """Thread CPU time of the engine's activations, and within them of the saga code (Pydantic
    AI's agent loop, the adapter's hooks, the replayer answering their calls) and of garbage
    collection; and of the steps. The harness runs everything on this thread."""

    def __init__(self, profile: cProfile.Profile | None = None) -> None:
        self.engine = self.saga = self.gc = self.steps = 0.0
        self.activations = self.step_messages = 0
        self._profile = profile
        self._in_engine = False
        self._gc_started = 0.0

    def engine_consumer(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        def timed(delivery: Any) -> None:
            if self._profile is not None:
                self._profile.enable()
            self._in_engine, t0 = True, time.thread_time()
            try:
                fn(delivery)
            finally:
                self.engine += time.thread_time() - t0
                self.activations += 1
                self._in_engine = False
                if self._profile is not None:
                    self._profile.disable()

        return timed

    def worker_consumer(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        def timed(delivery: Any) -> None:
            t0 = time.thread_time()
            try:
                fn(delivery)
            finally:
                self.steps += time.thread_time() - t0
                self.step_messages += 1

        return timed

    def saga_code(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        def timed(loop: Any) -> None:
            t0 = time.thread_time()
            try:
                fn(loop)
            finally:
                if self._in_engine:
                    self.saga += time.thread_time() - t0

        return timed

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.thread_time()
        elif self._in_engine:
            self.gc += time.thread_time() - self._gc_started


def _json_len(value: Any) -> int:
    return len(json.dumps(value))


def _list_len(item_lens: Sequence[int]) -> int:
    """The length of ``json.dumps`` of a list whose items dump to ``item_lens`` characters."""
    return 2 + sum(item_lens) + 2 * max(len(item_lens) - 1, 0)


def history_figures(events: Sequence[Any], model_step: str) -> dict[str, int]:
    """The run's history size, as stored, and what it would be if every model request stored
    its full transcript instead of a delta (computed from the deltas it recorded, a message a
    delta refers to counted as the message it stands for)."""
    from sagaloop.agents.transcript import _long_strings, _sha
    from sagaloop.engine import history as h

    stored = sum(_json_len(e.data) for e in events)
    results = {e.pos: e.data.get("result") for e in events if e.kind == h.STEP_COMPLETED}
    strings: dict[str, int] = {}  # digest -> JSON length of a long string of a step result
    delta_bytes = full_bytes = 0
    by_request: dict[int, list[int]] = {}  # request n -> JSON lengths of its full transcript
    position: dict[int, int | None] = {}  # request n -> its step's position
    for e in events:
        if e.kind == h.STEP_COMPLETED:
            for text in _long_strings(e.data.get("result")):
                strings[_sha(text)] = _json_len(text)
        if e.kind != h.STEP_SCHEDULED or e.name != model_step:
            continue
        d = ((e.data.get("args") or {}).get("request") or {}).get("transcript") or {}
        append = [_json_len(m) for m in d.get("append", [])]
        delta_bytes += _list_len(append)
        for index, ref in (d.get("refs") or {}).items():  # a response, by reference
            value = results.get(position.get(int(ref["n"])))
            for key in ref.get("path") or []:
                value = value[key] if value is not None else None
            append[int(index)] = _json_len(value)
        for value in d.get("values") or []:  # a tool's result, by digest
            append[int(value["at"][0])] += strings.get(value["sha"], 4) - 4
        base = by_request.get(d["prev"], []) if d.get("prev") is not None else []
        full = [*base[: int(d.get("keep", 0))], *append]
        by_request[int(d.get("n", 0))] = full
        position[int(d.get("n", 0))] = e.pos
        full_bytes += _list_len(full)
    return {
        "stored": stored,
        "transcript_deltas": delta_bytes,
        "full_transcripts": full_bytes,
        "if_full": stored - delta_bytes + full_bytes,
        "model_requests": len(by_request),
    }


def run_loop(turns: int, *, profile: cProfile.Profile | None = None) -> dict[str, Any]:
    """One agent loop of ``turns`` turns, driven to its end."""
    from sagaloop.testing import Harness

    app, saga, requests = loop_app(turns)
    env = Harness(app, cache=True)
    clocks = _Clocks(profile)
    # Harness.step_once hands each message to one of these two consumers; the engine runs saga
    # code in DeterministicLoop.run_until_blocked (patched for this run only)
    env._engine_consumer.process = clocks.engine_consumer(env._engine_consumer.process)  # type: ignore[method-assign]
    env._worker_consumer.process = clocks.worker_consumer(env._worker_consumer.process)  # type: ignore[method-assign]
    run_until_blocked = DeterministicLoop.run_until_blocked
    DeterministicLoop.run_until_blocked = clocks.saga_code(run_until_blocked)  # type: ignore[method-assign]
    gc.callbacks.append(clocks.on_gc)
    try:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        run_id = env.start(saga)
        env.run_until_idle()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        record = env.get(run_id)
        if record.status != "completed":
            raise RuntimeError(f"the {turns}-turn loop ended {record.status}: {record.error}")
        if requests[0] != turns + 1:
            raise RuntimeError(f"{requests[0]} model requests for {turns} turns")
        if env.result(run_id) != 2 * (turns + 1):
            raise RuntimeError(f"the agent's result has {env.result(run_id)} messages")
        events = env.history(run_id)
        sizes = history_figures(events, MODEL_STEP)
        by_event: dict[str, int] = {}
        for e in events:
            label = f"{e.kind} {e.name}" if e.name else e.kind
            by_event[label] = by_event.get(label, 0) + _json_len(e.data)
    finally:
        gc.callbacks.remove(clocks.on_gc)
        DeterministicLoop.run_until_blocked = run_until_blocked  # type: ignore[method-assign]
        env.close()
    per_turn = 1000 / turns
    return {
        "turns": turns,
        "model_requests": requests[0],
        "events": len(events),
        "history_bytes": sizes["stored"],
        "history_bytes_per_turn": sizes["stored"] / turns,
        "transcript_delta_bytes": sizes["transcript_deltas"],
        "full_transcript_bytes": sizes["full_transcripts"],
        "history_bytes_if_full": sizes["if_full"],
        "history_bytes_if_full_per_turn": sizes["if_full"] / turns,
        "engine_cpu_ms_per_turn": clocks.engine * per_turn,
        "saga_code_cpu_ms_per_turn": clocks.saga * per_turn,
        "engine_gc_cpu_ms_per_turn": clocks.gc * per_turn,
        "engine_activations": clocks.activations,
        "steps_cpu_ms_per_turn": clocks.steps * per_turn,
        "step_messages": clocks.step_messages,
        "history_bytes_per_turn_by_event": {k: v / turns for k, v in by_event.items()},
        "cpu_s": cpu,
        "wall_s": wall,
    }


def _stored_bytes(env: Any, run_id: str) -> int:
    """The run's bytes in the store's own tables: its history rows' ``data`` and its payloads
    (compressed, as stored)."""
    import sqlalchemy as sa

    with env.store.engine.connect() as conn:
        history = conn.execute(
            sa.text(
                "SELECT COALESCE(SUM(LENGTH(data)), 0) FROM sagaloop_history WHERE run_id = :r"
            ),
            {"r": run_id},
        ).scalar_one()
        payloads = conn.execute(
            sa.text(
                "SELECT COALESCE(SUM(LENGTH(data)), 0) FROM sagaloop_payloads WHERE run_id = :r"
            ),
            {"r": run_id},
        ).scalar_one()
    return int(history) + int(payloads)


def _pydantic_ai_storage_app(turns: int) -> tuple[App, Any]:
    from pydantic_ai.messages import ModelMessagesTypeAdapter
    from pydantic_ai.usage import UsageLimits

    from sagaloop.agents.pydantic_ai import SagaAgent

    app = App("bench_storage")
    saga_agent = SagaAgent(_agent(turns, RESULT_BYTES, [0]), app=app)

    @app.saga(name="loop")
    async def loop(ctx: SagaContext) -> int:
        result = await saga_agent.run("go", usage_limits=UsageLimits(request_limit=None))
        return len(ModelMessagesTypeAdapter.dump_json(result.all_messages()))

    return app, loop


def _openai_agents_storage_app(turns: int) -> tuple[App, Any]:
    from agents import Agent, function_tool
    from agents.items import ModelResponse
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
    from agents.usage import Usage

    from sagaloop.agents.openai_agents import SagaRunner

    def reply(*items: Any) -> ModelResponse:
        usage = Usage(requests=1, input_tokens=60, output_tokens=20, total_tokens=80)
        return ModelResponse(output=list(items), usage=usage, response_id=None)

    steps: list[Any] = [
        reply(assistant_message(f"turn {i}"), function_call("lookup", {"i": i}, call_id=f"c{i}"))
        for i in range(turns)
    ]
    steps.append(ModelStep.respond(lambda call: reply(assistant_message("done"))))

    @function_tool
    async def lookup(i: int) -> str:
        """Look the record up."""
        return TOOL_RESULT_PREFIX.format(i=i).ljust(RESULT_BYTES, "x")

    app = App("bench_storage")
    agent: Agent[Any] = Agent(name="loop", model=ScriptedModel(steps), tools=[lookup])
    runner = SagaRunner(app, agent)

    @app.saga(name="loop")
    async def loop(ctx: SagaContext) -> int:
        result = await runner.run(agent, "go", max_turns=turns + 5)
        return len(json.dumps(result.to_input_list(), default=str))

    return app, loop


def measure_storage(turns: int = STORAGE_TURNS) -> dict[str, Any]:
    """Storage per agent turn of each adapter, next to the new content per turn."""
    from sagaloop.testing import Harness

    out: dict[str, Any] = {}
    for adapter, make in (
        ("Pydantic AI", _pydantic_ai_storage_app),
        ("OpenAI Agents", _openai_agents_storage_app),
    ):
        app, saga = make(turns)
        env = Harness(app, cache=True)
        try:
            run_id = env.start(saga)
            env.run_until_idle()
            record = env.get(run_id)
            if record.status != "completed":
                raise RuntimeError(f"the {adapter} loop ended {record.status}: {record.error}")
            new = int(env.result(run_id))
            stored = _stored_bytes(env, run_id)
            by_event: dict[str, int] = {}
            for e in env.history(run_id):
                label = f"{e.kind} {e.name}" if e.name else e.kind
                by_event[label] = by_event.get(label, 0) + _json_len(e.data)
        finally:
            env.close()
        out[adapter] = {
            "turns": turns,
            "stored_bytes_per_turn": stored / turns,
            "new_bytes_per_turn": new / turns,
            "ratio": stored / new,
            "history_bytes_per_turn_by_event": {k: v / turns for k, v in by_event.items()},
        }
    return out


def storage_figures(results: dict[str, Any] | None) -> list[Figure]:
    """The rows of storage per agent turn, one per adapter."""
    section = "9 transcript"
    what = "storage per agent turn / new content per turn"
    if not results:
        return [Figure(section, what, "not run")]
    if "error" in results:
        return [Figure(section, what, f"FAILED: {results['error']}")]
    figs = []
    for adapter, x in results.items():
        if adapter.startswith("_"):  # what make bench adds: the section's time, the load
            continue
        biggest = sorted(x["history_bytes_per_turn_by_event"].items(), key=lambda kv: -kv[1])[:4]
        note = (
            f"{x['turns']} turns of a {RESULT_BYTES // 1024} KB tool result; bytes of the run in "
            "sagaloop_history + sagaloop_payloads per turn; new content: the JSON of the "
            "conversation's messages, each once, per turn. Largest per turn: "
            + ", ".join(f"{k} {_kb(v)}" for k, v in biggest)
        )
        figs.append(
            Figure(
                section,
                f"{adapter} agent loop, {what}",
                f"{_kb(x['stored_bytes_per_turn'])} / {_kb(x['new_bytes_per_turn'])}",
                f"{x['ratio']:.2f}x new content",
                f"<= {STORAGE_TARGET}x new content",
                x["ratio"] <= STORAGE_TARGET,
                note,
            )
        )
    return figs


def measure(sizes: Sequence[int] = TURNS) -> dict[str, Any]:
    """Every loop of ``sizes`` once, each next to the plain agent's run of the same length. The
    smallest is the reference: it runs first and again last, and the two are pooled (the
    machine is shared: its load moves CPU times between the start and the end of the long
    run). A short loop runs before all and is not counted: what is paid once per process
    (pydantic's serializers and validators built on first use) would fall on the reference."""
    run_loop(3)
    run_plain(3)

    def both(turns: int) -> dict[str, Any]:
        x = run_loop(turns)
        x["plain_cpu_ms_per_turn"] = run_plain(turns)["cpu_ms_per_turn"]
        return x

    out: dict[str, Any] = {str(turns): both(turns) for turns in sizes}
    first, again = out[str(sizes[0])], both(sizes[0])
    pooled: dict[str, Any] = {
        k: (v + again[k]) / 2 if isinstance(v, float) else v for k, v in first.items()
    }
    pooled["reference_runs"] = [first, again]
    out[str(sizes[0])] = pooled
    return out


def profile_engine(turns: int, top: int = 30) -> str:
    """cProfile of the engine consumer's work only, over a loop of ``turns`` turns."""
    prof = cProfile.Profile()
    result = run_loop(turns, profile=prof)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return (
        f"engine side of a {turns}-turn loop: {result['engine_cpu_ms_per_turn']:.2f} ms CPU per "
        f"turn (under the profiler)\n" + buf.getvalue()
    )


def figures(results: dict[str, Any] | None, sizes: Sequence[int]) -> list[Figure]:
    """The rows of ``make bench``'s table: one per loop length."""
    section = "9 transcript"
    if not results:
        return [Figure(section, "agent loop, transcript stored once", "not run")]
    if "error" in results:
        return [
            Figure(section, "agent loop, transcript stored once", f"FAILED: {results['error']}")
        ]
    keys = [str(n) for n in sizes]
    base = results[keys[0]]
    figs = []
    for key in keys:
        x = results[key]
        bytes_ratio = x["history_bytes_per_turn"] / base["history_bytes_per_turn"]
        cpu_ratio = x["engine_cpu_ms_per_turn"] / base["engine_cpu_ms_per_turn"]
        saga_ms = x["saga_code_cpu_ms_per_turn"]
        rest_ms = x["engine_cpu_ms_per_turn"] - saga_ms
        base_rest = base["engine_cpu_ms_per_turn"] - base["saga_code_cpu_ms_per_turn"]
        saved = x["history_bytes_if_full"] / x["history_bytes"]
        note = (
            f"engine CPU: saga code (Pydantic AI's loop, the adapter) {saga_ms:.1f} ms "
            f"({fmt_ratio(saga_ms / base['saga_code_cpu_ms_per_turn'])}), the plain agent alone "
            f"{x['plain_cpu_ms_per_turn']:.1f} ms "
            f"({fmt_ratio(x['plain_cpu_ms_per_turn'] / base['plain_cpu_ms_per_turn'])}); "
            f"the rest of the activations {rest_ms:.1f} ms ({fmt_ratio(rest_ms / base_rest)}); "
            f"GC {x['engine_gc_cpu_ms_per_turn']:.1f} ms. Full transcripts would store "
            f"{_kb(x['history_bytes_if_full_per_turn'])}/turn ({saved:.1f}x). Steps' CPU "
            f"{x['steps_cpu_ms_per_turn']:.1f} ms/turn; {x['wall_s']:.0f} s"
        )
        if "reference_runs" in x:
            start, end = (r["engine_cpu_ms_per_turn"] for r in x["reference_runs"])
            note = f"engine CPU at the start / end of the run {start:.1f} / {end:.1f} ms; " + note
        target, met = "", None
        if key == keys[-1] and len(keys) > 1:
            target = f"bytes and engine CPU per turn <= {FLAT}x the {keys[0]}-turn run's"
            met = bytes_ratio <= FLAT and cpu_ratio <= FLAT
        figs.append(
            Figure(
                section,
                f"agent loop, {x['turns']} turns of a {RESULT_BYTES // 1024} KB tool result: "
                "history bytes / engine CPU per turn",
                f"{_kb(x['history_bytes_per_turn'])} / {x['engine_cpu_ms_per_turn']:.1f} ms",
                f"{fmt_ratio(bytes_ratio)} / {fmt_ratio(cpu_ratio)} {keys[0]}-turn",
                target,
                met,
                note,
            )
        )
    return figs


def _kb(n: float) -> str:
    if math.isnan(n):
        return "n/a"
    return f"{n / 1024:.1f} KB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.1f} MB"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import markdown

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.agent_transcript",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="20 and 200 turns only")
    parser.add_argument("--profile", type=int, metavar="TURNS", help="cProfile the engine side")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    if args.profile:
        print(profile_engine(args.profile))
        return 0
    sizes = QUICK_TURNS if args.quick else TURNS
    results = measure(sizes)
    storage = measure_storage()
    print(markdown(figures(results, sizes) + storage_figures(storage)))
    if args.json:
        args.json.write_text(json.dumps({**results, "storage": storage}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
