"""A tool-calling loop's transcript, stored once: :class:`Conversation`.

A loop that gives its model step the whole message list, ``ctx.call(chat, messages)``, records
that list with every request, so its history grows with the square of its length (about 10 KB
per turn over 50 turns of examples/raw_openai_loop, 94% of it re-sent messages). With a
:class:`Conversation` each request records only the messages that are new since the previous
one (:mod:`sagaloop.agents.transcript`; 1.2 KB per turn of that example, whatever its length),
and the model step rebuilds the full list::

    @app.step(queue="model")
    async def chat(ctx: StepContext, request: dict[str, Any]) -> dict[str, Any]:
        messages = Conversation.messages(ctx, request)  # the full list
        ...  # call the model with messages, request["model"], ...


    @app.saga(name="support")
    async def support(ctx: SagaContext, question: str) -> str:
        conversation = Conversation(ctx)
        messages = [{"role": "user", "content": question}]
        while True:
            reply = await ctx.call(chat, conversation.request(messages, model="gpt-5-mini"))
            ...  # append the reply and the tool results to messages, as before

The step rebuilds the list from the last request its process decoded, or, after a restart or on
another worker, from the run's history (the requests its ``STEP_SCHEDULED`` events hold).
"""

from __future__ import annotations

import copy
import json
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from sagaloop.agents import transcript
from sagaloop.errors import ValidationError
from sagaloop.sagas.context import SagaContext, StepContext
from sagaloop.sagas.convert import encode_value

__all__ = ["Conversation"]

JSON = Any

_decoder = transcript.Decoder()
"""The worker side, shared by every conversation of this process (bounded: see Decoder)."""


class Conversation:
    """The saga side of one conversation with a model: the argument of each model request.

    Make one per loop, in saga code: ``Conversation(ctx)`` (its id comes from ``ctx.uuid4()``,
    so a replay makes the same). :meth:`request` turns the message list into the model step's
    argument; the step gets the full list back with :meth:`messages`.

    A request records the messages from the first one that differs (``!=``) from what the
    previous request recorded at its place: plain dicts built again between turns are not
    recorded again, and a message changed in place after it was sent is. The list may shrink
    or be edited (a summary in place of old turns): the request records from the first
    changed message on.
    """

    def __init__(self, ctx: SagaContext) -> None:
        self.id = f"{ctx.run_id}/{ctx.uuid4()}"
        """The conversation's id: unique in its run, the same on every replay."""
        self._encoder = transcript.Encoder(_encode, same=operator.eq)
        self._requests = 0

    def __repr__(self) -> str:
        return f"Conversation({self.id!r}, requests={self._requests})"

    def request(self, messages: Sequence[JSON], **extra: JSON) -> dict[str, JSON]:
        """The model step's argument for a request of ``messages`` (JSON values: dicts as the
        provider's API takes them): ``{"transcript": <the messages new since the previous
        request>, **extra}``. ``extra`` carries the rest of the request (``model=``,
        ``tools=``, ...), recorded as given.

        Give it to the step as an argument of its own, ``ctx.call(chat,
        conversation.request(...))`` (any parameter name), not inside another value: that is
        where the step looks for it in the history. Each request refers to the previous one, so
        give every request you make to ``ctx.call``, right away. A call that failed still
        counts: retrying it with a new request works. A message that is not JSON raises
        ``ValidationError`` here."""
        if "transcript" in extra:
            raise ValidationError(
                "Conversation.request(messages, transcript=...): the key 'transcript' holds the "
                "messages; give that value another name"
            )
        delta = self._encoder.delta(messages)
        delta.update(conversation=self.id, n=self._requests)
        self._encoder.sent_as_recorded(self._requests, delta)
        self._requests += 1
        return {"transcript": delta, **extra}

    @staticmethod
    def messages(ctx: StepContext, request: Mapping[str, JSON]) -> list[JSON]:
        """In the model step: the full message list of ``request`` (made by :meth:`request`),
        as a copy the step may change.

        From this process's cache when it decoded the previous request of the conversation
        (or this same request: a retried attempt); else, after a restart or on another worker,
        from the run's history, read once (the cache then holds it). ``ValidationError`` if
        ``request`` is not such a request; ``TranscriptError`` if the history does not hold
        the requests it refers to."""
        delta = request.get("transcript") if isinstance(request, Mapping) else None
        if not isinstance(delta, dict) or "conversation" not in delta:
            raise ValidationError(
                "Conversation.messages takes the request that conversation.request(messages) "
                "made in saga code, given to this step as an argument of its own: "
                f"ctx.call(step, conversation.request(messages)); got {_kind(request)}"
            )
        full = _decoder.messages(ctx.run_id, delta, step=None, history=ctx.history)
        return copy.deepcopy(full)


def _encode(messages: Sequence[JSON]) -> list[JSON]:
    """The new messages of a request, as a copy in JSON (what the next request is compared
    with, whatever the caller changes); else ``UnencodableError`` saying why."""
    copied: list[JSON] = json.loads(encode_value(list(messages), what="a conversation's message"))
    return copied


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a dict with the keys {sorted(map(str, value))}"
    return f"a {type(value).__name__}"
