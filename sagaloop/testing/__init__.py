"""The public test harness: run an app's sagas in one thread on an in-memory SQLite store with a
virtual clock, so that a two-day wait is tested in milliseconds.

>>> env = Harness(app)                      # doctest: +SKIP
>>> run_id = env.start(my_saga, {"x": 1})   # doctest: +SKIP
>>> env.run_until_idle()                    # doctest: +SKIP
>>> env.result(run_id)                      # doctest: +SKIP

:func:`replay` checks a recorded history against the current code.
"""

from sagaloop.testing.harness import Crash, Harness, VirtualClock
from sagaloop.testing.histories import history_to_json, replay
from sagaloop.testing.wait import eventually

__all__ = [
    "Crash",
    "Harness",
    "VirtualClock",
    "eventually",
    "history_to_json",
    "replay",
]
