"""What the CLI prints for an operator (issue 26): one numbering of positions in ``status``,
``tail`` and ``fork --at``; values cut at a value's edge with a visible marker; ``tail`` reading
an agent's model requests as the console's transcript reads them; and a non-determinism that
says what to do."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_env import cli_database, run
from pydantic_ai import Agent, models
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from sagaloop import App, SagaContext, StepContext
from sagaloop.agents.pydantic_ai import SagaAgent
from sagaloop.cli import render
from sagaloop.cli.demo import _Demo
from sagaloop.client.values import clip_json
from sagaloop.testing import Harness

models.ALLOW_MODEL_REQUESTS = False

APP = """
from datetime import timedelta

from sagaloop import App, SagaContext, StepContext

app = App("numbers")


@app.step
def charge(ctx: StepContext, cents: int) -> dict:
    return {"cents": cents, "note": "x" * 300}


@app.saga(name="pay")
async def pay(ctx: SagaContext, cents: int) -> int:
    await ctx.call(charge, cents)                                    # 0
    await ctx.wait_for_event("go", timeout=timedelta(days=1))        # 1
    await ctx.sleep(timedelta(seconds=1))                            # 2
    await ctx.call(charge, cents + 1)                                # 3
    ctx.publish("progress", {"charged": cents, "log": ["abcdefghij"] * 60})  # 4
    await ctx.approval("refund", {"cents": 5}, reason="lost")        # 5 (asked), 6 (its wait)
    await ctx.call(charge, cents + 2)
    return cents
"""


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    db = cli_database(tmp_path, monkeypatch, "numbers_cli", APP)
    import numbers_cli

    env = Harness(numbers_cli.app, url=f"sqlite:///{db}")
    env.start("pay", 250, run_id="r1")
    env.run_until_idle(skip_time=False)
    env.send_event("r1", "go", None)
    env.run_until_idle()
    yield env
    env.close()


def _table(text: str) -> list[list[str]]:
    """The rows of ``status``'s table (plain: not a terminal), split on runs of spaces."""
    lines = text.split("\n\n")[1].splitlines()
    assert lines[0].split()[:3] == ["#", "command", "state"], lines[0]
    return [re.split(r"\s{2,}", line) for line in lines[2:]]


def test_status_tail_and_fork_number_the_commands_the_same_way(env: Harness) -> None:
    status = run("status", "r1")
    assert status.exit_code == 0, status.output
    rows = _table(status.output)
    assert [int(r[0]) for r in rows] == list(range(7)), "every position, none skipped"
    assert [r[1] for r in rows] == [
        "charge",
        "wait_for_event 'go'",
        "sleep",
        "charge",
        "publish 'progress'",
        "approval 'refund'",
        "wait_for_event 'approval:5'",
    ]
    assert rows[3][-1] == "r1/3/do", "the idempotency key holds the same position"
    assert "approvals asked:\n  5: refund" in status.output, "the call id is its position"
    commands = json.loads(run("status", "r1", "--json").output)["commands"]
    assert [(c["position"], c["command"], c["state"]) for c in commands][:4] == [
        (0, "call", "completed"),
        (1, "wait_for_event", "ended"),
        (2, "sleep", "ended"),
        (3, "call", "completed"),
    ]

    tail = run("tail", "r1", "--no-follow").output.splitlines()
    assert tail[0] == 'run_started pay {"input": 250}', "no command: no position"
    assert "#3 call charge(cents=251)" in tail
    assert any(line.startswith("#3 charge -> ") for line in tail)
    assert "#2 timer_fired" in tail
    numbered = {int(m.group(1)) for line in tail if (m := re.match(r"#(\d+) ", line))}
    assert numbered == set(range(7))

    forked = run("fork", "r1", "--from", "3", "--app", "numbers_cli", "--run-id", "f1")
    assert forked.exit_code == 0, forked.output
    kept = json.loads(run("status", "f1", "--json").output)["commands"]
    assert [(c["position"], c["name"]) for c in kept] == [(0, "charge"), (1, "go"), (2, "")]


