"""The app that tests/unit/test_mcp_server.py serves over MCP (``sagaloop mcp --app
mcp_sagas_app``) and runs (``sagaloop dev --app mcp_sagas_app``)."""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel, Field

from sagaloop import App, SagaContext, StepContext

app = App("mcp-shop")


class RefundRequest(BaseModel):
    order: str = Field(description="The order to refund.")
    amount: int = Field(gt=0, description="How many cents to refund.")


@app.step
def pay_back(ctx: StepContext, order: str, amount: int) -> str:
    return f"rf-{order}-{amount}"


@app.saga(name="refund")
async def refund(ctx: SagaContext, request: RefundRequest) -> dict[str, object]:
    """Refund an order: a person approves it, then the parcel must come back (two days at
    most)."""
    decision = await ctx.approval("refund", request.model_dump(), reason="the customer asks")
    if not decision.approved:
        return {"refunded": False, "reason": decision.reason}
    ctx.publish("stage", "waiting for the parcel")
    await ctx.wait_for_event("parcel_returned", timeout=timedelta(days=2), prompt="parcel back?")
    refund_id = await ctx.call(pay_back, request.order, request.amount)
    return {"refunded": True, "refund_id": refund_id}


@app.saga(name="billing.greet")
async def greet(ctx: SagaContext, name: str) -> str:
    """Greet someone by name."""
    return f"hello {name}"


@app.saga
async def tick(ctx: SagaContext) -> int:
    return 1
