"""Layer 3, io: state in and out of files.

Its modules, one line each: the table in docs/architecture.md (the one list, checked by
tests/test_layout.py).
"""
