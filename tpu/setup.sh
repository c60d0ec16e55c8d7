#!/usr/bin/env bash
# Installs jax_ppo (and JAX for TPU) on every worker of a TPU VM slice.
#
#   tpu/setup.sh --name NAME --zone ZONE [--project P] [--source DIR | --git URL[@REF]] \
#       [--venv PATH] [--dry-run]
#
# --source DIR (default: this repository) is packed with `git archive HEAD` and copied to every
# worker; --git URL installs from a git remote instead. Each worker gets a virtual environment
# (default $HOME/jax_ppo_venv on the worker) with `jax[tpu]` and the package.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=common.sh
source "${here}/common.sh"

# shellcheck disable=SC2016  # $HOME is expanded on the worker, not here
NAME="" ZONE="" PROJECT="" SOURCE="$(dirname "${here}")" GIT="" VENV='$HOME/jax_ppo_venv'
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) need_value "$1" "${2:-}"; NAME="$2"; shift 2 ;;
    --zone) need_value "$1" "${2:-}"; ZONE="$2"; shift 2 ;;
    --project) need_value "$1" "${2:-}"; PROJECT="$2"; shift 2 ;;
    --source) need_value "$1" "${2:-}"; SOURCE="$2"; shift 2 ;;
    --git) need_value "$1" "${2:-}"; GIT="$2"; shift 2 ;;
    --venv) need_value "$1" "${2:-}"; VENV="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -n "${NAME}" ]] || die "--name is required (the TPU's name)"
[[ -n "${ZONE}" ]] || die "--zone is required (the TPU's zone)"
gcloud_scope
ssh=(gcloud compute tpus tpu-vm ssh "${NAME}" "${SCOPE[@]}" --worker=all)

venv_setup="python3 -m venv ${VENV} && ${VENV}/bin/pip install -U pip"
jax_tpu="${VENV}/bin/pip install -U 'jax[tpu]'"
if [[ -n "${GIT}" ]]; then
  run "${ssh[@]}" "--command=${venv_setup} && ${jax_tpu} && ${VENV}/bin/pip install 'git+${GIT}'"
else
  [[ -d "${SOURCE}" ]] || die "--source ${SOURCE} is not a folder"
  archive="/tmp/jax_ppo_src.tar.gz"
  run git -C "${SOURCE}" archive --format=tar.gz -o "${archive}" HEAD
  run gcloud compute tpus tpu-vm scp "${archive}" "${NAME}:jax_ppo_src.tar.gz" \
      "${SCOPE[@]}" --worker=all
  run "${ssh[@]}" "--command=rm -rf \$HOME/jax_ppo && mkdir -p \$HOME/jax_ppo && \
tar -xzf \$HOME/jax_ppo_src.tar.gz -C \$HOME/jax_ppo && ${venv_setup} && ${jax_tpu} && \
${VENV}/bin/pip install -e \$HOME/jax_ppo"
fi
# Every worker must see all the slice's chips (a multi-host slice: each sees its local ones and
# jax.process_count() equals the number of workers).
run "${ssh[@]}" "--command=${VENV}/bin/python -c 'import jax; print(jax.process_index(), \
jax.process_count(), jax.local_device_count(), jax.device_count())'"
