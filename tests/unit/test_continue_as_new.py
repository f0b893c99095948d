"""`ctx.continue_as_new(input)`: the run's history restarts under the same run id, so a loop
that runs for months keeps a bounded history; positions go on counting, so no idempotency key
repeats; a restart at any message changes nothing."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.testing import Harness

app = App("continue")
keys: list[str] = []


@app.step()
def tick(ctx: StepContext, n: int) -> int:
    keys.append(ctx.idempotency_key)
    return n + 1


@app.saga(name="looping")
async def looping(ctx: SagaContext, state: dict[str, int]) -> dict[str, Any]:
    """Temporal's continue-as-new sample, with a step and a durable sleep per iteration."""
    n = state["n"]
    for _ in range(3):  # a few iterations per history, then a fresh one
        if n >= state["until"]:
            return {"n": n, "history": len(ctx.run_id)}
        n = await ctx.call(tick, n)
        await ctx.sleep(timedelta(hours=1))
    ctx.continue_as_new({"n": n, "until": state["until"]})


def test_a_long_loop_keeps_a_bounded_history_and_never_repeats_a_key() -> None:
    keys.clear()
    env = Harness(app)
    run_id = env.start(looping, {"n": 0, "until": 20})
    sizes: list[int] = []
    for _ in range(2000):
        if not env.step_once():
            if env.store.next_timer_at(app=app.name) is None:
                break
            env.clock.set(env.store.next_timer_at(app=app.name))  # type: ignore[arg-type]
        sizes.append(len(env.history(run_id)))
        if len(sizes) % 7 == 0:
            env.restart()  # forget everything in memory now and then
    run = env.get(run_id)
    assert run.status == "completed", env.status(run_id).to_json()
    assert run.output["n"] == 20
    assert len(keys) == 20 and len(set(keys)) == 20, keys  # positions go on counting
    assert max(sizes) < 30, max(sizes)  # 3 iterations per history, not 20
    history = env.history(run_id)
    assert history[0].kind == h.RUN_STARTED and history[0].data["input"] == {"n": 18, "until": 20}
    assert history[0].data["first_pos"] == 36 and history[0].data["epoch"] == 6


def test_continue_as_new_is_not_caught_by_except_exception() -> None:
    sneaky = App("sneaky")

    @sneaky.saga(name="s")
    async def s(ctx: SagaContext, n: int) -> int:
        if n == 3:
            return n
        try:
            ctx.continue_as_new(n + 1)
        except Exception:  # must not swallow it
            return -1

    env = Harness(sneaky)
    run_id = env.start(s, 0)
    env.run_until_idle()
    assert env.result(run_id) == 3
