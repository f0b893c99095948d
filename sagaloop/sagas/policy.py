"""Retry policy: a frozen value, stored with each step declaration."""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
