"""The activation deadline counts the CPU time of the saga code: a busy loop is interrupted, a
thread that is merely not running (the process stopped, the machine loaded) is not, and code
stuck in one C call is reported as stalled."""

from __future__ import annotations

import threading
import time

import pytest

from sagaloop.engine import watchdog as w
from sagaloop.errors import ActivationDeadlineError


def test_a_busy_loop_is_interrupted_with_its_stack() -> None:
    dog = w.Watchdog(0.2)
    began = time.monotonic()
    with pytest.raises(ActivationDeadlineError) as caught, dog.guard("a loop"):
        n = 0
        while True:
            n += 1
    assert time.monotonic() - began < 5
    assert "a loop" in str(caught.value) and "test_watchdog.py" in caught.value.stack


def test_a_busy_loop_that_swallows_exceptions_is_still_reported() -> None:
    dog = w.Watchdog(0.2)
    with pytest.raises(ActivationDeadlineError), dog.guard("a stubborn loop"):
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                while True:
                    pass
            except Exception:
                pass  # user code's except Exception does not catch the interruption


def test_time_off_the_cpu_does_not_count() -> None:
    """A stopped process or a starved thread spends wall time, not CPU time: not a deadline."""
    dog = w.Watchdog(0.2)
    with dog.guard("a sleeper"):
        time.sleep(0.6)


def test_code_stuck_in_a_c_call_is_reported_stalled() -> None:
    dog = w.Watchdog(0.2)
    dog.stall_after = 0.2
    inside, release = threading.Event(), threading.Event()

    def stuck() -> None:
        with dog.guard("a stuck saga"):
            inside.set()
            release.wait(10)  # one C call, no CPU

    thread = threading.Thread(target=stuck)
    thread.start()
    try:
        inside.wait(5)
        time.sleep(0.4)
        [report] = dog.stalled()
        assert "a stuck saga" in report and "release.wait" in report
    finally:
        release.set()
        thread.join(5)
    assert dog.stalled() == []


def test_quick_code_is_never_interrupted() -> None:
    dog = w.Watchdog(0.05)
    for _ in range(2000):
        with dog.guard("quick"):
            sum(range(100))
    time.sleep(0.2)  # nothing pending is raised later
