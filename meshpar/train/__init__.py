"""Layer 5, train: a training run, from batches to logged metrics and saved state.

Its modules, one line each: the table in docs/architecture.md (the one list, checked by
tests/test_layout.py).
"""
