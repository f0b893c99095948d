"""The engine DECIDES: history, the run state (the one fold), typed messages, the ports to
storage and brokers, deterministic replay, the sandbox, the watchdog, activations (intake,
cache, prepare and apply) and the step contract (``contract``). It does no I/O of its own:
the runtime (``sagaloop.runtime``) feeds it and carries out what it decides, and the client
(``sagaloop.client``) starts and reads runs."""
