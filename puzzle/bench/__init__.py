"""Benchmarks (each runnable as python -m puzzle.bench.<name>)."""
