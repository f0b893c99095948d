"""Broker adapters. The protocol lives in ``sagaloop.engine.ports`` (the engine depends on it);
implementations: ``database`` (embedded default), ``memory`` (tests)."""

from sagaloop.engine.ports import Broker, Delivery

__all__ = ["Broker", "Delivery"]
