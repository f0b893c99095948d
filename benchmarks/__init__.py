"""Benchmarks of sagaloop against a hand-made floor and a peer: ``make bench`` (see run.py)."""
