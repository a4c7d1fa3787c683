#!/usr/bin/env bash
# meshpar on every worker of a Cloud TPU VM pod slice, from your workstation.
#
#   launch/tpu_pod.sh [--dry-run] TPU_NAME ZONE [meshpar train arguments...]
#   PROJECT=my-proj RETRIES=3 launch/tpu_pod.sh my-v5p-64 us-east5-a checkpoint.dir=gs://bucket/run1 checkpoint.every=500
#
# One process per TPU VM host, each driving its local chips. `MESHPAR_DISTRIBUTED=auto` makes
# meshpar call jax.distributed.initialize() with no arguments, and JAX finds the coordinator,
# process count and id from the TPU metadata server. checkpoint.dir must be storage all hosts see
# (a gs:// bucket). Every host builds only its own rows of each batch.
#
# Environment:
#   PROJECT   gcloud project (default: gcloud's configured one)
#   REPO_DIR  where the meshpar checkout lives on the workers (default: ~/meshpar)
#   PYTHON    interpreter on the workers (default: python3)
#   RETRIES   relaunch this many times after a failure or preemption (default 0); each relaunch
#             resumes from the newest complete checkpoint
#
# --dry-run prints the gcloud command it would run (one line, shell-quoted) and exits 0: what the
# tests check, since no TPU is reachable from them.
#
# Preemption / maintenance events reach the workers as SIGTERM: the hosts agree on a step, save,
# and exit 143. A host that dies makes the others exit within MESHPAR_PEER_TIMEOUT seconds.
set -uo pipefail
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
if [[ $# -lt 2 ]]; then
  echo "usage: launch/tpu_pod.sh [--dry-run] TPU_NAME ZONE [meshpar train arguments...]" >&2
  exit 2
fi
TPU=$1
ZONE=$2
shift 2
REPO_DIR=${REPO_DIR:-'~/meshpar'}
PYTHON=${PYTHON:-python3}
RETRIES=${RETRIES:-0}
project=()
[[ -n "${PROJECT:-}" ]] && project=(--project "$PROJECT")

args=$(printf '%q ' "$@")
remote="cd ${REPO_DIR} && MESHPAR_DISTRIBUTED=auto PYTHONUNBUFFERED=1 \
MESHPAR_HEARTBEAT_TIMEOUT=\${MESHPAR_HEARTBEAT_TIMEOUT:-60} MESHPAR_PEER_TIMEOUT=\${MESHPAR_PEER_TIMEOUT:-20} \
${PYTHON} -m meshpar.cli train ${args}"

run=(gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" "${project[@]}" --worker=all --command "$remote")
if ((DRY_RUN)); then
  printf '%q ' "${run[@]}" | sed 's/ $//'
  echo
  exit 0
fi

attempt=0
while true; do
  echo "tpu_pod.sh: attempt $((attempt + 1)) on all workers of ${TPU} (${ZONE})" >&2
  "${run[@]}"
  rc=$?
  if ((rc == 0)); then
    exit 0
  fi
  if ((attempt >= RETRIES)); then
    echo "tpu_pod.sh: run ended with status $rc after $((attempt + 1)) attempt(s)" >&2
    exit "$rc"
  fi
  attempt=$((attempt + 1))
  echo "tpu_pod.sh: status $rc; relaunching to resume from the last checkpoint" >&2
  # kill leftovers of the previous attempt on every worker before relaunching
  gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" "${project[@]}" --worker=all \
    --command "pkill -f 'meshpar.cli train' || true" >/dev/null 2>&1
  sleep 10
done
