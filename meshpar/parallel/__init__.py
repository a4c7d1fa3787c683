"""Layer 2, parallel: what is written by hand over one mesh axis (everything else is GSPMD's).

Its modules, one line each: the table in docs/architecture.md (the one list, checked by
tests/test_layout.py).
"""
