"""A travel agent (Pydantic AI, the real `openai` client) whose model is the OpenAI-compatible
server of tests/unit/openai_server.py at $MODEL_URL, run by `sagaloop dev`: its `book` tool
writes to a ledger outside the engine ($LEDGER_PATH), and so does its compensation."""

from __future__ import annotations

import os
import sqlite3
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from sagaloop import App, SagaContext, StepContext
from sagaloop.agents.pydantic_ai import SagaAgent, ToolPolicy

app = App("provider")


def write(line: str) -> None:
    with sqlite3.connect(os.environ["LEDGER_PATH"], timeout=60, isolation_level=None) as conn:
        conn.execute("create table if not exists ledger (line text)")
        conn.execute("insert into ledger values (?)", (line,))


def cancel(ctx: StepContext, args: dict[str, Any], value: Any) -> None:
    write(f"cancelled {args['trip']}")


model = OpenAIChatModel(
    "scripted-model",
    provider=OpenAIProvider(
        base_url=os.environ.get("MODEL_URL", "http://127.0.0.1:9/v1"), api_key="k"
    ),
)
agent = Agent(model, name="travel")


@agent.tool_plain
def book(trip: str) -> str:
    """Book a trip."""
    write(f"booked {trip}")
    return "booked"


travel = SagaAgent(agent, app=app, tools={"book": ToolPolicy(compensation=cancel)})


@app.saga(name="trip")
async def trip(ctx: SagaContext, where: str) -> str:
    return str((await travel.run(f"book {where}")).output)
