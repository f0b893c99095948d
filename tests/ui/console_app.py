"""The app that tests/ui/test_console.py runs (``sagaloop dev --app console_app``) and shows
(``sagaloop ui --app console_app``): a refund that a person approves, a charge that fails, and
an agent (Pydantic AI's FunctionModel: offline) that calls a tool."""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext
from sagaloop.agents.pydantic_ai import SagaAgent

app = App("console-shop")


class Refund(BaseModel):
    order: str
    amount: int


@app.step
def hold_stock(ctx: StepContext, order: str) -> str:
    return f"hold-{order}"


@hold_stock.compensation
def release_stock(ctx: StepContext, order: str, result: str) -> None:
    pass


@app.step
def pay_back(ctx: StepContext, order: str, amount: int) -> str:
    return f"rf-{order}-{amount}"


@app.saga(name="refund")
async def refund(ctx: SagaContext, request: Refund) -> dict[str, object]:
    """Hold the stock, ask a person, wait for the parcel, pay back."""
    await ctx.call(hold_stock, request.order)
    decision = await ctx.approval(
        "refund",
        request.model_dump(),
        call_id="refund",
        reason="the customer asks",
        args_type=Refund,
    )
    if not decision.approved:
        return {"refunded": False, "reason": decision.reason}
    request = Refund.model_validate(decision.args)  # the approver may have edited them
    ctx.publish("stage", "waiting for the parcel")
    await ctx.wait_for_event(
        "parcel_returned", timeout=timedelta(days=2), prompt="has the parcel come back?"
    )
    refund_id = await ctx.call(pay_back, request.order, request.amount)
    return {"refunded": True, "refund_id": refund_id}


@app.step(retry=RetryPolicy(max_attempts=2, initial_interval=timedelta(milliseconds=50)))
def charge_card(ctx: StepContext, card: str, amount: int) -> str:
    raise ApplicationError(f"card {card} declined: insufficient funds for {amount}")


@app.saga(name="charge")
async def charge(ctx: SagaContext, amount: int) -> str:
    return await ctx.call(charge_card, "4242", amount)


def _model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Looks the order up, then answers with what the tool said."""
    if len(messages) == 1:
        call = ToolCallPart("order_status", {"order": "A-17"})
        return ModelResponse(parts=[TextPart("Let me look the order up."), call])
    found = messages[-1].parts[0].content  # type: ignore[union-attr]
    return ModelResponse(parts=[TextPart(f"Your order {found}.")])


agent = Agent(FunctionModel(_model), name="support", instructions="Answer about orders.")


@agent.tool_plain
def order_status(order: str) -> str:
    """Where an order is."""
    return f"{order}: shipped on Monday"


saga_agent = SagaAgent(agent, app=app)


@app.saga(name="support")
async def support(ctx: SagaContext, question: str) -> str:
    result = await saga_agent.run(question)
    return str(result.output)


@app.step(retry=RetryPolicy(max_attempts=1, give_up="park"))
def charge_stuck(ctx: StepContext, card: str, amount: int) -> str:
    raise ApplicationError(f"card {card} declined: the bank is unreachable ({amount})")


@app.saga(name="charge_and_ask")
async def charge_and_ask(ctx: SagaContext, amount: int) -> str:
    """Charges while a person is asked: the charge fails and parks the run (needs attention)
    with its approval still asked."""
    import asyncio

    charged, decision = await asyncio.gather(
        ctx.call(charge_stuck, "4242", amount),
        ctx.approval("charge", {"amount": amount}, call_id="charge"),
    )
    return f"{charged} {decision.approved}"
