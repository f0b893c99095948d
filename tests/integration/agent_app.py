"""Agents run as sagas by real `sagaloop` processes: the same shop as a Pydantic AI agent (saga
``checkout``) and as an OpenAI Agents SDK agent (saga ``checkout_oa``).

The model is a ``FunctionModel`` scripted from the messages (no network), so every run of the
same order takes the same turns: turn 0 calls ``charge`` and ``note`` in parallel, turn 1 calls
``ship``, turn 2 answers with the tool results in the order the transcript holds them.

Everything the model and the tools do lands in a ledger outside the engine: PostgreSQL at
$LEDGER_URL, else the SQLite file $LEDGER_PATH (the embedded default's tests).

- ``model_calls(run_id, turn)``: one row per model request served (a request paid twice shows
  as two rows);
- ``effects(run_id, name, key)``: each tool's effect under its key (the tool call id for the
  function tools, the step's idempotency key for ``ship``); the downstream honours keys;
- ``bodies(run_id, name, key, pid, at)``: every execution of a tool body, by which process
  and when;
- ``charges(run_id, order_id, amount, key, pid, at)``: the payment provider, which does *not*
  deduplicate: a charge repeated is a row more. ``charge`` is non-idempotent and reconciled
  by looking its charge up here.

The queues: the model requests on "model", ``note`` and ``ship`` on "tools", ``charge`` on
"payments" (so a test can arm a crash point in a process that runs charges only).

In a process started with ``AGENT_HANG_AT=charge``, every ``charge`` hangs right after its
charge is made (the test SIGKILLs the process there).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from agents import Agent as OAAgent
from agents import ModelResponse as OAResponse
from agents import function_tool
from agents.models.interface import Model as OAModel
from agents.testing import assistant_message, function_call
from agents.tool_context import ToolContext
from agents.usage import Usage
from pydantic_ai import Agent, RunContext, models
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from sagaloop import App, RetryPolicy, SagaContext, StepContext
from sagaloop.agents.openai_agents import SagaRunner, step_as_function_tool
from sagaloop.agents.pydantic_ai import SagaAgent, ToolPolicy, step_as_tool

models.ALLOW_MODEL_REQUESTS = False  # a model that reached a real provider would fail

app = App("agent_app")
FAST = RetryPolicy(max_attempts=6, initial_interval=timedelta(milliseconds=100))
HANG_SECONDS = 3600.0

SCHEMA = [
    "create table if not exists model_calls (run_id text, turn int)",
    "create table if not exists effects (run_id text, name text, key text,"
    " primary key (run_id, name, key))",
    "create table if not exists bodies (run_id text, name text, key text, pid int, at float)",
    "create table if not exists charges (run_id text, order_id text, amount int, key text,"
    " pid int, at float)",
]


class Ledger:
    """The ledger outside the engine: PostgreSQL at ``url``, else the SQLite file ``path``."""

    def __init__(self, *, url: str | None = None, path: str | None = None) -> None:
        if not url and not path:
            raise RuntimeError("set LEDGER_URL (PostgreSQL) or LEDGER_PATH (a SQLite file)")
        self.url = url.replace("postgresql+psycopg://", "postgresql://") if url else None
        self.path = path

    @classmethod
    def from_env(cls) -> Ledger:
        return cls(url=os.environ.get("LEDGER_URL"), path=os.environ.get("LEDGER_PATH"))

    def create(self) -> None:
        self.run(*((sql, ()) for sql in SCHEMA))

    def run(self, *statements: tuple[str, Sequence[Any]]) -> list[tuple[Any, ...]]:
        """Run ``statements`` (``?`` placeholders) in one transaction; the last one's rows."""
        rows: list[tuple[Any, ...]] = []
        if self.url:
            import psycopg

            with psycopg.connect(self.url) as conn, conn.transaction():
                for sql, args in statements:
                    cur = conn.execute(sql.replace("?", "%s"), tuple(args))
                    rows = list(cur.fetchall()) if cur.description else []
            return rows
        assert self.path is not None
        db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        try:
            db.execute("pragma journal_mode=wal")
            db.execute("begin immediate")
            for sql, args in statements:
                rows = list(db.execute(sql, tuple(args)))
            db.execute("commit")
        finally:
            db.close()
        return rows

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return self.run((sql, args))


