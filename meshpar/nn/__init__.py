"""Layer 1, nn: what model code calls. Logical axis names only; never a mesh axis or a device count.

Its modules, one line each: the table in docs/architecture.md (the one list, checked by
tests/test_layout.py).
"""
