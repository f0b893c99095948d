"""The app that the sagaloop benchmarks run (``--app benchmarks.benchapp``): trivial steps, so
that what is measured is sagaloop's own cost per step."""

from __future__ import annotations

from sagaloop import App, SagaContext, StepContext

app = App("bench")


@app.step(queue="bench")
def noop(ctx: StepContext, i: int) -> int:
    return i


@app.step(local=True)
def noop_local(ctx: StepContext, i: int) -> int:
    """``noop`` as an in-process step: the ``sagaloop engine`` process runs it, no worker."""
    return i


@app.saga(name="chain")
async def chain(ctx: SagaContext, steps: int) -> int:
    """``steps`` trivial steps, one after the other."""
    total = 0
    for i in range(steps):
        total += await ctx.call(noop, i)
    return total


@app.saga(name="chain_local")
async def chain_local(ctx: SagaContext, steps: int) -> int:
    """``chain`` with in-process steps: ``steps`` calls of ``noop_local``, one after the other."""
    total = 0
    for i in range(steps):
        total += await ctx.call(noop_local, i)
    return total


@app.saga(name="agent")
async def agent(ctx: SagaContext, iterations: int) -> int:
    """An agent loop: each iteration asks a "model" step, and the saga keeps what it said (the
    state a real agent carries from one iteration to the next)."""
    transcript: list[int] = []
    for i in range(iterations):
        transcript.append(await ctx.call(noop, i))
    return len(transcript)


@app.saga(name="waiter")
async def waiter(ctx: SagaContext) -> str:
    """Waits for one event, then finishes."""
    value = await ctx.wait_for_event("go")
    return str(value)