def test_an_open_wait_and_sleep_are_said_to_be_open(env: Harness) -> None:
    env.start("pay", 1, run_id="r2")
    env.run_until_idle(skip_time=False)
    assert [r[:3] for r in _table(run("status", "r2").output)] == [
        ["0", "charge", "completed"],
        ["1", "wait_for_event 'go'", "waiting"],
    ]
    env.send_event("r2", "go", None)
    env.run_until_idle(skip_time=False)
    assert [r[:3] for r in _table(run("status", "r2").output)][1:] == [
        ["1", "wait_for_event 'go'", "ended"],
        ["2", "sleep", "sleeping"],
    ]


def test_values_are_cut_at_a_value_s_edge_with_a_marker(env: Harness) -> None:
    text = run("status", "r1").output
    published = text.split("published:\n", 1)[1].split("\n\n")[0].splitlines()
    assert published[:3] == ["  progress = {", '      "charged": 250,', '      "log": [']
    assert published[3:-3] == ['        "abcdefghij",'] * len(published[3:-3])
    assert published[-3:-1] == ["        …", "      ]"], "whole items, the rest one marker"
    assert re.fullmatch(r"    \} … \(\+\d+ chars\)", published[-1]), published[-1]
    whole = json.dumps({"charged": 250, "log": ["abcdefghij"] * 60}, ensure_ascii=False)
    shown = "".join(x.strip() for x in published).removeprefix("progress = ")
    shown = shown.rpartition(" … (+")[0].replace(",", ", ")  # the compact form's
    assert len(whole) - len(shown) == int(published[-1].split("(+")[1].split()[0])

    tail = run("tail", "r1", "--no-follow").output
    [result] = [x for x in tail.splitlines() if x.startswith("#0 charge -> ")]
    assert re.search(r'"note": "x+…"\} … \(\+\d+ chars\)$', result), result
    assert "..." not in tail


@pytest.mark.parametrize(
    ("value", "limit", "expected"),
    [
        ({"a": 1}, 200, '{"a": 1}'),
        (list(range(100)), 40, "[0, 1, 2, 3, 4, 5, 6, …] … (+366 chars)"),
        ({"a": "y" * 50, "b": 2}, 50, '{"a": "yyyyyyyyyyyyyyyyyyyyy…", …} … (+33 chars)'),
        ({"a": "y" * 50, "b": 2}, 30, '{"a": …, …} … (+56 chars)'),
        ("\x1b" * 50, 40, '"\\u001b\\u001b\\u001b…" … (+281 chars)'),
        ({"deep": {"er": [1, 2, 3] * 20}}, 50, '{"deep": {"er": [1, 2, 3, 1, …]}} … (+165 chars)'),
    ],
)
def test_clip_json_keeps_whole_tokens(value: Any, limit: int, expected: str) -> None:
    """Whole numbers, keys and escapes; a string cut inside its quotes; within the limit."""
    assert clip_json(value, limit) == expected
    assert len(expected) <= limit


def test_clip_json_pretty_prints_the_same_cut() -> None:
    text = clip_json({"log": ["abcdefghij"] * 60}, 60, indent=2)
    assert text.startswith('{\n  "log": [\n    "abcdefghij",\n')
    assert text.endswith("    …\n  ]\n} … (+" + text.rpartition("(+")[2])


def _answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    if len(messages) == 1:
        return ModelResponse(
            parts=[TextPart("I will refund it."), ToolCallPart("refund", {"cents": 1250})]
        )
    return ModelResponse(parts=[TextPart("Refunded 12.50.")])


def _agent_run(url: str, padding: str = "") -> Harness:
    """A harness on ``url`` holding the completed run ``a1`` of an agent named ``refunds``
    that calls the tool ``refund`` once (close it); the tool's result ends with ``padding``."""
    app = App("agentic")
    agent = Agent(FunctionModel(_answer), name="refunds", instructions="Be kind.")

    @agent.tool_plain
    def refund(cents: int) -> str:
        return f"refunded {cents}{padding}"

    saga_agent = SagaAgent(agent, app=app)

    @app.saga(name="ask")
    async def ask(ctx: SagaContext, prompt: str) -> str:
        return str((await saga_agent.run(prompt)).output)

    env = Harness(app, url=url)
    env.start("ask", "Where is my refund?", run_id="a1")
    env.run_until_idle()
    assert env.get("a1").status == "completed"
    return env


