"""The RabbitMQ broker's holdings: a message wakes one receiver of its queue, not every
receiving thread of the process (each needless wake-up is a thread switch and a GIL turn)."""

from __future__ import annotations

import threading
import time

from sagaloop.brokers._amqp import Consumer, Holdings, Message
from sagaloop.testing import VirtualClock, eventually


def _waiting(holdings: Holdings, queues: list[str], woken: list[str], name: str) -> None:
    with holdings.cond:
        began = time.monotonic()
        holdings.wait(queues, 5.0)
        if time.monotonic() - began < 4.0:
            woken.append(name)


def _deliver(holdings: Holdings, queue: str, tag: int) -> None:
    consumer = Consumer(queue, prefetch=10, generation=holdings.generation)
    with holdings.cond:
        holdings.delivered(Message(consumer, b"{}", None, 1, tag))


def _count_waiting(holdings: Holdings, queue: str) -> int:
    with holdings.cond:
        return len(holdings.waiting.get(queue, []))


def test_a_message_wakes_one_receiver_of_its_queue() -> None:
    holdings = Holdings(VirtualClock(), lease=30.0, prefetch=16)
    woken: list[str] = []
    threads = [
        threading.Thread(target=_waiting, args=(holdings, queues, woken, name), daemon=True)
        for name, queues in (("engine", ["e"]), ("starts", ["s"]), ("w1", ["w"]), ("w2", ["w"]))
    ]
    for t in threads:
        t.start()
    eventually(lambda: _count_waiting(holdings, "w") == 2, 5, "the receivers to wait")
    eventually(lambda: _count_waiting(holdings, "e") == 1, 5, "the receivers to wait")
    _deliver(holdings, "e", 1)
    eventually(lambda: woken == ["engine"], 5, "the engine's receiver to wake")
    _deliver(holdings, "w", 2)
    eventually(lambda: len(woken) == 2, 5, "a worker's receiver to wake")
    time.sleep(0.2)
    assert len(woken) == 2 and woken[1] in ("w1", "w2"), "one worker thread, not both"
    assert _count_waiting(holdings, "w") == 1 and _count_waiting(holdings, "s") == 1
    _deliver(holdings, "w", 3)
    with holdings.cond:
        holdings.wake_all()  # closing, say: everyone
    for t in threads:
        t.join(5)
    assert sorted(woken) == ["engine", "starts", "w1", "w2"]
