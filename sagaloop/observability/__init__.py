"""Observability of a deployment: Prometheus metrics read from the store (``metrics.py``).

Needs the ``metrics`` extra (``pip install 'sagaloop[metrics]'``); ``import sagaloop`` never
imports this package."""

from __future__ import annotations

from sagaloop.observability.metrics import MetricsServer, SagaloopCollector, serve_metrics

__all__ = ["MetricsServer", "SagaloopCollector", "serve_metrics"]
