"""`python -m meshpar.cli ...`: the `meshpar` program."""

from meshpar.cli import entry

entry()
