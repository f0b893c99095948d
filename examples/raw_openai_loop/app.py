"""A support loop written with the raw ``openai`` client, made durable with ``StepTools``.

No agent framework: the saga ``support`` is the ``while`` loop many teams write by hand. Each
model request is the step ``chat``, which calls ``chat.completions.create(..., stream=True)``,
forwards the text as it arrives to the run's live channel (``sagaloop tail RUN``) and returns
the assembled assistant message with its usage: recorded once, so a restart or a replay never
asks the model again for a reply the history holds. The saga gives ``chat`` its messages through
a ``Conversation``: each request records the messages that are new since the previous one, and
``chat`` rebuilds the full list, so the history grows with the loop's length, not its square.
The model's tool calls are the steps
``lookup_order``, ``issue_refund`` and ``mail_customer``, offered with ``StepTools`` and run by
``tools.dispatch`` under each step's own policy, with the idempotency key of the run and the
call's position (never the model's ``tool_call_id``).

``issue_refund`` is not idempotent (the shop makes a refund asked twice twice, see ``shop.py``):
an attempt cut off by a crash is in doubt, and its ``reconcile`` looks the refund up by the
step's key instead of refunding again.

Run it with ``sagaloop dev --app examples.raw_openai_loop.app`` from the repository root, and
``sagaloop start support --app examples.raw_openai_loop.app --input '"Order o-17 arrived
broken"'``. Environment, read when a step runs: ``OPENAI_API_KEY``, ``OPENAI_BASE_URL`` (an
OpenAI-compatible server; default, OpenAI's), ``RAW_LOOP_MODEL`` (default ``gpt-5-mini``),
``RAW_LOOP_DATA`` (the folder of the shop's ``shop.db``; default, the current folder).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterable, Callable
from datetime import timedelta
from typing import Any, cast

import openai
from openai.types.chat import (
    ChatCompletionChunk,
    ChatCompletionMessageParam,
    ChatCompletionToolUnionParam,
)
from pydantic import BaseModel

from examples.raw_openai_loop.shop import Order, Reason, Refund, Shop
from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext
from sagaloop.agents import USAGE_KEY, Usage
from sagaloop.agents.tools import Conversation, StepTools

app = App("shop-support")

MAX_TURNS = 12
"""Model requests per run; past it the run fails (the loop is not answering)."""
DEFAULT_MODEL = "gpt-5-mini"
INSTRUCTIONS = """\
You are the support desk of a small shop. Look the order up before anything else. Refund an
order that arrived damaged or never arrived, at most what was paid; then mail the customer what
you did, and answer with a one-line summary."""

TOOLS_RETRY = RetryPolicy(max_attempts=5, initial_interval=timedelta(milliseconds=200))
MODEL_RETRY = RetryPolicy(
    max_attempts=5,
    initial_interval=timedelta(seconds=1),
    # the request itself is wrong: asking again cannot help
    non_retryable_errors=(
        "BadRequestError",
        "AuthenticationError",
        "PermissionDeniedError",
        "NotFoundError",
        "UnprocessableEntityError",
        "NotConfigured",
    ),
)


# --- tools: the model calls them, each is a step ---------------------------------------------


@app.step(queue="tools", retry=TOOLS_RETRY)
def lookup_order(ctx: StepContext, order_id: str) -> Order | None:
    """The order: its customer, item and amount paid in cents; null if there is none.

    Args:
        order_id: The order's id, such as o-17.
    """
    return Shop().order(order_id)


@app.step(queue="payments", retry=TOOLS_RETRY, timeout=timedelta(seconds=30), idempotent=False)
def issue_refund(ctx: StepContext, order_id: str, cents: int, reason: Reason) -> Refund:
    """Refund part or all of an order, at most what was paid.

    Args:
        order_id: The order's id.
        cents: The amount to refund, in cents.
        reason: Why the customer is refunded.
    """
    return Shop().refund(order_id, cents, reason, reference=ctx.idempotency_key)


@issue_refund.reconcile
def find_refund(ctx: StepContext, order_id: str, cents: int, reason: Reason) -> Refund | None:
    """Did an attempt cut off by a crash refund? Look the refund up by the step's key."""
    return Shop().find_refund(ctx.idempotency_key)


@app.step(queue="tools", retry=TOOLS_RETRY)
def mail_customer(ctx: StepContext, order_id: str, text: str) -> str:
    """Mail the customer of an order; returns the mail's id.

    Args:
        order_id: The order's id.
        text: The mail, a few sentences.
    """
    return Shop().send_mail(order_id, text, reference=ctx.idempotency_key)


