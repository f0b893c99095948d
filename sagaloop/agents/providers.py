"""What a model provider's failure means for the run: the failure classes of a model request.

- **Transient** (the provider is down or busy: connection errors, timeouts, 408, 409, 425, 429,
  5xx, "overloaded"): the request is asked again, with the step's capped backoff, at least as
  late as the provider's ``Retry-After``, for as long as the step's deadline allows.
  :data:`MODEL_RETRY` and :data:`MODEL_DEADLINE` are the adapters' defaults: retry for six
  hours, each wait at most five minutes, then park the run.
- **A person must fix it** (401, 403, an unknown model, a missing key, a request the provider
  will never accept, a bug): the run parks in ``needs_attention`` at once, nothing undone;
  ``sagaloop retry RUN`` asks the same request again once the cause is fixed.

Both adapters run their model requests under :func:`provider_call`; a hand-written model step
(a raw ``openai`` loop with ``StepTools``) can too::

    @app.step(retry=MODEL_RETRY, schedule_to_close=MODEL_DEADLINE)
    def chat(ctx: StepContext, messages: list[dict[str, Any]]) -> dict[str, Any]:
        with provider_call():
            return client.chat.completions.create(model="gpt-5", messages=messages).to_dict()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

from sagaloop.errors import ApplicationError, StepCancelled
from sagaloop.sagas.policy import RetryPolicy

F = TypeVar("F", bound=Callable[..., Any])

MODEL_RETRY = RetryPolicy(
    max_attempts=None,
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(minutes=5),
    give_up="park",
)
"""The model request's retry policy by default: for ever (within :data:`MODEL_DEADLINE`), each
wait doubling from 1 s to at most 5 minutes; a request that still fails then parks its run."""
MODEL_DEADLINE = timedelta(hours=6)
"""How long a model request is retried by default (its ``schedule_to_close``)."""

TRANSIENT_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529})
_TRANSIENT_TYPES = frozenset(
    {
        # pydantic_ai
        "ModelConnectionError",
        "ModelTimeoutError",
        "ModelRequestTimeout",
        "ModelOverloadedError",
        "ModelRateLimitError",
        "ModelServerError",
        "ModelUnavailableError",
        # openai, anthropic
        "APIConnectionError",
        "APITimeoutError",
        "RateLimitError",
        "InternalServerError",
        "OverloadedError",
        # httpx, the standard library
        "ConnectError",
        "ConnectTimeout",
        "ReadTimeout",
        "WriteTimeout",
        "PoolTimeout",
        "ReadError",
        "WriteError",
        "RemoteProtocolError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionRefusedError",
        "TimeoutError",
    }
)


def failure_class(exc: BaseException) -> str:
    """``"transient"`` or ``"attention"`` (a person must fix it) for a provider's error."""
    if isinstance(exc, BaseExceptionGroup):  # a FallbackModel's: every provider failed
        kinds = {failure_class(e) for e in exc.exceptions}
        return "transient" if kinds == {"transient"} else "attention"
    status = _status(exc)
    if status is not None:
        return "transient" if status in TRANSIENT_STATUS or status >= 500 else "attention"
    for e in _chain(exc):
        if type(e).__name__ in _TRANSIENT_TYPES:
            return "transient"
    return "attention"


def retry_after(exc: BaseException) -> float | None:
    """The seconds the provider asked to wait (``Retry-After``, ``retry-after-ms``), if any."""
    for e in _chain(exc):
        value = getattr(e, "retry_after", None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        headers = getattr(e, "headers", None) or getattr(
            getattr(e, "response", None), "headers", None
        )
        if headers is None:
            continue
        try:
            ms = headers.get("retry-after-ms")
            if ms is not None:
                return float(ms) / 1000
            text = headers.get("retry-after")
            if text is None:
                continue
            try:
                return float(text)
            except ValueError:
                when = parsedate_to_datetime(text)
                return max((when - datetime.now(UTC)).total_seconds(), 0.0)
        except (TypeError, ValueError, AttributeError):
            continue
    return None


def translate(exc: BaseException) -> ApplicationError:
    """The step failure that ``exc`` (raised by a model request) stands for."""
    what = f"{type(exc).__name__}: {str(exc)[:500]}"
    status = _status(exc)
    said = f"provider {status}" if status is not None else "the model request"
    if failure_class(exc) == "transient":
        return ApplicationError(
            f"{said} failed, to be asked again: {what}",
            type="ModelProviderUnavailable",
            retry_after=retry_after(exc),
        )
    return ApplicationError(
        f"{said} failed and needs a person (a key, the model's name, the request, or a bug): "
        f"{what}",
        type="ModelRequestRefused",
        needs_attention=True,
    )


@contextlib.contextmanager
def provider_call() -> Iterator[None]:
    """Run a model request: its failure leaves as the failure class it belongs to."""
    try:
        yield
    except (ApplicationError, StepCancelled, asyncio.CancelledError):
        raise  # already a decision, or sagaloop stopping the attempt
    except Exception as e:
        raise translate(e) from e


def guarded(fn: F) -> F:
    """``fn`` (a model request step's body, sync or async) under :func:`provider_call`."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            with provider_call():
                return await fn(*args, **kwargs)

        return run_async  # type: ignore[return-value]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with provider_call():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


def _status(exc: BaseException) -> int | None:
    for e in _chain(exc):
        status = getattr(e, "status_code", None)
        if isinstance(status, int) and not isinstance(status, bool):
            return status
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes, outermost first (at most 10)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 10:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