def test_tail_reads_an_agent_s_model_requests(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    _agent_run(url).close()
    out = run("--database-url", url, "tail", "a1", "--no-follow").output.splitlines()
    model = "agent__refunds__model_request"
    assert f"#0 model request {model}: system: Be kind. | user: Where is my refund?" in out
    answer = 'assistant: I will refund it. | tool call refund({"cents": 1250})'
    assert f"#0 model answer {model}: {answer}" in out
    assert "#2 call agent__refunds__tool__refund(cents=1250)" in out, "the tool's arguments"
    assert '#2 agent__refunds__tool__refund -> {"value": "refunded 1250"}' in out
    assert f"#3 model request {model}: tool result refund: refunded 1250" in out, (
        "what the request sends anew: not the answer above again, nor the instructions"
    )
    assert f"#3 model answer {model}: assistant: Refunded 12.50." in out
    assert not any('"part_kind"' in line for line in out), "no raw framework JSON"


def test_tail_shows_a_long_tool_result_the_next_request_names_by_digest(tmp_path: Path) -> None:
    """A tool's long result is stored once (its step's result): the request that gives it to
    the model names it, and tail shows it there as the tool result."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    _agent_run(url, padding=" " + "x" * 300).close()
    out = run("--database-url", url, "tail", "a1", "--no-follow").output.splitlines()
    sent = [line for line in out if line.startswith("#3 model request")]
    # the whole result, cut for the line as any value is
    assert sent and "tool result refund: refunded 1250 … (+301 chars)" in sent[0], out


def test_without_the_console_s_parser_a_model_request_reads_as_a_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    _agent_run(url).close()
    monkeypatch.setattr(render, "_requests_of", lambda: None)  # the ui extra missing
    out = run("--database-url", url, "tail", "a1", "--no-follow").output.splitlines()
    assert out[1].startswith("#0 call agent__refunds__model_request(request={"), out[1]
    assert re.search(r"… \(\+\d+ chars\)\)$", out[1]), "cut, its parenthesis closed"
    assert out[2].startswith('#0 agent__refunds__model_request -> {"response": {"parts": [')


def test_the_demo_names_a_step_as_status_does(tmp_path: Path) -> None:
    """The demo's timeline shows the step's one name (as status, tail, export and the console
    show it), numbered by position."""
    env = _agent_run(f"sqlite:///{tmp_path / 'd.db'}")
    shown: list[str] = []
    demo = _Demo.__new__(_Demo)  # its processes are not needed to print a timeline
    demo.client = env.client
    demo._line = shown.append  # type: ignore[method-assign]
    try:
        demo._print_changes("a1", env.status("a1"), {})
    finally:
        env.close()
    assert shown[0].startswith("#0  agent__refunds__model_request completed  -> refund: "), shown
    assert shown[1].startswith("#2  agent__refunds__tool__refund completed"), shown
    assert not any(re.search(r"(?<!__)model_request", line) for line in shown), shown


def _version(new_order: bool) -> App:
    app = App("versions")  # the same name: the same queues and runs

    @app.step
    def a(ctx: StepContext) -> str:
        return "A"

    @app.step
    def b(ctx: StepContext) -> str:
        return "B"

    @app.saga(name="two")
    async def two(ctx: SagaContext) -> list[str]:
        if new_order:
            return [await ctx.call(b), await ctx.call(a), await ctx.wait_for_event("go")]
        first = await ctx.call(a)
        await ctx.wait_for_event("go")
        return [first, await ctx.call(b)]

    return app


def test_a_non_determinism_says_what_changed_and_what_to_do(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'v.db'}"
    old = Harness(_version(new_order=False), url=url)
    old.start("two", run_id="v1")
    old.run_until_idle(skip_time=False)
    old.close()
    new = Harness(_version(new_order=True), url=url, clock=old.clock)
    try:
        new.send_event("v1", "go")
        new.run_until_idle()
        reason = new.get("v1").reason or ""
    finally:
        new.close()
    assert reason.startswith(
        "run 'v1': non-deterministic saga code: the history has call('a') at position 0, "
        "the code now issues call('b') at position 0; to fix: "
    ), reason
    assert "ctx.patched('change-id')" in reason and "docs/concepts/versioning.md" in reason
    assert reason.endswith("then `sagaloop retry v1` resumes a parked run where it was")
    shown = run("--database-url", url, "status", "v1").output
    assert "sagaloop retry v1" in shown
