"""Layer 0, core: what every other layer speaks. No model, no training, no devices touched at import.

Its modules, one line each: the table in docs/architecture.md (the one list, checked by
tests/test_layout.py).
"""
