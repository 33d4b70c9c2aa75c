"""Baselines measured side by side with jaxpaged (see benchmarks/compare.py)."""
