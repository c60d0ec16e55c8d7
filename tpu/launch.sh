#!/usr/bin/env bash
# Launches one command on every worker of a TPU VM slice at the same time (multi-host SPMD).
#
#   tpu/launch.sh --name NAME --zone ZONE [--project P] [--venv PATH] [--log FILE] [--dry-run] \
#       -- COMMAND [ARGS...]
#
# e.g. tpu/launch.sh --name ppo --zone us-east5-b -- jax-ppo train configs/run.yaml \
#          run_dir=gs://bucket/runs/ppo1
# On a TPU slice every worker finds the others by itself: `jax_ppo.parallel.distributed.initialize`
# (called by `jax-ppo train|sft|reward`) calls `jax.distributed.initialize()` with no arguments,
# which reads the TPU metadata. run_dir must be shared by all workers (a gs:// bucket or NFS):
# Orbax writes checkpoints from every process, and only process 0 writes logs. The output of each
# worker goes to FILE (default $HOME/jax_ppo_launch.log) on that worker.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=common.sh
source "${here}/common.sh"

# shellcheck disable=SC2016  # $HOME is expanded on the worker, not here
NAME="" ZONE="" PROJECT="" VENV='$HOME/jax_ppo_venv' LOG='$HOME/jax_ppo_launch.log'
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) need_value "$1" "${2:-}"; NAME="$2"; shift 2 ;;
    --zone) need_value "$1" "${2:-}"; ZONE="$2"; shift 2 ;;
    --project) need_value "$1" "${2:-}"; PROJECT="$2"; shift 2 ;;
    --venv) need_value "$1" "${2:-}"; VENV="$2"; shift 2 ;;
    --log) need_value "$1" "${2:-}"; LOG="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) die "unknown argument '$1'; put the command after -- (see --help)" ;;
  esac
done
[[ -n "${NAME}" ]] || die "--name is required (the TPU's name)"
[[ -n "${ZONE}" ]] || die "--zone is required (the TPU's zone)"
[[ $# -gt 0 ]] || die "give the command to run after --, e.g. -- jax-ppo train run.yaml"
gcloud_scope
printf -v remote '%q ' "$@"
remote="${remote% }"
run gcloud compute tpus tpu-vm ssh "${NAME}" "${SCOPE[@]}" --worker=all \
    "--command=cd \$HOME/jax_ppo 2>/dev/null || cd \$HOME; PATH=${VENV}/bin:\$PATH ${remote} \
2>&1 | tee ${LOG}"
