"""The raw ``openai`` client loop of examples/raw_openai_loop in the in-process harness, against
the OpenAI-compatible server of tests/unit/openai_server.py on 127.0.0.1 (no network): the real
client streams each model reply, the loop dispatches the tool calls with ``StepTools``.

Effects are counted outside the engine: the requests the server received, and the shop's SQLite
file (refunds, mails). The process test, SIGKILLs of ``sagaloop dev`` included, is
tests/chaos/test_raw_openai_loop_dev.py.

The loop's transcript is stored once with ``Conversation``: tested with the example (bytes of
history per turn, the history path) and with a small app of its own (retries, misuse)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest

from examples.raw_openai_loop import app as loop
from examples.raw_openai_loop.shop import Shop
from sagaloop import App, RetryPolicy, SagaContext, StepContext, StepFailedError, ValidationError
from sagaloop.agents import USAGE_KEY, conversation, transcript
from sagaloop.agents.tools import Conversation
from sagaloop.engine import history as h
from sagaloop.testing import Harness, replay
from tests.unit.openai_server import OpenAIServer, Reply, call, reply

MODEL = "scripted-model"
API_KEY = "test-key"
TOOLS = ["lookup_order", "issue_refund", "mail_customer"]
REFUND = {"order_id": "o-17", "cents": 4200, "reason": "damaged"}
MAIL = {"order_id": "o-17", "text": "We refunded 42.00 for your headphones."}
SCRIPT = [
    reply(
        "Let me look the order up.",
        tool_calls=[call("call_a", "lookup_order", {"order_id": "o-17"})],
    ),
    reply(
        tool_calls=[call("call_b", "issue_refund", REFUND), call("call_c", "mail_customer", MAIL)]
    ),
    reply("Refunded 42.00 for order o-17 and mailed Ann."),
]


@pytest.fixture
def shop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Shop:
    monkeypatch.setenv("RAW_LOOP_DATA", str(tmp_path))
    monkeypatch.setenv("RAW_LOOP_MODEL", MODEL)
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    return Shop()


@pytest.fixture
def env(shop: Shop) -> Iterator[Harness]:
    harness = Harness(loop.app)
    yield harness
    harness.close()


def serve(monkeypatch: pytest.MonkeyPatch, script: list[Reply]) -> OpenAIServer:
    """A server for ``script`` (``with`` it to start it), where the example's model step
    looks for it."""
    server = OpenAIServer(script)
    monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
    return server


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[OpenAIServer]:
    with serve(monkeypatch, SCRIPT) as s:
        yield s


def tool_replies(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool messages a model request ends with: what the model read of its last calls."""
    tail: list[dict[str, Any]] = []
    for m in reversed(request["messages"]):
        if m["role"] != "tool":
            break
        tail.insert(0, m)
    return tail


def test_the_server_answers_plain_and_streamed_like_openai(server: OpenAIServer) -> None:
    """The test server itself, through the real client: a streamed reply (tool calls in pieces,
    usage last) assembles into the message a plain request returns."""
    first: list[Any] = [{"role": "user", "content": "o-17 arrived broken"}]
    second: list[Any] = [*first, {"role": "assistant", "content": "x"}]

    async def ask() -> tuple[Any, ...]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY) as client:
            plain = await client.chat.completions.create(model=MODEL, messages=second)
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=second,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assembled = await loop.assemble(_aiter(chunks), on_text=lambda _: None)
            no_usage = await client.chat.completions.create(
                model=MODEL, messages=first, stream=True
            )
            return plain, chunks, assembled, [c async for c in no_usage]

    plain, chunks, assembled, no_usage = asyncio.run(ask())
    message = plain.choices[0].message.model_dump(exclude_none=True)
    assert assembled.message == {**message, "content": None}
    assert [c["function"]["name"] for c in message["tool_calls"]] == [
        "issue_refund",
        "mail_customer",
    ]
    pieces = Counter(
        p.index for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or ()
    )
    assert pieces[0] > 2 and pieces[1] > 2, "each call's arguments come in several chunks"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert assembled.usage is not None
    assert assembled.usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(c.usage is None for c in no_usage), "usage only when asked for"
    assert (
        "".join(c.choices[0].delta.content or "" for c in no_usage) == "Let me look the order up."
    )
    assert [r["turn"] for r in server.requests] == [1, 1, 0]


