"""Steps as tools for a model loop written by hand (``sagaloop.agents.tools``), offline.

The "model" is a step that returns scripted tool calls in the providers' formats; the saga is a
plain ``while`` loop. The harness replays every activation, so each loop test also checks that
dispatching tool calls replays deterministically."""

from __future__ import annotations

import enum
import json
from collections import Counter
from datetime import timedelta
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from sagaloop import App, RetryPolicy, SagaContext, StepContext
from sagaloop.agents.tools import (
    TOOL_NAME,
    StepTool,
    StepTools,
    ToolCallError,
    ToolResult,
    _parse_call,
)
from sagaloop.engine import history as h
from sagaloop.errors import DeclarationError
from sagaloop.testing import Harness, replay


class Speed(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class Line(BaseModel):
    """A line of an order."""

    sku: str
    qty: int = 1


class Receipt(BaseModel):
    order: str
    cents: int


def order_app() -> tuple[App, Any]:
    app = App("tools")

    @app.step(name="place_order")
    def place_order(
        ctx: StepContext,
        customer: str,
        lines: list[Line],
        speed: Speed,
        wrap: Literal["none", "gift"],
        limit: int = 10,
        memo: str | None = None,
    ) -> Receipt:
        """Place an order for a customer.

        Longer notes that are not sent.

        Args:
            customer: The customer's id.
            lines: What to order,
                one line per product.
        """
        return Receipt(order=customer, cents=100 * limit)

    return app, place_order


STRICT_PARAMETERS = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "description": "The customer's id."},
        "lines": {
            "items": {"$ref": "#/$defs/Line"},
            "type": "array",
            "description": "What to order, one line per product.",
        },
        "speed": {"$ref": "#/$defs/Speed"},
        "wrap": {"enum": ["none", "gift"], "type": "string"},
        "limit": {
            "anyOf": [{"type": "integer"}, {"type": "null"}],
            "description": "Null for the default: 10.",
        },
        "memo": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["customer", "lines", "speed", "wrap", "limit", "memo"],
    "additionalProperties": False,
    "$defs": {
        "Line": {
            "description": "A line of an order.",
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
            "required": ["sku", "qty"],
            "type": "object",
            "additionalProperties": False,
        },
        "Speed": {"enum": ["fast", "slow"], "type": "string"},
    },
}


def test_the_schema_of_a_step_in_each_format() -> None:
    _, place_order = order_app()
    tools = StepTools(place_order)
    description = "Place an order for a customer."
    assert tools.openai() == [
        {
            "type": "function",
            "function": {
                "name": "place_order",
                "description": description,
                "parameters": STRICT_PARAMETERS,
                "strict": True,
            },
        }
    ]
    assert tools.openai_responses() == [
        {
            "type": "function",
            "name": "place_order",
            "description": description,
            "parameters": STRICT_PARAMETERS,
            "strict": True,
        }
    ]
    assert tools.anthropic() == [
        {"name": "place_order", "description": description, "input_schema": STRICT_PARAMETERS}
    ]
    # each call hands out a copy: a caller that edits it changes nothing
    tools.openai()[0]["function"]["parameters"]["properties"].clear()
    assert tools.parameters("place_order") == STRICT_PARAMETERS


def test_without_strict_defaults_stay_optional() -> None:
    _, place_order = order_app()
    [tool] = StepTools(place_order, strict=False).anthropic()
    schema = tool["input_schema"]
    assert schema["required"] == ["customer", "lines", "speed", "wrap"]
    assert schema["properties"]["limit"] == {"type": "integer", "default": 10}
    assert schema["properties"]["memo"] == {
        "anyOf": [{"type": "string"}, {"type": "null"}],
        "default": None,
    }
    assert schema["$defs"]["Line"]["required"] == ["sku"]
    assert "additionalProperties" not in schema["$defs"]["Line"]
    assert StepTools(place_order, strict=False).openai()[0]["function"]["strict"] is False


class Address(BaseModel):
    street: str
    zip: str | None = None


class Card(BaseModel):
    kind: Literal["card"]
    last4: str


class Transfer(BaseModel):
    kind: Literal["transfer"]
    iban: str


class Node(BaseModel):
    """A tree, to check recursive models."""

    label: str
    children: list[Node] = []


class Customer(BaseModel):
    name: str
    title: str  # a field named like a schema keyword stays
    address: Annotated[Address, Field(description="Where to ship.")]
    previous: list[Address] = []
    payment: Annotated[Card | Transfer, Field(discriminator="kind")]
    tree: Node | None = None


