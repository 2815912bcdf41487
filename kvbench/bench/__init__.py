"""Efficiency benchmarks: ``python -m kvbench.bench`` (README.md in this folder)."""
