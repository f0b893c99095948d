"""A recorded model response as the stream events the OpenAI Agents SDK's streamed run reads
(``Runner.run_streamed`` in saga code: :class:`~sagaloop.agents.openai_agents.model.StepModel`).
Saga code never calls the model: it replays what the model step recorded, the same events on
every replay; the live tokens went to the run's channel from the worker
(``SagaRunner(stream=True)``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

from agents.items import ModelResponse, TResponseStreamEvent
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseTextDeltaEvent,
    ResponseUsage,
)
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails


def replayed_events(response: ModelResponse) -> Iterator[TResponseStreamEvent]:
    """Each output item added, its text (one delta per text part), the item done, then
    ``response.completed`` with the whole response and its usage."""
    seq = 0

    def event(value: Any) -> TResponseStreamEvent:
        nonlocal seq
        seq += 1
        return cast(TResponseStreamEvent, value)

    output = list(response.output)
    for index, item in enumerate(output):
        yield event(
            ResponseOutputItemAddedEvent(
                type="response.output_item.added",
                item=item,
                output_index=index,
                sequence_number=seq,
            )
        )
        if getattr(item, "type", None) == "message":
            for part_index, part in enumerate(getattr(item, "content", ()) or ()):
                if getattr(part, "type", None) == "output_text":
                    yield event(
                        ResponseTextDeltaEvent(
                            type="response.output_text.delta",
                            item_id=str(getattr(item, "id", "") or ""),
                            output_index=index,
                            content_index=part_index,
                            delta=part.text,
                            logprobs=[],
                            sequence_number=seq,
                        )
                    )
        yield event(
            ResponseOutputItemDoneEvent(
                type="response.output_item.done", item=item, output_index=index, sequence_number=seq
            )
        )
    usage = response.usage
    details = usage.input_tokens_details
    completed = Response(
        id=response.response_id or "",
        created_at=0,
        model="",
        object="response",
        output=output,
        tool_choice="auto",
        tools=[],
        parallel_tool_calls=False,
        status="completed",
        usage=ResponseUsage(
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            total_tokens=usage.total_tokens,
            input_tokens_details=InputTokensDetails.model_validate(
                {"cached_tokens": details.cached_tokens or 0, "cache_write_tokens": 0}
            ),
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=usage.output_tokens_details.reasoning_tokens or 0
            ),
        ),
    )
    if response.response_id is None:  # the SDK's Model boundary allows none; Response does not
        object.__setattr__(completed, "id", None)
    yield event(
        ResponseCompletedEvent(type="response.completed", response=completed, sequence_number=seq)
    )
