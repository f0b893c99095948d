"""The one event loop that runs the async bodies of a process's steps.

An agent's model client (``openai``'s, through Pydantic AI or the Agents SDK) is made once per
process and keeps a pool of connections bound to the event loop that opened them. Run each
attempt on an event loop of its own, closed after it, and the next request picks a connection
of a closed loop: ``RuntimeError: Event loop is closed``, on every model request after the
first. So every async step body of the process runs on one long-lived loop, on a daemon thread
of its own; the thread that runs the attempt (a step thread, or the caller's when inline) waits
for it, and keeps its slot, its timeout and its cancellation as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections.abc import Coroutine
from typing import Any

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def loop() -> asyncio.AbstractEventLoop:
    """The process's step loop, started on first use (again after a fork)."""
    global _loop, _thread
    with _lock:
        if _loop is None or _thread is None or not _thread.is_alive():
            _loop = asyncio.new_event_loop()
            _thread = threading.Thread(
                target=_loop.run_forever, name="sagaloop-async-steps", daemon=True
            )
            _thread.start()
        return _loop


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on the step loop, in the caller's context (its context variables: the
    current step, the trace), and wait for it: its value, or what it raised
    (``asyncio.CancelledError`` when it was cancelled)."""
    target = loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("a step's body cannot wait for another on the step loop")
    context = contextvars.copy_context()
    done: concurrent.futures.Future[tuple[bool, Any]] = concurrent.futures.Future()

    def start() -> None:
        try:
            task = target.create_task(_outcome(coro), context=context)
        except BaseException as e:  # the loop is closing: say so to the waiting thread
            coro.close()
            done.set_result((False, e))
            return
        task.add_done_callback(lambda t: done.set_result(t.result()))

    target.call_soon_threadsafe(start)
    ok, value = done.result()
    if not ok:
        raise value
    return value


async def _outcome(coro: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """``(True, value)`` or ``(False, what it raised)``: whatever a step raises, a
    ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``, a cancellation) included, goes to
    the thread that waits for it, never out of the loop (which would stop it)."""
    try:
        return True, await coro
    except BaseException as e:
        return False, e
