"""Small primitives that workflows ported from other engines need (issue 25): published values
that survive ``continue_as_new``, the failed step's error type as a field of the run's error, a
timeout on a child call, ``ctx.deprecate_patch`` and ``ctx.started_by``."""

from __future__ import annotations

from sagaloop import App, SagaContext
from sagaloop.engine import history as h
from sagaloop.testing import Harness

# --- published values survive continue_as_new ----------------------------------------------------

carried = App("carried")


@carried.saga(name="counter")
async def counter(ctx: SagaContext, n: int) -> int:
    if n == 0:
        ctx.publish("first", "from the first history")
    ctx.publish("n", n)
    if n < 2:
        ctx.continue_as_new(n + 1)
    await ctx.wait_for_event("stop")
    ctx.publish("first", "overwritten")
    return n


def test_published_values_survive_continue_as_new_until_overwritten() -> None:
    env = Harness(carried)
    run_id = env.start(counter, 0)
    env.run_until_idle()
    history = env.history(run_id)
    assert history[0].kind == h.RUN_STARTED and history[0].data["epoch"] == 2
    assert not any(e.kind == h.PUBLISHED and e.name == "first" for e in history)
    assert env.client.get_published(run_id, "first") == "from the first history"
    assert env.client.get_published(run_id, "n") == 2
    assert env.status(run_id).published == {"first": "from the first history", "n": 2}
    env.restart()  # folded from the stored history alone
    assert env.client.get_published(run_id, "first") == "from the first history"
    env.send_event(run_id, "stop")
    env.run_until_idle()
    assert env.result(run_id) == 2
    assert env.client.get_published(run_id, "first") == "overwritten"
