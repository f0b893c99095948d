"""Observability of a deployment: Prometheus metrics read from the store (``metrics.py``).

Needs the ``metrics`` extra (from a checkout, ``pip install -e '.[metrics]'``);
``import sagaloop`` never imports this package. OpenTelemetry traces are made where the work
happens, by :mod:`sagaloop.tracing`: the engine, the workers and the relay call it, and they
may not import this package, which reads the store (``tests/unit/test_layers.py``)."""

from __future__ import annotations

from sagaloop.observability.metrics import MetricsServer, SagaloopCollector, serve_metrics

__all__ = ["MetricsServer", "SagaloopCollector", "serve_metrics"]
