"""Work already started goes first.

An engine consumes two queues: its app's engine queue (step results, events, timers, cancels,
retries, child runs: the work of runs in flight) and its start queue (new runs). A batch of new
runs is taken up only while no batch of the engine queue waits for the engine or holds it, and
while fewer than a window of the app's runs are running (their steps in flight), so that a
burst of starts never delays the runs already started: their steps do not queue behind the new
runs' first steps either. The runs beyond the window wait in the start queue, where
``Client.start`` counts them against the start backlog limit (``SAGALOOP_START_BACKLOG``).

While the start queue is empty, the engine looks at it every ``--poll`` seconds: a count of the
running runs is kept for ``RECOUNT`` seconds as long as the engine took up no new run since and
the window had room for two batches at that count (so an idle engine counts once a second, not
ten times), and is taken again before any batch that follows a batch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from sagaloop.client.admission import limit_from_env
from sagaloop.engine.ports import Store

logger = logging.getLogger("sagaloop.engine")

START_WINDOW = 256
"""The default window: an engine takes up new runs while fewer of its app's runs are running.
``SAGALOOP_START_WINDOW`` sets another (``0``: no window)."""
RECOUNT = 1.0
"""Seconds a count of the running runs is used again while the engine takes up no new run
(see the module's docstring)."""


class StartGate:
    """Decides when an engine may take up new runs (see the module's docstring)."""

    def __init__(self, store: Store, app: str, *, window: int | None = None) -> None:
        self.store = store
        self.app = app
        self.window = limit_from_env("SAGALOOP_START_WINDOW", window, START_WINDOW)
        self.full = False
        """The window was full at the last look: new runs wait."""
        self._busy = 0
        self._cond = threading.Condition()
        self._counted: tuple[int, float] | None = None
        """The last count of running runs and the ``time.monotonic()`` until which it holds,
        while no new run was taken up since it."""

    @contextlib.contextmanager
    def first(self) -> Iterator[None]:
        """Around a batch of the engine queue, from before it waits for the engine to after
        it is done: no new run is taken up meanwhile."""
        with self._cond:
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def wait_turn(self, timeout: float, most: int) -> int:
        """Wait at most ``timeout`` seconds for no batch of the engine queue to be in the way;
        then how many new runs may be taken up now: at most ``most``, and the window's room."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._busy == 0, timeout):
                return 0
        if not self.window:
            return most
        running = self._running(most)
        full = running >= self.window
        if full != self.full:
            self.full = full
            if full:
                logger.info(
                    "%d runs of app %r are running, the start window (SAGALOOP_START_WINDOW="
                    "%d): new runs wait in the start queue until some end or wait",
                    running,
                    self.app,
                    self.window,
                )
            else:
                logger.info("the start window of app %r has room again", self.app)
        return min(most, self.window - running)

    def taken(self, count: int) -> None:
        """The engine took up ``count`` new runs after :meth:`wait_turn`: any, and the next
        turn counts the running runs again."""
        if count:
            self._counted = None

    def _running(self, most: int) -> int:
        counted = self._counted
        if (
            counted is not None
            and time.monotonic() < counted[1]
            and self.window - counted[0] >= 2 * most
        ):
            return counted[0]
        running = self.store.count_running(self.app, started=True, at_most=self.window)
        self._counted = (running, time.monotonic() + RECOUNT)
        return running