def _body(run_id: str, name: str, key: str) -> tuple[str, Sequence[Any]]:
    """Count one execution of a tool body (and where and when it ran)."""
    args = (run_id, name, key, os.getpid(), time.time())
    return "insert into bodies values (?, ?, ?, ?, ?)", args


def _effect(run_id: str, name: str, key: str) -> None:
    Ledger.from_env().run(
        _body(run_id, name, key),
        ("insert into effects values (?, ?, ?) on conflict do nothing", (run_id, name, key)),
    )


# --- the model -----------------------------------------------------------------------------------


def _order(messages: list[ModelMessage]) -> dict[str, Any]:
    first = messages[0]
    assert isinstance(first, ModelRequest)
    prompt = next(p.content for p in first.parts if isinstance(p, UserPromptPart))
    assert isinstance(prompt, str)
    order: dict[str, Any] = json.loads(prompt)
    return order


def answer(messages: list[ModelMessage]) -> str:
    """The final answer: every tool result, in the order the transcript holds them."""
    results = [
        f"{p.tool_name}: {p.content}"
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    ]
    return json.dumps(results)


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    order = _order(messages)
    turn = sum(isinstance(m, ModelResponse) for m in messages)
    Ledger.from_env().query("insert into model_calls values (?, ?)", order["run"], turn)
    if turn == 0:
        return ModelResponse(
            parts=[
                TextPart("Charging and noting, in parallel."),
                ToolCallPart("charge", {"order": order["order"], "amount": order["amount"]}),
                ToolCallPart("note", {"text": f"charge {order['order']}"}),
            ]
        )
    if turn == 1:
        return ModelResponse(parts=[ToolCallPart("ship", {"order": order["order"]})])
    return ModelResponse(parts=[TextPart(answer(messages))])


# --- the tools -----------------------------------------------------------------------------------


@dataclass
class Deps:
    run_id: str


@app.step(queue="tools", retry=FAST)
def ship(ctx: StepContext, order: str) -> str:
    """Ship the order (an ``@app.step``, handed to the model with ``step_as_tool``)."""
    _effect(ctx.run_id, "ship", ctx.idempotency_key)
    return f"shipped {order}"


def charge_at_provider(run_id: str, key: str, order: str, amount: int) -> str:
    Ledger.from_env().run(
        _body(run_id, "charge", key),
        (
            "insert into charges values (?, ?, ?, ?, ?, ?)",
            (run_id, order, amount, key, os.getpid(), time.time()),
        ),
        ("insert into effects values (?, ?, ?) on conflict do nothing", (run_id, "charge", key)),
    )
    if os.environ.get("AGENT_HANG_AT") == "charge":
        time.sleep(HANG_SECONDS)  # the test SIGKILLs the process here
    return f"charged {order} {amount}"


def find_charge(ctx: StepContext, args: dict[str, Any]) -> str | None:
    """Did an attempt in doubt charge? Look the charge up at the provider."""
    rows = Ledger.from_env().query(
        "select amount from charges where run_id = ? and order_id = ?", ctx.run_id, args["order"]
    )
    return f"charged {args['order']} {rows[0][0]}" if rows else None


agent = Agent(FunctionModel(script), name="shop", deps_type=Deps, tools=[step_as_tool(ship)])


@agent.tool(
    metadata={
        "sagaloop": ToolPolicy(
            queue="payments", retry=FAST, idempotent=False, reconcile=find_charge
        )
    }
)
def charge(ctx: RunContext[Deps], order: str, amount: int) -> str:
    """Charge the order (not idempotent: the provider charges again if asked again)."""
    return charge_at_provider(ctx.deps.run_id, ctx.tool_call_id or "", order, amount)