tools = StepTools(lookup_order, issue_refund, mail_customer)


# --- the model ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """Where the model is: read from the environment when a model step runs."""

    api_key: str
    base_url: str | None
    model: str

    @classmethod
    def from_env(cls) -> ModelSettings:
        api_key = os.environ.get("OPENAI_API_KEY")
        if not api_key:
            raise ApplicationError(
                "set OPENAI_API_KEY (any text for a local OpenAI-compatible server)",
                type="NotConfigured",
                non_retryable=True,
            )
        return cls(
            api_key=api_key,
            base_url=os.environ.get("OPENAI_BASE_URL") or None,
            model=os.environ.get("RAW_LOOP_MODEL") or DEFAULT_MODEL,
        )


class TokenUsage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ChatReply(BaseModel):
    """What the step ``chat`` records: the assistant message as the API takes it back in
    ``messages`` (``role``, ``content``, ``tool_calls``), and the request's usage (None if
    the stream ended without it)."""

    message: dict[str, Any]
    usage: TokenUsage | None = None


@app.step(queue="model", retry=MODEL_RETRY, timeout=timedelta(minutes=3))
async def chat(ctx: StepContext, request: dict[str, Any]) -> ChatReply:
    """One model request, streamed: the text goes live to the run's readers as it arrives; the
    assembled reply is recorded once, and a replay or a restart never asks for it again.
    ``request`` is what ``Conversation.request`` made: the messages new since the previous
    request; the full list is rebuilt here."""
    messages = Conversation.messages(ctx, request)
    settings = ModelSettings.from_env()
    # Retries are the step's (MODEL_RETRY, shown in `sagaloop status`), not the client's.
    async with openai.AsyncOpenAI(
        api_key=settings.api_key, base_url=settings.base_url, max_retries=0, timeout=120
    ) as client:
        stream = await client.chat.completions.create(
            model=settings.model,
            # plain dicts, as the SDK's TypedDicts describe them
            messages=cast("list[ChatCompletionMessageParam]", messages),
            tools=cast("list[ChatCompletionToolUnionParam]", tools.openai()),
            stream=True,
            stream_options={"include_usage": True},
        )
        async with stream:
            return await assemble(stream, on_text=lambda text: ctx.stream({"text": text}))


async def assemble(
    chunks: AsyncIterable[ChatCompletionChunk], *, on_text: Callable[[str], None]
) -> ChatReply:
    """The reply of a streamed Chat Completions request: the text deltas joined (each given to
    ``on_text`` as it comes), the tool calls put together from their pieces (by index: the
    first piece has the id and the name, the next ones more of the arguments), the usage from
    the last chunk."""
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage: TokenUsage | None = None
    async for chunk in chunks:
        if chunk.usage is not None:
            usage = TokenUsage(
                prompt_tokens=chunk.usage.prompt_tokens,
                completion_tokens=chunk.usage.completion_tokens,
            )
        for choice in chunk.choices[:1]:
            delta = choice.delta
            if delta.content:
                text.append(delta.content)
                on_text(delta.content)
            for piece in delta.tool_calls or ():
                call = calls.setdefault(
                    piece.index,
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if piece.id:
                    call["id"] = piece.id
                if piece.function is not None:
                    call["function"]["name"] += piece.function.name or ""
                    call["function"]["arguments"] += piece.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return ChatReply(message=message, usage=usage)


# --- the loop ----------------------------------------------------------------------------------


@app.saga(name="support")
async def support(ctx: SagaContext, question: str) -> str:
    """Answer a customer: ask the model, run the tools it calls, until it answers in text."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": question},
    ]
    conversation = Conversation(ctx)  # each request records only what is new
    usage = Usage()
    for _ in range(MAX_TURNS):
        reply = await ctx.call(chat, conversation.request(messages))
        usage.requests += 1
        if reply.usage is not None:
            usage.input_tokens += reply.usage.prompt_tokens
            usage.output_tokens += reply.usage.completion_tokens
        ctx.publish(USAGE_KEY, usage.model_dump())  # `sagaloop status` shows it
        messages.append(reply.message)
        calls = reply.message.get("tool_calls")
        if not calls:
            return str(reply.message.get("content") or "")
        # Bad calls (unknown tool, arguments that do not fit) come back as error results.
        results = await tools.dispatch(ctx, calls)
        usage.tool_calls += len(results)
        messages.extend(r.reply() for r in results)
    raise ApplicationError(
        f"no answer after {MAX_TURNS} model requests", type="TooManyTurns", non_retryable=True
    )
