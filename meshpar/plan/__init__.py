"""Layer 7, plan: what a configuration will cost before it runs, and what the compiled step holds.

Its modules, one line each: the table in docs/architecture.md (the one list, checked by
tests/test_layout.py).
"""
