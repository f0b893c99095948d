"""The per-run live channel in one process: the embedded default's (``sagaloop dev``: steps
and readers in one process) and the Harness's. ``sagaloop.brokers.streams.RabbitStreams`` is
RabbitMQ's; both satisfy ``sagaloop.engine.ports.Streams``.

Best effort and never recorded: a reader that is not listening misses live items, and the
durable result is only ever what the history records. A reader that joins late gets what the
history holds first (``Client.stream`` reads it).
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Any

from sagaloop.engine.ports import Subscription


class _LocalSubscription:
    def __init__(self, owner: LocalStreams, run_id: str) -> None:
        self.owner = owner
        self.run_id = run_id
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def get(self, timeout: float) -> list[Any]:
        try:
            out = [self.items.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.items.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self.owner._drop(self)


class LocalStreams:
    """Readers and writers in one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readers: dict[str, list[_LocalSubscription]] = collections.defaultdict(list)

    def publish(self, run_id: str, item: Any) -> None:
        with self._lock:
            readers = list(self._readers.get(run_id, ()))
        for reader in readers:
            reader.items.put(item)

    def flush(self, timeout: float) -> bool:
        return True  # ``publish`` hands each item to its readers at once

    def subscribe(self, run_id: str) -> Subscription:
        reader = _LocalSubscription(self, run_id)
        with self._lock:
            self._readers[run_id].append(reader)
        return reader

    def _drop(self, reader: _LocalSubscription) -> None:
        with self._lock:
            readers = self._readers.get(reader.run_id, [])
            if reader in readers:
                readers.remove(reader)
            if not readers:
                self._readers.pop(reader.run_id, None)

    def close(self) -> None:
        with self._lock:
            self._readers.clear()


LOCAL = LocalStreams()
"""The process's in-process channel (the embedded default's)."""
