"""Benchmarks of miles-async; run them with ``python -m benchmarks.run`` (see benchmarks/README.md)."""
