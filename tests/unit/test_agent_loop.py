"""An agent loop whose next step is chosen at run time by a scripted "model" step: it survives
an interruption without calling the model again for recorded iterations, and its cost is
linear in the number of iterations."""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import pytest
from pydantic import BaseModel

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.testing import Harness

ITERATIONS = 200
ACTIONS = ("search", "calculate", "think")


def make_script(n: int, seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    script = [{"action": rng.choice(ACTIONS), "arg": rng.randint(0, 999)} for _ in range(n - 1)]
    return [*script, {"action": "finish", "arg": 0}]


class Decision(BaseModel):
    action: str
    arg: int


class AgentResult(BaseModel):
    decisions: list[Decision]
    total: int
    notes: list[str]


def agent_app(script: list[dict[str, Any]]) -> tuple[App, Any, Counter[str], Counter[str]]:
    """The model step picks the next entry of the script by counting its own calls per run in
    an external ledger: if it were called again for an iteration already recorded, the
    decisions would shift and the ledger would exceed the script length.

    ``executions`` counts how often the saga code runs a loop iteration (replays included):
    a measure of the engine's work that does not depend on the machine's speed."""
    app = App("agent")
    ledger: Counter[str] = Counter()
    executions: Counter[str] = Counter()

    @app.step(queue="llm")
    def decide(ctx: StepContext, iteration: int, total: int) -> Decision:
        index = ledger[ctx.run_id]
        ledger[ctx.run_id] += 1
        return Decision(**script[index])

    @app.step(queue="tools")
    def search(ctx: StepContext, query: int) -> str:
        return f"doc-{query}"

    @app.step(local=True)
    def calculate(ctx: StepContext, a: int, b: int) -> int:
        return (a + b) % 1_000_003

    @app.saga(name="agent")
    async def agent(ctx: SagaContext, limit: int) -> AgentResult:
        decisions: list[Decision] = []
        notes: list[str] = []
        total = 0
        for iteration in range(limit):
            executions[ctx.run_id] += 1
            decision = await ctx.call(decide, iteration, total)
            decisions.append(decision)
            if decision.action == "finish":
                break
            if decision.action == "search":
                notes.append(await ctx.call(search, decision.arg))
            elif decision.action == "calculate":
                total = await ctx.call(calculate, total, decision.arg)
        return AgentResult(decisions=decisions, total=total, notes=notes)

    return app, agent, ledger, executions


def comparable(env: Harness, run_id: str) -> list[tuple[Any, ...]]:
    return [(e.kind, e.pos, e.name, e.data) for e in env.history(run_id)]


@pytest.fixture(scope="module")
def script() -> list[dict[str, Any]]:
    return make_script(ITERATIONS)


@pytest.fixture(scope="module")
def reference(script: list[dict[str, Any]]) -> tuple[Any, list[tuple[Any, ...]]]:
    """The uninterrupted run: its output and its history."""
    app, agent, ledger, executions = agent_app(script)
    env = Harness(app, cache=True)
    run_id = env.start(agent, ITERATIONS + 50, run_id="agent-run")
    env.run_until_idle()
    run = env.get(run_id)
    assert run.status == "completed"
    assert ledger[run_id] == ITERATIONS
    # the suspended run is cached: no activation replays the loop from the start
    assert executions[run_id] == ITERATIONS
    return run.output, comparable(env, run_id)


def test_uninterrupted_loop_runs_every_iteration(
    script: list[dict[str, Any]], reference: tuple[Any, list[tuple[Any, ...]]]
) -> None:
    output, history = reference
    assert [d["action"] for d in output["decisions"]] == [d["action"] for d in script]
    assert output["decisions"] == script
    searches = [d for d in script if d["action"] == "search"]
    assert output["notes"] == [f"doc-{d['arg']}" for d in searches]
    scheduled = Counter(name for kind, _, name, _ in history if kind == h.STEP_SCHEDULED)
    assert scheduled["decide"] == ITERATIONS
    assert scheduled["search"] == len(searches)
    assert scheduled["calculate"] == sum(1 for d in script if d["action"] == "calculate")
    positions = [pos for kind, pos, _, _ in history if kind == h.STEP_COMPLETED]
    assert len(positions) == len(set(positions)), "each step result is recorded once"


@pytest.mark.parametrize("cache_size", [1024, 0])
def test_interrupted_loop_resumes_without_calling_the_model_again(
    script: list[dict[str, Any]],
    reference: tuple[Any, list[tuple[Any, ...]]],
    cache_size: int,
) -> None:
    app, agent, ledger, executions = agent_app(script)
    env = Harness(app, cache=True)
    run_id = env.start(agent, ITERATIONS + 50, run_id="agent-run")
    for _ in range(100_000):
        if ledger[run_id] >= 100:
            break
        env.step_once()
    assert ledger[run_id] == 100
    assert env.get(run_id).status == "running"
    assert executions[run_id] == 100
    executions.clear()

    env.cache_size = cache_size  # with 0, every activation replays the whole history
    env.restart()
    env.run_until_idle()

    run = env.get(run_id)
    assert run.status == "completed"
    output, history = reference
    assert run.output == output, "the decisions are identical to the uninterrupted run"
    assert ledger[run_id] == ITERATIONS, "the model is not called again for recorded iterations"
    assert comparable(env, run_id) == history
    if cache_size:  # one replay of the recorded iterations after the restart, then cached
        assert executions[run_id] == ITERATIONS
    else:  # a replay from the start on every activation: the knob really was exercised
        assert executions[run_id] > 5 * ITERATIONS


# --- cost --------------------------------------------------------------------------------------


def loop_app(*, local: bool) -> tuple[App, Any, Counter[str]]:
    app = App("cost")
    executions: Counter[str] = Counter()

    @app.step(local=local)
    def inc(ctx: StepContext, x: int) -> int:
        return x + 1

    @app.saga(name="count")
    async def count(ctx: SagaContext, n: int) -> int:
        x = 0
        for _ in range(n):
            executions[ctx.run_id] += 1
            x = await ctx.call(inc, x)
        return x

    return app, count, executions


def per_iteration(app: App, saga: Any, executions: Counter[str], n: int, repeat: int = 2) -> float:
    best = float("inf")
    for _ in range(repeat):
        env = Harness(app, cache=True)  # production keeps suspended runs
        started = time.perf_counter()
        run_id = env.start(saga, n)
        env.run_until_idle()
        elapsed = time.perf_counter() - started
        assert env.get(run_id).output == n
        # the work, measured without a clock: each iteration of saga code runs once
        assert executions[run_id] == n
        best = min(best, elapsed)
        env.close()
    return best / n


@pytest.mark.parametrize(("local", "small", "large"), [(True, 100, 1000), (False, 20, 200)])
def test_cost_per_iteration_does_not_grow_with_history(local: bool, small: int, large: int) -> None:
    app, saga, executions = loop_app(local=local)
    per_iteration(app, saga, executions, small, repeat=1)  # warm up imports and pydantic caches
    short = per_iteration(app, saga, executions, small)
    long = per_iteration(app, saga, executions, large)
    assert long / short < 3, f"{long * 1e3:.3f} ms vs {short * 1e3:.3f} ms per iteration"