@agent.tool(metadata={"sagaloop": ToolPolicy(retry=FAST)})
def note(ctx: RunContext[Deps], text: str) -> str:
    """Write a note on the order."""
    _effect(ctx.deps.run_id, "note", ctx.tool_call_id or "")
    return f"noted {text}"


shop = SagaAgent(agent, app=app, model_retry=FAST)
shop_here = SagaAgent(agent, app=app, name="shop_here", model_retry=FAST, local=True)
"""The same agent with its model requests, ``charge`` and ``note`` as in-process steps
(``ship`` is an app step of its own, on "tools"): saga ``checkout_here``."""


@app.saga(name="checkout")
async def checkout(ctx: SagaContext, order: dict[str, Any]) -> str:
    prompt = json.dumps({"run": ctx.run_id, **order})
    result = await shop.run(prompt, deps=Deps(run_id=ctx.run_id))
    return str(result.output)


@app.saga(name="checkout_here")
async def checkout_here(ctx: SagaContext, order: dict[str, Any]) -> str:
    prompt = json.dumps({"run": ctx.run_id, **order})
    result = await shop_here.run(prompt, deps=Deps(run_id=ctx.run_id))
    return str(result.output)


# --- the same shop as an OpenAI Agents SDK agent (saga "checkout_oa") ----------------------------


class ShopModel(OAModel):
    """The same script, read from the input items: turn 0 calls ``charge`` and ``note``, turn 1
    ``ship``, turn 2 answers with the tool outputs in the order the input holds them."""

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kw: Any
    ) -> Any:
        items = [i for i in input if isinstance(i, dict)]
        order = json.loads(next(i["content"] for i in items if i.get("role") == "user"))
        names = {i["call_id"]: i["name"] for i in items if i.get("type") == "function_call"}
        outputs = [i for i in items if i.get("type") == "function_call_output"]
        turn = {0: 0, 2: 1}.get(len(outputs), 2)
        Ledger.from_env().query("insert into model_calls values (?, ?)", order["run"], turn)
        usage = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
        if turn == 0:
            out = [
                assistant_message("Charging and noting, in parallel."),
                function_call(
                    "charge", {"order": order["order"], "amount": order["amount"]}, call_id="c0"
                ),
                function_call("note", {"text": f"charge {order['order']}"}, call_id="n0"),
            ]
        elif turn == 1:
            out = [function_call("ship", {"order": order["order"]}, call_id="s1")]
        else:
            results = [f"{names[o['call_id']]}: {o['output']}" for o in outputs]
            out = [assistant_message(json.dumps(results))]
        return OAResponse(output=out, usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@function_tool(name_override="charge")
def oa_charge(ctx: ToolContext[Deps], order: str, amount: int) -> str:
    """Charge the order (not idempotent: the provider charges again if asked again)."""
    return charge_at_provider(ctx.context.run_id, ctx.tool_call_id, order, amount)


@function_tool(name_override="note")
def oa_note(ctx: ToolContext[Deps], text: str) -> str:
    """Write a note on the order."""
    _effect(ctx.context.run_id, "note", ctx.tool_call_id)
    return f"noted {text}"


shop_oa: OAAgent[Deps] = OAAgent(
    name="shop_oa",
    model=ShopModel(),
    tools=[oa_charge, oa_note, step_as_function_tool(ship)],
)
oa_runner = SagaRunner(
    app,
    shop_oa,
    context_type=Deps,
    model_retry=FAST,
    tools={
        "charge": ToolPolicy(queue="payments", retry=FAST, idempotent=False, reconcile=find_charge),
        "note": ToolPolicy(retry=FAST),
    },
)


@app.saga(name="checkout_oa")
async def checkout_oa(ctx: SagaContext, order: dict[str, Any]) -> str:
    prompt = json.dumps({"run": ctx.run_id, **order})
    result = await oa_runner.run(shop_oa, prompt, context=Deps(run_id=ctx.run_id))
    return str(result.final_output)
