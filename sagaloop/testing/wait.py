"""Waiting for an outcome in tests that drive real processes: poll, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(
    check: Callable[[], T],
    timeout: float = 30.0,
    what: str = "condition",
    *,
    interval: float = 0.05,
) -> T:
    """Call ``check`` until it returns something truthy and return that; raise AssertionError
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
