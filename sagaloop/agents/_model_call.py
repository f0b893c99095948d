"""A model request as a step, the part both framework adapters share: the step's declaration
(:class:`ModelStepOptions`), the saga side of one request (the budget checked, only the
transcript's new messages recorded, the usage counted, the response's tool calls gated as one
batch) and the worker side's relay of a streamed response. No agent framework is imported."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

from sagaloop.agents import transcript
from sagaloop.agents._core import check_batch, check_budget, publish_usage, usage_of
from sagaloop.agents.budgets import Budget
from sagaloop.agents.providers import MODEL_DEADLINE, MODEL_RETRY, guarded
from sagaloop.sagas.app import App, StepDef
from sagaloop.sagas.context import SagaContext, StepContext
from sagaloop.sagas.policy import RetryPolicy


@dataclasses.dataclass(frozen=True)
class ModelStepOptions:
    """How an agent's model requests run as the step ``{prefix}__model_request``: ``retry``
    (else :data:`~sagaloop.agents.providers.MODEL_RETRY`, within
    :data:`~sagaloop.agents.providers.MODEL_DEADLINE`), ``timeout`` per attempt, the rate
    limit of its starts (shared with the steps of the same ``rate_key``), on ``queue`` or
    in-process (``local``)."""

    queue: str = "model"
    retry: RetryPolicy | None = None
    timeout: timedelta | None = timedelta(minutes=10)
    rate_limit: str | None = None
    rate_key: str | None = None
    local: bool = False

    def declare(
        self, app: App, prefix: str, request: Callable[[StepContext, dict[str, Any]], Any]
    ) -> StepDef[Any, Any]:
        """Register ``request`` (the worker side, guarded against provider errors) as the
        model step of the agent whose steps are named ``{prefix}__...``."""
        step: StepDef[Any, Any] = app.step(
            name=f"{prefix}__model_request",
            queue=self.queue,
            retry=self.retry or MODEL_RETRY,
            timeout=self.timeout,
            schedule_to_close=None if self.retry else MODEL_DEADLINE,
            rate_limit=self.rate_limit,
            rate_key=self.rate_key,
            local=self.local,
        )(guarded(request))
        return step


@dataclasses.dataclass(kw_only=True)
class AgentRun:
    """The saga side of one agent run, whatever the framework (an adapter adds its own
    fields)."""

    saga: SagaContext
    conversation: str
    budget: Budget | None
    encoder: transcript.Encoder
    requests: int = 0
    refusal: str | None = None
    """The answer to each tool call of the last response, when the budget refused its batch
    (``on_exceed="tell_model"``); None: the calls run."""


def whole_response(reply: dict[str, Any]) -> list[tuple[list[Any], Any]]:
    """A reply's response as the one message of the next request it may come back as."""
    return [(["response"], reply.get("response"))]


async def request_model(
    run: AgentRun,
    step: StepDef[Any, Any],
    messages: Sequence[Any],
    request: Callable[[], dict[str, Any]],
    answers: Callable[[dict[str, Any]], list[tuple[list[Any], Any]]] = whole_response,
) -> dict[str, Any]:
    """One model request of ``run`` through ``step``, once the budget allows it: the step's
    argument is ``{"transcript": <what is new in messages>, **request()}``, the entries of
    ``request()`` equal to what an earlier request recorded left out (``"same"``); returns its
    recorded reply (``{"response", "cost"}``), whose values ``answers`` names are what the
    next request refers to instead of recording them again. Follow it with
    :func:`count_response`. The step's worker reads the request back with
    :meth:`transcript.Decoder.messages` and :meth:`transcript.Decoder.extras`."""
    run.budget = await check_budget(run.saga, run.budget, run.conversation)
    delta = run.encoder.delta(messages)
    delta.update(conversation=run.conversation, n=run.requests)
    extra, same = run.encoder.same(run.requests, request())
    if same:
        delta["same"] = same
    reply: dict[str, Any] = await run.saga.call(step, {"transcript": delta, **extra})
    run.encoder.sent(run.requests, messages)
    run.encoder.answered(run.requests, answers(reply))
    run.requests += 1
    return reply


class TokenUsage(Protocol):
    """A response's usage as both frameworks report it."""

    @property
    def input_tokens(self) -> int: ...

    @property
    def output_tokens(self) -> int: ...


async def count_response(
    run: AgentRun, reply: dict[str, Any], usage: TokenUsage, tool_calls: int
) -> None:
    """Count a response's ``usage`` (and its recorded cost) for the saga run, and show it; then
    gate its ``tool_calls`` as one batch, before any of them runs (sets ``run.refusal`` when
    the budget refuses it)."""
    used = usage_of(run.saga).usage
    used.requests += 1
    used.input_tokens += usage.input_tokens
    used.output_tokens += usage.output_tokens
    used.cost += float(reply.get("cost") or 0.0)
    publish_usage(run.saga, run.budget)
    run.budget, run.refusal = await check_batch(run.saga, run.budget, tool_calls, run.conversation)


def finish_run(run: AgentRun) -> None:
    """At the end of an agent run of a run tree: its usage, which the parent reads."""
    if usage_of(run.saga).allowance is not None:
        publish_usage(run.saga, run.budget)


def relay(ctx: StepContext, agent: str | None, text: str | None, event: Callable[[], Any]) -> None:
    """One event of a model's streamed response, on the worker: ``text`` (what it adds to the
    answer) and ``event()`` (the event as JSON) to the run's live channel (``Client.stream``,
    ``sagaloop tail``). The heartbeat first: it raises ``StepCancelled`` when the run ends,
    which closes the stream, so nothing reads, or pays for, the rest."""
    ctx.heartbeat()
    ctx.stream({"agent": agent, "text": text, "event": event()})
