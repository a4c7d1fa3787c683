"""Layer 4, runtime: processes, schedulers and signals, and the model placed on its mesh.

Its modules, one line each: the table in docs/architecture.md (the one list, checked by
tests/test_layout.py).
"""
