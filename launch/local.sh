#!/usr/bin/env bash
# Start N meshpar processes on this machine (loopback, gloo): a thin wrapper around `meshpar launch`
# (meshpar/runtime/launch.py holds the contract: free port, devices split across processes, signals
# forwarded, first non-zero status returned).
#
#   launch/local.sh N [meshpar train arguments...]
#   launch/local.sh 2 --metrics-out m.jsonl steps=20 checkpoint.dir=/tmp/ck checkpoint.every=5
#
# The interpreter is $PYTHON, else the project's .venv, else `python3` on PATH: it must have meshpar
# installed (README's install command).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [[ -n "${PYTHON:-}" ]]; then :
elif [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"
else PYTHON=python3; fi
exec "$PYTHON" -m meshpar.cli launch "$@"
