"""Retry policy and rate limit: frozen values, kept with each step declaration."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sagaloop.errors import InvalidRateLimit


class RetryPolicy(BaseModel):
    """How a failed step attempt is retried.

    The delay before attempt ``n + 1`` is ``initial_interval * backoff_coefficient ** (n - 1)``,
    capped at ``maximum_interval``. ``non_retryable_errors`` lists exception type names (the
    class ``__name__`` or an :class:`~sagaloop.ApplicationError` ``type``) that fail the step for
    good at once. The defaults (5 attempts, 1 s doubling to 60 s) suit a remote call.
    ``max_attempts=None`` retries for ever, each wait capped at ``maximum_interval``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_attempts: int | None = Field(default=5, ge=1, le=10_000)
    give_up: Literal["fail", "park"] = "fail"
    """What a step that failed for good (its attempts spent, or a non-retryable error) does to
    its run: ``"fail"`` raises ``StepFailedError`` in the saga (uncaught, the run fails and
    compensates); ``"park"`` puts the run in ``needs_attention`` with nothing undone, and
    ``sagaloop retry RUN`` runs the step again once its cause is fixed. A step that raises
    ``ApplicationError(..., needs_attention=True)`` parks its run at once either way."""
    initial_interval: timedelta = timedelta(seconds=1)
    backoff_coefficient: float = Field(default=2.0, ge=1.0, le=100.0)
    maximum_interval: timedelta = timedelta(seconds=60)
    non_retryable_errors: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _check_intervals(self) -> RetryPolicy:
        if self.initial_interval < timedelta(0):
            raise ValueError("initial_interval must not be negative")
        if self.maximum_interval < self.initial_interval:
            raise ValueError("maximum_interval must be at least initial_interval")
        return self

    def delay(self, failed_attempt: int) -> timedelta:
        """The wait after attempt number ``failed_attempt`` (1-based) failed."""
        exponent = min(failed_attempt - 1, 1000)  # unlimited attempts: never overflow
        try:
            seconds = self.initial_interval.total_seconds() * self.backoff_coefficient**exponent
            return min(timedelta(seconds=seconds), self.maximum_interval)
        except OverflowError:
            return self.maximum_interval

    def is_retryable(self, error_type: str) -> bool:
        return error_type not in self.non_retryable_errors

    def allows(self, failed_attempt: int) -> bool:
        """Whether another attempt may follow attempt number ``failed_attempt``."""
        return self.max_attempts is None or failed_attempt < self.max_attempts


NO_RETRY = RetryPolicy(max_attempts=1)


_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*([A-Za-z]+)\s*$")
_UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0}
_UNITS |= {"h": 3600.0, "hour": 3600.0}
RATE_FORMS = "'N/s', 'N/m' or 'N/h' (N starts per second, minute or hour; N > 0, e.g. '10/s')"
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$")


class RateLimit(BaseModel):
    """How often attempts of a step may start, across every worker process of the database:
    one start every ``interval`` seconds at most, spread evenly (no burst). Steps with the same
    ``key`` share one quota. Built by ``@app.step(rate_limit=..., rate_key=...)``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rate: str
    """As declared: ``"10/s"``, ``"600/m"``..."""
    key: str
    """The quota's name in the database: ``rate_key``, or ``{app}/{step}`` by default."""
    per_second: float = Field(gt=0)

    @property
    def interval(self) -> float:
        """Seconds between two starts."""
        return 1.0 / self.per_second

    @classmethod
    def parse(cls, rate: str, *, key: str, what: str) -> RateLimit:
        """``rate`` (``"10/s"``) for the quota ``key``; :class:`InvalidRateLimit` naming
        ``what`` (``"step 'x'"``) and the accepted forms when ``rate`` is not valid."""
        found = _RATE.match(rate) if isinstance(rate, str) else None
        per = _UNITS.get(found.group(2).lower()) if found else None
        count = float(found.group(1)) if found else 0.0
        if found is None or per is None or not 0 < count < 1e9:
            raise InvalidRateLimit(f"{what}: rate_limit {rate!r} is not valid: use {RATE_FORMS}")
        return cls(rate=rate.strip(), key=key, per_second=count / per)


def check_rate_key(key: str, what: str) -> str:
    """A ``rate_key`` as given: letters, digits and ``_.:-`` (never ``/``, which the default
    keys, ``{app}/{step}``, hold: the two never collide)."""
    if not isinstance(key, str) or not _KEY.match(key):
        raise InvalidRateLimit(
            f"{what}: rate_key {key!r} is not valid: use letters, digits and '_.:-', "
            "at most 200 characters"
        )
    return key
