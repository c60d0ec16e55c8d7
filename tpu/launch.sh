#!/usr/bin/env bash
# Launches one command on every worker of a TPU VM slice at the same time (multi-host SPMD).
#
#   tpu/launch.sh --name NAME --zone ZONE [--project P] [--venv PATH] [--log FILE] [--dry-run] \
#       -- COMMAND [ARGS...]
#
# e.g. tpu/launch.sh --name ppo --zone us-east5-b -- jax-ppo train configs/run.yaml \
#          run_dir=/mnt/shared/runs/ppo1 mesh.data=1 mesh.fsdp=-1
# The command runs with JAX_PPO_DISTRIBUTED=1, so `jax-ppo train|sft|reward` calls
# `jax.distributed.initialize()` with no arguments, which finds the other workers of the slice
# from the TPU metadata. run_dir must be a folder every worker sees (an NFS/Filestore mount or a
# gcsfuse-mounted bucket; see tpu/README.md): every process writes its shards of each Orbax
# checkpoint there, and process 0 the logs. The output of each worker goes to FILE (default
# $HOME/jax_ppo_launch.log) on that worker.
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
    "--command=cd \$HOME/jax_ppo 2>/dev/null || cd \$HOME; JAX_PPO_DISTRIBUTED=1 \
PATH=${VENV}/bin:\$PATH ${remote} 2>&1 | tee ${LOG}"
