"""The one saga the crash matrix needs that tests/integration/itapp.py lacks: effects with durable
sleeps between them, so that the timer scheduler has timers to fire. Its steps write to itapp's
ledger (same file, same tables) with itapp's helpers, so one set of checks covers both apps."""

from __future__ import annotations

from datetime import timedelta

from itapp import FAST, _record, ledger

from sagaloop import App, SagaContext, StepContext

app = App("matrix_app")
NAP = timedelta(seconds=0.5)


@app.step(queue="work", retry=FAST)
def effect(ctx: StepContext, name: str) -> str:
    _record(ctx, name)
    return f"{name}:done"


@effect.reconcile
def find_effect(ctx: StepContext, name: str) -> str | None:
    with ledger() as conn:
        row = conn.execute("select 1 from effects where key = ?", (ctx.idempotency_key,)).fetchone()
    return f"{name}:done" if row else None


@app.saga(name="naps")
async def naps(ctx: SagaContext, names: list[str]) -> list[str]:
    """``effect(names[0])``, then a durable sleep before each further effect."""
    done = [await ctx.call(effect, names[0])]
    for name in names[1:]:
        await ctx.sleep(NAP)
        done.append(await ctx.call(effect, name))
    return done
