"""Deterministic replay, activations, history, timers, events, cancellation and the runtimes
that execute steps. Talks to storage and brokers through the protocols in ``ports``."""
