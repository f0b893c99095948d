"""The app of the large-payload tests (``test_payloads.py`` here, and
``tests/chaos/test_payloads_dev.py``), run by real sagaloop processes: a step returns a
transcript of several MiB, the saga passes MiBs of it to another step."""

from __future__ import annotations

from sagaloop import App, RetryPolicy, SagaContext, StepContext

app = App("payloadapp")
MiB = 1024 * 1024


def text_of(n: int) -> str:
    """``n`` characters of transcript-like text, some not ASCII."""
    line = "user: où est ma commande 7? assistant: elle arrive demain ✓\n"
    return (line * (n // len(line) + 1))[:n]


@app.step(queue="work")
def transcript(ctx: StepContext, n: int) -> str:
    return text_of(n)


@app.step(queue="work")
def measure(ctx: StepContext, text: str) -> int:
    return len(text)


@app.step(queue="work", retry=RetryPolicy(max_attempts=1))
def flood(ctx: StepContext, n: int) -> str:
    return "x" * n


@app.saga(name="agent")
async def agent(ctx: SagaContext, n: int) -> list[int]:
    """A step result of ``n`` characters; after the event ``go`` (a point to restart the
    engine at: the result then comes back from the history in the database), 2 MiB of it as
    a step argument."""
    text = await ctx.call(transcript, n)
    await ctx.wait_for_event("go")
    return [len(text), await ctx.call(measure, text[: 2 * MiB])]


@app.saga(name="overflow")
async def overflow(ctx: SagaContext, n: int) -> int:
    return len(await ctx.call(flood, n))
