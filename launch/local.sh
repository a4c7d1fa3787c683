#!/usr/bin/env bash
# Start N meshpar processes on this machine (loopback), each with its share of fake CPU devices and
# gloo collectives: a real multi-process run without a cluster.
#
#   launch/local.sh N [meshpar train arguments...]
#   launch/local.sh 2 --metrics-out m.jsonl steps=20 checkpoint.dir=/tmp/ck checkpoint.every=5
#
# `--devices D` (or the config's `devices`, 8 by default) counts all processes together: with N=2
# and 8 devices each process fakes 4. Process 0 hosts the coordination service on a free port
# (MESHPAR_PORT to choose one) and is the only one that logs and writes --metrics-out.
#
# Signals: SIGTERM/SIGINT to this script go to every process (a preemption: they agree on a step,
# save a checkpoint if checkpoint.dir is set, and exit 143/130). If a process dies, the others
# notice within MESHPAR_PEER_TIMEOUT seconds (default 10) and exit with status 3, naming it; this
# script then exits with the first non-zero status. Launch again with the same arguments to resume.
set -u
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ || "$1" -lt 1 ]]; then
  echo "usage: launch/local.sh N [meshpar train arguments...]" >&2
  exit 2
fi
N=$1
shift
PYTHON=${PYTHON:-python}
PORT=${MESHPAR_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}

pids=()
for ((i = 0; i < N; i++)); do
  MESHPAR_COORDINATOR="127.0.0.1:${PORT}" MESHPAR_NUM_PROCESSES="$N" MESHPAR_PROCESS_ID="$i" \
    "$PYTHON" -m meshpar.cli train "$@" &
  pids+=($!)
done
echo "launch/local.sh: $N processes on 127.0.0.1:${PORT}: pids ${pids[*]}" >&2

forward() {
  for p in "${pids[@]}"; do kill -s "$1" "$p" 2>/dev/null; done
}
trap 'forward TERM' TERM
trap 'forward INT' INT

status=0
remaining=$N
while ((remaining > 0)); do
  for idx in "${!pids[@]}"; do
    p=${pids[$idx]}
    [[ -z "$p" ]] && continue
    if ! kill -0 "$p" 2>/dev/null; then
      wait "$p"
      rc=$?
      pids[$idx]=""
      remaining=$((remaining - 1))
      if ((rc != 0)); then
        if ((rc > 128)); then why="status $rc (signal $((rc - 128)): killed, or saved and stopped on it)"; else why="exit status $rc"; fi
        echo "launch/local.sh: process $idx (pid $p) ended with $why" >&2
        ((status == 0)) && status=$rc
      fi
    fi
  done
  ((remaining > 0)) && sleep 0.2
done
exit $status
