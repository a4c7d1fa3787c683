"""Layer 6, serve: inference with a KV cache in a serving layout.

Its modules, one line each: the table in docs/architecture.md (the one list, checked by
tests/test_layout.py).
"""
