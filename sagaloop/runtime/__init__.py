"""The runtime: what DOES the work the engine decides. The consumer of the engine's queues
(``consumers``), the worker consumer of the step queues (``worker``), the timer scheduler
(``timers``) and what they share (``delivery``: decoding a delivery, failure logs), the step
runner that executes one attempt of a step, its compensation or its reconcile (``steps``, over
the thread and event-loop pools of ``slots`` and ``aio``), the in-process lane and its worker
for local steps (``lane``, ``local``), the outbox relay (``relay``), the start window
(``admission``), the test crash points (``crashpoints``), the process registry, takeover of
dead processes' claims and the liveness files (``registry``, ``takeover``, ``liveness``); the
one assembly of these parts from a process's ``Roles`` and ``Tuning`` (``assembly``), run on
threads by ``service.Service`` and one message at a time by ``sagaloop.testing.Harness``; and
the factory of stores, brokers and clients from URLs (``connect``: ``sagaloop.connect``). It
talks to storage and brokers through the engine's ports; it imports nothing of the CLI or the
test harness."""