def check_strict(node: Any, where: str = "$") -> None:
    """OpenAI's strict mode, recursively: every object closed and fully required, no oneOf,
    no defaults, no titles, no $ref with siblings, no schema that allows any value."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            check_strict(item, f"{where}[{i}]")
        return
    if not isinstance(node, dict):
        return
    assert {"oneOf", "default", "title", "discriminator"}.isdisjoint(node), where
    assert "$ref" not in node or len(node) == 1, where
    assert {"type", "anyOf", "$ref", "enum", "const"} & set(node), where
    if node.get("type") == "object":
        assert node["additionalProperties"] is False, where
        assert node["required"] == list(node["properties"]), where
    for key, value in node.items():
        if key in ("properties", "$defs"):
            for name, sub in value.items():
                check_strict(sub, f"{where}.{key}.{name}")
        elif key in ("items", "anyOf", "allOf", "prefixItems"):
            check_strict(value, f"{where}.{key}")


def test_strict_rules_hold_in_nested_models() -> None:
    app = App("nested")

    @app.step
    def register(
        ctx: StepContext,
        customer: Customer,
        speed: Speed = Speed.SLOW,
        notes: Annotated[list[str], Field(description="Free notes.")] = [],  # noqa: B006
    ) -> None:
        """Register a customer.

        Args:
            speed: How soon.
        """

    schema = StepTools(register).parameters("register")
    check_strict(schema)
    assert set(schema["$defs"]) == {"Address", "Card", "Customer", "Node", "Speed", "Transfer"}
    customer = schema["$defs"]["Customer"]
    assert customer["properties"]["title"] == {"type": "string"}
    # a $ref with a description next to it is inlined (strict mode refuses the siblings)
    assert customer["properties"]["address"]["description"] == "Where to ship."
    assert customer["properties"]["address"]["required"] == ["street", "zip"]
    assert customer["properties"]["payment"] == {
        "anyOf": [{"$ref": "#/$defs/Card"}, {"$ref": "#/$defs/Transfer"}]
    }
    assert schema["properties"]["speed"] == {
        "anyOf": [{"$ref": "#/$defs/Speed"}, {"type": "null"}],
        "description": 'How soon. (null for the default: "slow")',
    }
    assert schema["properties"]["notes"]["description"] == "Free notes. (null for the default: [])"
    # and the arguments a strict model sends validate
    tools = StepTools(register)
    args = tools.validate(
        "register",
        {
            "customer": {
                "name": "Ann",
                "title": "Dr",
                "address": {"street": "Main St", "zip": None},
                "previous": [],
                "payment": {"kind": "transfer", "iban": "DE00"},
                "tree": {"label": "a", "children": [{"label": "b", "children": []}]},
            },
            "speed": None,
            "notes": None,
        },
    )
    assert set(args) == {"customer"}  # null means the default: the step's own
    assert isinstance(args["customer"].payment, Transfer)


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")
    a: int


def test_free_form_parameters_are_refused_in_strict_mode_only() -> None:
    app = App("free")

    @app.step
    def tag(ctx: StepContext, labels: dict[str, int]) -> None: ...

    @app.step
    def anything(ctx: StepContext, blob) -> None:  # type: ignore[no-untyped-def]
        ...

    @app.step
    def opened(ctx: StepContext, item: Open) -> None: ...

    with pytest.raises(DeclarationError, match=r"step 'tag', parameter 'labels' is a free-form"):
        StepTools(tag)
    with pytest.raises(DeclarationError, match=r"parameter 'blob' takes any value.*strict=False"):
        StepTools(anything)
    with pytest.raises(DeclarationError, match=r"parameter '\$defs.Open' is a free-form"):
        StepTools(opened)
    loose = StepTools(tag, anything, opened, strict=False)
    assert loose.parameters("tag")["properties"]["labels"]["additionalProperties"] == {
        "type": "integer"
    }


def test_tool_names_follow_the_providers_rule() -> None:
    app = App("names")

    @app.step(name="billing.refund")
    def refund(ctx: StepContext, order: str) -> str:
        return order

    @app.step(name="b" * 65)
    def long(ctx: StepContext) -> None: ...

    with pytest.raises(DeclarationError, match=r"StepTool\(refund, name='billing_refund'\)"):
        StepTools(refund)
    with pytest.raises(DeclarationError, match="1 to 64"):
        StepTools(long)
    tools = StepTools(StepTool(refund, name="refund", description="Give money back."))
    assert tools.names == ["refund"]
    assert tools.step("refund") is refund
    assert tools.openai()[0]["function"]["description"] == "Give money back."
    with pytest.raises(DeclarationError, match="two tools are named 'refund'"):
        StepTools(StepTool(refund, name="refund"), StepTool(refund, name="refund"))
    with pytest.raises(DeclarationError, match=r"declared with @app\.step"):
        StepTools(print)  # type: ignore[arg-type]
    assert TOOL_NAME.match("a-b_C9") and not TOOL_NAME.match("a.b")


def test_bad_calls_name_the_tool_and_the_fields() -> None:
    _, place_order = order_app()
    tools = StepTools(place_order)
    good = {"customer": "c", "lines": [{"sku": "x", "qty": 2}], "speed": "fast", "wrap": "gift"}
    args = tools.validate("place_order", json.dumps({**good, "limit": None, "memo": None}))
    assert args["lines"] == [Line(sku="x", qty=2)] and args["speed"] is Speed.FAST
    assert "limit" not in args and args["memo"] is None
    with pytest.raises(ToolCallError) as caught:
        tools.validate("place_order", {**good, "lines": [{"sku": "x", "qty": "many"}], "x": 1})
    assert caught.value.tool == "place_order"
    assert caught.value.fields == ("lines.0.qty", "x")
    assert str(caught.value) == (
        "tool 'place_order': argument 'lines.0.qty': Input should be a valid integer, unable "
        "to parse string as an integer (got 'many'); unexpected argument 'x'"
    )
    with pytest.raises(ToolCallError, match="missing argument 'customer'"):
        tools.validate("place_order", "")
    with pytest.raises(ToolCallError, match="not valid JSON"):
        tools.validate("place_order", '{"customer": ')
    with pytest.raises(ToolCallError, match="must be a JSON object, not list"):
        tools.validate("place_order", "[1]")
    with pytest.raises(ToolCallError, match="unknown tool 'nope'; the tools are: place_order"):
        tools.validate("nope", {})


def test_provider_tool_calls_and_results() -> None:
    openai = {"id": "c1", "type": "function", "function": {"name": "t", "arguments": "{}"}}
    responses = {"type": "function_call", "call_id": "c2", "name": "t", "arguments": "{}"}
    anthropic = {"type": "tool_use", "id": "c3", "name": "t", "input": {"a": 1}}
    assert _parse_call(openai) == ("openai", "c1", "t", "{}")
    assert _parse_call(responses) == ("openai_responses", "c2", "t", "{}")
    assert _parse_call(anthropic) == ("anthropic", "c3", "t", {"a": 1})
    assert _parse_call({"type": "text", "text": "hi"}) is None
    assert _parse_call({"type": "reasoning", "summary": []}) is None
    with pytest.raises(Exception, match="not a tool call"):
        _parse_call({"name": "t"})

    assert StepTools.openai_result("c1", {"a": 1}) == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": '{"a": 1}',
    }
    assert StepTools.openai_responses_result("c2", "plain text") == {
        "type": "function_call_output",
        "call_id": "c2",
        "output": "plain text",
    }
    assert StepTools.anthropic_result("c3", [1, 2]) == {
        "type": "tool_result",
        "tool_use_id": "c3",
        "content": "[1, 2]",
    }
    failed = ToolResult("c3", "t", error="bad", format="anthropic")
    assert failed.reply() == {
        "type": "tool_result",
        "tool_use_id": "c3",
        "content": '{"error": "bad"}',
        "is_error": True,
    }
    assert ToolResult("c1", "t", value=None).reply()["content"] == "null"


# --- a model loop written by hand, in a saga ---------------------------------------------------


def call(call_id: str, name: str, args: Any) -> dict[str, Any]:
    arguments = args if isinstance(args, str) else json.dumps(args)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class Script:
    """A chat model: at turn n it calls the tools ``turns[n]`` (OpenAI Chat Completions
    format), then answers with the contents of the tool messages it read last. Counts its
    requests and keeps what each request read, from outside the engine."""

    def __init__(self, *turns: list[dict[str, Any]]) -> None:
        self.turns = list(turns)
        self.requests = 0
        self.read: list[list[dict[str, Any]]] = []

    def __call__(self, messages: list[dict[str, Any]], tools: list[Any]) -> dict[str, Any]:
        assert [t["function"]["name"] for t in tools] == ["refund", "lookup"]
        self.requests += 1
        turn = sum(m["role"] == "assistant" for m in messages)
        tail: list[dict[str, Any]] = []
        for m in reversed(messages):
            if m["role"] != "tool":
                break
            tail.insert(0, m)
        self.read.append(tail)
        if turn < len(self.turns):
            return {"role": "assistant", "content": None, "tool_calls": self.turns[turn]}
        return {"role": "assistant", "content": json.dumps([m["content"] for m in tail])}


def loop_app(
    script: Script, *, step_failures: Literal["raise", "return"] = "raise"
) -> tuple[App, Counter[str], list[tuple[str, str, int]]]:
    app = App("loop")
    effects: Counter[str] = Counter()
    keys: list[tuple[str, str, int]] = []  # (order, idempotency key, attempt)

    @app.step(retry=RetryPolicy(max_attempts=2, initial_interval=timedelta(seconds=1)))
    def refund(ctx: StepContext, order: str, cents: int) -> Receipt:
        """Refund an order."""
        effects[f"refund {order} {cents}"] += 1
        keys.append((order, ctx.idempotency_key, ctx.attempt))
        if order == "flaky" and ctx.attempt == 1:
            raise ConnectionError("the provider timed out")
        if order == "broken":
            raise ValueError("no such order")
        return Receipt(order=order, cents=cents)

    @app.step
    def lookup(ctx: StepContext, order: str) -> int:
        """The amount paid for an order, in cents."""
        effects[f"lookup {order}"] += 1
        return 4200

    tools = StepTools(refund, lookup)

    @app.step(name="llm")
    def llm(ctx: StepContext, messages: list[dict[str, Any]]) -> dict[str, Any]:
        return script(messages, tools.openai())

    @app.saga(name="chat")
    async def chat(ctx: SagaContext, question: str) -> str:
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        while True:
            reply = await ctx.call(llm, messages)
            messages.append(reply)
            if not reply.get("tool_calls"):
                return str(reply["content"])
            results = await tools.dispatch(ctx, reply["tool_calls"], step_failures=step_failures)
            messages.extend(r.reply() for r in results)

    return app, effects, keys


def test_each_tool_runs_once_across_restarts_and_the_history_replays() -> None:
    script = Script(
        [call("a", "lookup", {"order": "o1"}), call("b", "refund", {"order": "o1", "cents": 5})],
        [call("c", "lookup", {"order": "o2"})],
    )
    app, effects, _ = loop_app(script)
    env = Harness(app)
    run_id = env.start("chat", "refund o1")
    for _ in range(4):  # the run starts, the model answers, the first tool runs
        env.step_once()
    assert effects == Counter({"lookup o1": 1}), "the restart comes between the two tools"
    env.restart()
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert json.loads(env.result(run_id)) == ["4200"]
    assert effects == Counter({"lookup o1": 1, "refund o1 5": 1, "lookup o2": 1})
    assert script.requests == 3
    # the model read both results of its first turn, in the order of its calls
    assert script.read[1] == [
        {"role": "tool", "tool_call_id": "a", "content": "4200"},
        {"role": "tool", "tool_call_id": "b", "content": '{"order": "o1", "cents": 5}'},
    ]
    steps = [e.name for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert steps == ["llm", "lookup", "refund", "llm", "lookup", "llm"]
    replay(app, env.history(run_id), run_id=run_id)  # the code takes the recorded path
    env.restart()
    env.run_until_idle()
    assert script.requests == 3 and sum(effects.values()) == 3


def test_idempotency_keys_come_from_the_run_never_from_the_tool_call_id() -> None:
    script = Script(
        [call("same", "refund", {"order": "o1", "cents": 5})],
        [call("same", "refund", {"order": "o1", "cents": 5})],
        [call("x", "refund", {"order": "flaky", "cents": 1})],
    )
    app, effects, keys = loop_app(script)
    env = Harness(app)
    run_id = env.start("chat", "go")
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert effects["refund o1 5"] == 2, "the model asked twice: two steps"
    (_, first, _), (_, second, _), (_, flaky1, a1), (_, flaky2, a2) = keys
    assert first != second, "the same tool_call_id gets a new key for a new call"
    assert "same" not in first + second
    assert (a1, a2) == (1, 2) and flaky1 == flaky2, "a retry of the same call keeps its key"
    timeline = {line.idempotency_key for line in env.status(run_id).steps}
    assert {first, second, flaky1} <= timeline, "the key is the run's (run id, position)"


def test_a_bad_call_reaches_the_model_as_an_error_without_running_the_step() -> None:
    script = Script(
        [
            call("a", "refund", {"order": "o1", "cents": "lots"}),
            call("b", "lookup", {"order": "o1"}),
            call("c", "unknown", "{}"),
            call("d", "refund", '{"order": '),
        ],
    )
    app, effects, _ = loop_app(script)
    env = Harness(app)
    run_id = env.start("chat", "go")
    env.run_until_idle()
    assert effects == Counter({"lookup o1": 1})
    errors = [json.loads(m["content"]) for m in script.read[1]]
    assert errors[0] == {
        "error": "tool 'refund': argument 'cents': Input should be a valid integer, unable to "
        "parse string as an integer (got 'lots')"
    }
    assert errors[1] == 4200
    assert errors[2] == {"error": "unknown tool 'unknown'; the tools are: refund, lookup"}
    assert "not valid JSON" in errors[3]["error"]
    assert [m["tool_call_id"] for m in script.read[1]] == ["a", "b", "c", "d"]
    assert env.get(run_id).status == "completed"


def test_a_step_that_fails_for_good_fails_the_run_or_reaches_the_model() -> None:
    turn = [
        call("a", "refund", {"order": "broken", "cents": 1}),
        call("b", "lookup", {"order": "o"}),
    ]
    app, effects, _ = loop_app(Script(turn))
    env = Harness(app)
    run_id = env.start("chat", "go")
    env.run_until_idle()
    assert env.get(run_id).status == "failed"
    assert "no such order" in (env.get(run_id).error or {})["message"]
    assert effects["lookup o"] == 1, "the other calls of the turn settled first"

    script = Script(turn)
    app, _, _ = loop_app(script, step_failures="return")
    env = Harness(app)
    run_id = env.start("chat", "go")
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    error = json.loads(script.read[1][0]["content"])["error"]
    assert error.startswith("the tool failed: ValueError: no such order")


def test_anthropic_blocks_an_approval_denied_and_call() -> None:
    """Anthropic's content blocks (text skipped), a step declared with approval=True whose
    denial reaches the model, and ``tools.call`` for one call made by the saga itself."""
    app = App("claude")
    sent: list[str] = []
    seen: list[Any] = []

    @app.step(approval=True)
    def send_mail(ctx: StepContext, to: str) -> str:
        """Send a mail."""
        sent.append(to)
        return "sent"

    tools = StepTools(send_mail)

    @app.step
    def llm(ctx: StepContext, messages: list[dict[str, Any]]) -> dict[str, Any]:
        seen.append(messages[-1]["content"])
        if len(messages) > 1:
            return {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}
        blocks = [
            {"type": "text", "text": "Let me send it."},
            {"type": "tool_use", "id": "toolu_1", "name": "send_mail", "input": {"to": "ann"}},
        ]
        return {"role": "assistant", "content": blocks}

    @app.saga(name="claude")
    async def claude(ctx: SagaContext) -> Any:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "mail ann"}]
        while True:
            reply = await ctx.call(llm, messages)
            messages.append(reply)
            uses = [b for b in reply["content"] if b["type"] == "tool_use"]
            if not uses:
                break
            results = await tools.dispatch(ctx, reply["content"])
            messages.append({"role": "user", "content": [r.reply() for r in results]})
        return await tools.call(ctx, "send_mail", '{"to": "bob"}')

    env = Harness(app)
    run_id = env.start(claude)
    env.run_until_idle()
    [pending] = env.approvals(run_id)
    assert (pending.action, pending.args) == ("send_mail", {"to": "ann"})
    env.deny(run_id, pending.call_id, reason="not today")
    env.run_until_idle()
    assert seen[1] == [
        {
            "type": "tool_result",
            "tool_use_id": "toolu_1",
            "content": '{"error": "the call was denied: not today"}',
            "is_error": True,
        }
    ]
    [pending] = env.approvals(run_id)
    env.approve(run_id, pending.call_id)
    env.run_until_idle()
    assert env.result(run_id) == "sent" and sent == ["bob"]


def test_a_bad_call_by_the_saga_itself_raises_with_the_tool_named() -> None:
    app, _, _ = loop_app(Script())
    tools = StepTools(app.steps["lookup"])

    @app.saga(name="direct")
    async def direct(ctx: SagaContext) -> Any:
        return await tools.call(ctx, "lookup", {"order": 5})

    env = Harness(app)
    run_id = env.start(direct)
    env.run_until_idle()
    error = env.get(run_id).error or {}
    assert env.get(run_id).status == "failed"
    assert error["type"] == "ToolCallError"
    assert "tool 'lookup': argument 'order'" in error["message"]