def test_the_loop_runs_with_the_real_client_streams_and_counts_usage(
    env: Harness, server: OpenAIServer, shop: Shop
) -> None:
    run_id = env.start(loop.support, "My order o-17 arrived broken.")
    live = env.streams.subscribe(run_id)
    env.run_until_idle()
    assert env.result(run_id) == "Refunded 42.00 for order o-17 and mailed Ann."

    # each model request once, as the client sends it: streamed, usage asked, the tools offered
    assert server.turns() == Counter({0: 1, 1: 1, 2: 1})
    for request in server.requests:
        assert request["model"] == MODEL and request["authorization"] == f"Bearer {API_KEY}"
        assert request["stream"] and request["stream_options"] == {"include_usage": True}
        assert request["tools"] == TOOLS
    # the tools ran once each and the model read their results, in the order of its calls
    [refund] = shop.refunds()
    assert refund[1:] == (f"{run_id}/5/do", "o-17", 4200, "damaged")
    [mail] = shop.mails()
    assert mail[0] == f"{run_id}/6/do" and mail[3] == MAIL["text"]
    lookup, refunded, mailed = [
        *tool_replies(server.requests[1]),
        *tool_replies(server.requests[2]),
    ]
    assert lookup["tool_call_id"] == "call_a"
    assert json.loads(lookup["content"])["customer"] == "ann@example.com"
    assert json.loads(refunded["content"]) == {
        "refunded": True,
        "refund_id": refund[0],
        "order_id": "o-17",
        "cents": 4200,
        "detail": "",
    }
    assert (refunded["tool_call_id"], mailed["tool_call_id"]) == ("call_b", "call_c")
    assert mailed["content"] == mail[1]

    # the text reached the run's live channel as it came, from the model step
    items = live.get(0.1)
    assert {i["step"] for i in items} == {"chat"}
    assert "".join(i["data"]["text"] for i in items) == (
        "Let me look the order up.Refunded 42.00 for order o-17 and mailed Ann."
    )
    assert len(items) > 2, "word by word, not at the end"

    # usage: what the server answered with, recorded with each reply and published by the saga
    usage = env.client.get_published(run_id, USAGE_KEY)
    assert usage == {
        "requests": 3,
        "input_tokens": sum(r["usage"]["prompt_tokens"] for r in server.requests),
        "output_tokens": sum(r["usage"]["completion_tokens"] for r in server.requests),
        "tool_calls": 3,
        "cost": 0.0,
    }
    completed = [e for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert [e.name for e in completed] == [
        "chat",
        "lookup_order",
        "chat",
        "issue_refund",
        "mail_customer",
        "chat",
    ]
    first, sent = completed[0].data["result"], server.requests[0]["usage"]
    assert first["usage"] == {k: sent[k] for k in ("prompt_tokens", "completion_tokens")}
    assert first["message"]["content"] == "Let me look the order up."

    # a restart replays the loop from the history: nothing is asked or done again
    replay(loop.app, env.history(run_id), run_id=run_id)
    env.restart()
    env.run_until_idle()
    assert sum(server.turns().values()) == 3 and len(shop.refunds()) == 1


def test_a_bad_tool_call_goes_back_to_the_model_and_the_loop_goes_on(
    env: Harness, monkeypatch: pytest.MonkeyPatch, shop: Shop
) -> None:
    bad = [
        call("call_1", "cancel_order", {"order_id": "o-17"}),
        call("call_2", "issue_refund", {**REFUND, "cents": "all of it"}),
        call("call_3", "issue_refund", '{"order_id": "o-17", '),
        call("call_4", "lookup_order", {"order_id": "o-17", "verbose": True}),
        call("call_5", "issue_refund", {**REFUND, "reason": "changed my mind"}),
    ]
    with serve(
        monkeypatch, [reply(tool_calls=bad), reply("Sorry, I could not do that.")]
    ) as server:
        run_id = env.start(loop.support, "Cancel o-17 and refund it all.")
        env.run_until_idle()
        assert env.result(run_id) == "Sorry, I could not do that."
        read = tool_replies(server.requests[1])
    assert [m["tool_call_id"] for m in read] == [c["id"] for c in bad]
    errors = [json.loads(m["content"])["error"] for m in read]
    assert errors[0] == "unknown tool 'cancel_order'; the tools are: " + ", ".join(TOOLS)
    assert errors[1].startswith("tool 'issue_refund': argument 'cents': Input should be a valid")
    assert "not valid JSON" in errors[2]
    assert errors[3] == "tool 'lookup_order': unexpected argument 'verbose'"
    assert errors[4].startswith("tool 'issue_refund': argument 'reason': Input should be")
    assert shop.refunds() == [], "no bad call ran its step"
    assert [line.step for line in env.status(run_id).steps] == ["chat", "chat"]


def test_keys_come_from_the_run_and_the_position_never_from_the_tool_call_id(
    env: Harness, monkeypatch: pytest.MonkeyPatch, shop: Shop
) -> None:
    """The model reuses the id ``call_1`` across turns and runs: every call still acts, each
    under its own key, ``{run_id}/{position}/do``."""
    script = [
        reply(tool_calls=[call("call_1", "issue_refund", {**REFUND, "cents": 1000})]),
        reply(tool_calls=[call("call_1", "issue_refund", {**REFUND, "cents": 500})]),
        reply("Refunded twice."),
    ]
    with serve(monkeypatch, script) as server:
        runs = [env.start(loop.support, "refund o-17 in two parts") for _ in range(2)]
        env.run_until_idle()
        assert [env.result(r) for r in runs] == ["Refunded twice."] * 2
        assert server.turns() == Counter({0: 2, 1: 2, 2: 2})
    refunds = shop.refunds()
    assert sorted(r[3] for r in refunds) == [500, 500, 1000, 1000], "every call acted"
    keys = [r[1] for r in refunds]
    assert sorted(keys) == sorted(f"{r}/{pos}/do" for r in runs for pos in (2, 5))
    assert not any("call_1" in k for k in keys)


def test_a_refund_whose_answer_was_lost_is_reconciled_not_made_again(
    env: Harness, server: OpenAIServer, shop: Shop
) -> None:
    made: list[str] = []

    def refund_then_lose_the_answer(ctx: Any, order_id: str, cents: int, reason: Any) -> Any:
        Shop().refund(order_id, cents, reason, reference=ctx.idempotency_key)
        made.append(ctx.idempotency_key)
        raise ConnectionError("connection reset after the refund was made")

    with env.override(loop.issue_refund, refund_then_lose_the_answer):
        run_id = env.start(loop.support, "My order o-17 arrived broken.")
        env.run_until_idle()
    assert env.result(run_id).startswith("Refunded 42.00")
    [refund] = shop.refunds()
    assert made == [refund[1]], "the in-doubt attempt was answered by the reconcile"
    line = next(x for x in env.status(run_id).steps if x.step == "issue_refund")
    assert (line.state, line.attempts) == ("reconciled", 2)
    assert sum(server.turns().values()) == 3


def test_a_loop_that_never_answers_stops_at_max_turns(
    env: Harness, monkeypatch: pytest.MonkeyPatch, shop: Shop
) -> None:
    lookup = call("call_x", "lookup_order", {"order_id": "o-18"})
    with serve(monkeypatch, [reply(tool_calls=[lookup])] * (loop.MAX_TURNS + 5)) as server:
        run_id = env.start(loop.support, "keep looking")
        env.run_until_idle()
        assert sum(server.turns().values()) == loop.MAX_TURNS
    run = env.get(run_id)
    assert run.status == "failed"
    assert run.error is not None and run.error["type"] == "TooManyTurns"


# --- the transcript, stored once ----------------------------------------------------------------

OLD_BYTES_PER_TURN = 6_690
"""Bytes of history per turn over the 30 turns of ``test_the_history_grows_by_what_is_new...``
when ``chat`` was given the whole message list (measured before ``Conversation``: 3.1 KB per
turn over 10 turns, 10.4 KB over 50)."""


def lookups(turns: int) -> list[Reply]:
    """A script of ``turns`` order look-ups, then an answer."""
    order = {"order_id": "o-17"}
    script = [
        reply(f"Turn {i}: looking o-17 up.", tool_calls=[call(f"call_{i}", "lookup_order", order)])
        for i in range(turns)
    ]
    return [*script, reply("Done.")]


def history_bytes(events: list[h.Event]) -> int:
    return sum(len(json.dumps(e.data)) for e in events)


def expected_transcript(server: OpenAIServer) -> None:
    """Each request the server received holds the previous one's messages, then the reply and
    the tool results it led to: the full list, rebuilt by the step."""
    requests = server.requests
    assert [len(r["messages"]) for r in requests] == [2 + 2 * k for k in range(len(requests))]
    for before, after in itertools.pairwise(requests):
        assert after["messages"][: len(before["messages"])] == before["messages"]
        assert after["messages"][-2]["role"] == "assistant"
        assert after["messages"][-1]["role"] == "tool"


def test_the_history_grows_by_what_is_new_not_by_the_transcript(
    env: Harness, monkeypatch: pytest.MonkeyPatch, shop: Shop
) -> None:
    """30 turns of the example: each ``chat`` request records the messages new since the
    previous one (the reply, the tool result), so each turn adds the same bytes of history."""
    turns = 30
    monkeypatch.setattr(loop, "MAX_TURNS", turns + 1)
    with serve(monkeypatch, lookups(turns)) as server:
        run_id = env.start(loop.support, "Order o-17 arrived broken.")
        env.run_until_idle()
        assert env.result(run_id) == "Done."
    expected_transcript(server)
    events = env.history(run_id)
    chats = [e for e in events if e.kind == h.STEP_SCHEDULED and e.name == "chat"]
    deltas = [e.data["args"]["request"]["transcript"] for e in chats]
    assert [len(d["append"]) for d in deltas] == [2] + [2] * turns
    assert [d["keep"] for d in deltas] == [2 * k for k in range(turns + 1)]

    per_turn = history_bytes(events) / turns
    assert per_turn < 1_500, per_turn  # 1.2 KB measured
    assert per_turn * 4 < OLD_BYTES_PER_TURN
    # flat: each turn's events (from a chat request to the next) weigh about the same
    starts = [events.index(e) for e in chats]
    sizes = [history_bytes(events[a:b]) for a, b in itertools.pairwise(starts[1:])]
    assert max(sizes) < 1.1 * min(sizes), sizes


def test_a_worker_without_the_cache_rebuilds_the_transcript_from_the_history(
    env: Harness, monkeypatch: pytest.MonkeyPatch, shop: Shop
) -> None:
    """Every ``chat`` runs as on a new worker (the process's cache cleared): the step reads the
    run's history, and the model gets the same full lists."""
    reads = count_history_reads(monkeypatch)

    def chat_on_a_new_worker(ctx: StepContext, request: dict[str, Any]) -> Any:
        conversation._decoder._last.clear()
        return loop.chat.fn(ctx, request)

    with (
        serve(monkeypatch, lookups(4)) as server,
        env.override(loop.chat, chat_on_a_new_worker),
    ):
        run_id = env.start(loop.support, "Order o-17 arrived broken.")
        env.run_until_idle()
        assert env.result(run_id) == "Done."
    expected_transcript(server)
    assert len(server.requests) == 5 and reads == [0, 1, 2, 3]  # each from the previous one


def count_history_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each time a step rebuilds a transcript from the run's history: the number of the
    request it looks up there (the one its request refers to)."""
    reads: list[int] = []
    real = transcript._from_history

    def counted(events: list[h.Event], step: str | None, conv: Any, target: int) -> list[Any]:
        reads.append(target)
        return real(events, step, conv, target)

    monkeypatch.setattr(transcript, "_from_history", counted)
    return reads


class Echo:
    """A small app whose model step answers with the number of messages it was sent, and fails
    where told: ``fail[(request, attempt)]`` is ``"before"`` or ``"after"`` rebuilding the
    list. ``seen`` holds what each attempt rebuilt. With ``new_worker`` each attempt runs as
    on a new worker (the process's cache cleared)."""

    def __init__(self, fail: dict[tuple[int, int], str], *, new_worker: bool = False) -> None:
        self.fail = fail
        self.seen: list[tuple[int, int, list[Any]]] = []
        self.app = App("conversation-echo")
        retry = RetryPolicy(max_attempts=2, initial_interval=timedelta(milliseconds=10))

        @self.app.step(queue="model", retry=retry)
        def echo(ctx: StepContext, req: dict[str, Any]) -> dict[str, Any]:
            """The parameter is not named ``request``: any name works."""
            n = req["transcript"]["n"]
            if self.fail.get((n, ctx.attempt)) == "before":
                raise ConnectionError("the model is down")
            if new_worker:
                conversation._decoder._last.clear()
            messages = Conversation.messages(ctx, req)
            self.seen.append((n, ctx.attempt, json.loads(json.dumps(messages))))
            messages[0]["content"] = "changed by the step"  # its own copy: no harm done
            messages.append({"role": "user", "content": "added by the step"})
            if self.fail.get((n, ctx.attempt)) == "after":
                raise ConnectionError("the answer was lost")
            return {"role": "assistant", "content": f"{len(messages) - 1} messages"}

        @self.app.saga(name="echo-loop")
        async def loop_(ctx: SagaContext, turns: int) -> list[Any]:
            conv = Conversation(ctx)
            messages: list[Any] = [{"role": "user", "content": "hi"}]
            for _ in range(turns):
                try:
                    answer = await ctx.call(echo, conv.request(messages, model="m"))
                except StepFailedError:  # the loop asks again, with a new request
                    answer = await ctx.call(echo, conv.request(messages, model="m"))
                messages = [dict(m) for m in [*messages, answer]]  # rebuilt: equal, not same
            return messages

        self.echo, self.saga = echo, loop_

    @staticmethod
    def expected(turns: int) -> list[Any]:
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        for _ in range(turns):
            messages.append({"role": "assistant", "content": f"{len(messages)} messages"})
        return messages

    def run(self, turns: int) -> list[Any]:
        env = Harness(self.app)
        try:
            run_id = env.start(self.saga, turns)
            env.run_until_idle()
            result: list[Any] = env.result(run_id)
            chats = [e for e in env.history(run_id) if e.kind == h.STEP_SCHEDULED]
            self.deltas = [e.data["args"]["req"]["transcript"] for e in chats]
            return result
        finally:
            env.close()


def test_a_retried_request_decodes_from_the_cache_or_the_history(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Request 1 fails once after rebuilding its list (the step's retry finds it in the
    cache); request 2 fails for good, its first attempt before rebuilding, and the loop asks
    again with request 3, which refers to request 2: from the history, once."""
    reads = count_history_reads(monkeypatch)
    echo = Echo({(1, 1): "after", (2, 1): "before", (2, 2): "after"})
    assert echo.run(4) == Echo.expected(4)
    assert [(n, attempt) for n, attempt, _ in echo.seen] == [
        (0, 1),
        (1, 1),
        (1, 2),
        (2, 2),
        (3, 1),
        (4, 1),
    ]
    for n, _, messages in echo.seen:
        turn = n if n < 3 else n - 1  # request 3 asked again for turn 2
        assert messages == Echo.expected(turn), n
    assert reads == [], "request 2's attempt 2 came after request 1: from the cache"
    # plain dicts rebuilt between turns are not recorded again
    assert [len(d["append"]) for d in echo.deltas] == [1, 1, 1, 0, 1]


def test_a_retried_request_decodes_from_the_history_on_a_new_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same failures, each attempt on a new worker: request 3 refers to request 2, which
    failed for good; the history holds it all the same."""
    reads = count_history_reads(monkeypatch)
    echo = Echo({(1, 1): "after", (2, 1): "after", (2, 2): "before"}, new_worker=True)
    assert echo.run(4) == Echo.expected(4)
    assert [(n, attempt) for n, attempt, _ in echo.seen] == [
        (0, 1),
        (1, 1),
        (1, 2),
        (2, 1),
        (3, 1),
        (4, 1),
    ]
    assert [messages for _, _, messages in echo.seen] == [
        Echo.expected(t) for t in (0, 1, 1, 2, 2, 3)
    ]
    assert reads == [0, 0, 1, 2, 3]


def test_a_request_not_given_as_an_argument_of_its_own_is_refused_with_the_fix() -> None:
    app = App("conversation-misuse")
    errors: list[Exception] = []

    @app.step(queue="model", retry=RetryPolicy(max_attempts=1))
    def nested(ctx: StepContext, options: dict[str, Any]) -> int:
        conversation._decoder._last.clear()  # a new worker: the history is searched
        try:
            return len(Conversation.messages(ctx, options["request"]))
        except transcript.TranscriptError as e:
            errors.append(e)
            return -1

    @app.step(queue="model", retry=RetryPolicy(max_attempts=1))
    def plain(ctx: StepContext, messages: list[Any]) -> int:
        try:
            return len(Conversation.messages(ctx, messages))  # type: ignore[arg-type]
        except ValidationError as e:
            errors.append(e)
            return -1

    @app.saga(name="misuse")
    async def misuse(ctx: SagaContext) -> list[int]:
        conv = Conversation(ctx)
        messages = [{"role": "user", "content": "hi"}]
        sizes = [await ctx.call(nested, {"request": conv.request(messages)})]
        messages.append({"role": "assistant", "content": "hello"})
        sizes.append(await ctx.call(nested, {"request": conv.request(messages)}))
        sizes.append(await ctx.call(plain, messages))
        with pytest.raises(ValidationError, match="not JSON"):
            conv.request([{"content": float("nan")}])
        with pytest.raises(ValidationError, match="JSON"):
            conv.request([{"content": object()}])
        with pytest.raises(ValidationError, match="give that value another name"):
            conv.request(messages, transcript="x")
        return sizes

    env = Harness(app)
    try:
        run_id = env.start(misuse)
        env.run_until_idle()
        assert env.result(run_id) == [1, -1, -1]
    finally:
        env.close()
    nested_error, plain_error = (str(e) for e in errors)
    assert nested_error.startswith("no request 0 of ")
    assert nested_error.endswith(
        "in the run's history: a request must be an argument of the step itself "
        "(ctx.call(step, request)), not inside another value"
    )
    assert plain_error == (
        "Conversation.messages takes the request that conversation.request(messages) made in "
        "saga code, given to this step as an argument of its own: "
        "ctx.call(step, conversation.request(messages)); got a list"
    )


async def _aiter(items: list[Any]) -> Any:
    for item in items:
        yield item
