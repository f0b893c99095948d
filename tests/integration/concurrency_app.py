"""Run concurrency keys (issue 25) for real ``sagaloop dev`` processes: a saga limited to
``LIMIT`` runs at once per user, whose step takes a while, so that runs of a key overlap
unless the limit holds; and one limited to one run at once that cancels the new ones."""

from __future__ import annotations

import time
from typing import Any

from sagaloop import App, SagaContext, StepContext
from sagaloop.sagas.concurrency import Concurrency

app = App("concurrency_app")
LIMIT = 2


@app.step(queue="work")
def hold(ctx: StepContext, seconds: float) -> str:
    time.sleep(seconds)
    return "held"


@app.saga(name="per_user", concurrency=Concurrency(limit=LIMIT, key=lambda i: i["user"]))
async def per_user(ctx: SagaContext, input: dict[str, Any]) -> str:
    return await ctx.call(hold, 0.2)


@app.saga(name="singleton", concurrency=Concurrency(limit=1, at_limit="cancel_new"))
async def singleton(ctx: SagaContext, input: dict[str, Any]) -> str:
    return await ctx.call(hold, 1.0)
