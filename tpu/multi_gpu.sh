#!/usr/bin/env bash
# Runs a jax_ppo command on the GPUs of one machine.
#
#   tpu/multi_gpu.sh [--gpus N] [--one-process-per-gpu] [--port P] [--dry-run] -- COMMAND [ARGS...]
#
# Default: ONE process that sees the first N GPUs (CUDA_VISIBLE_DEVICES=0..N-1); JAX puts all of
# them in jax.devices() and the run's mesh spans them (the recommended way on one host).
# --one-process-per-gpu: N processes, process i owning GPU i, joined through jax.distributed over
# 127.0.0.1:P (the same code path as a multi-host cluster; useful to rehearse one). The command
# must be a `jax-ppo train|sft|reward` call (it receives the distributed.* overrides).
#
# e.g. tpu/multi_gpu.sh --gpus 8 -- jax-ppo train configs/run.yaml run_dir=runs/ppo8
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=common.sh
source "${here}/common.sh"

GPUS="" PER_GPU=0 PORT=12355
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpus) need_value "$1" "${2:-}"; GPUS="$2"; shift 2 ;;
    --one-process-per-gpu) PER_GPU=1; shift ;;
    --port) need_value "$1" "${2:-}"; PORT="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) die "unknown argument '$1'; put the command after -- (see --help)" ;;
  esac
done
[[ $# -gt 0 ]] || die "give the command to run after --, e.g. -- jax-ppo train run.yaml"
if [[ -z "${GPUS}" ]]; then
  if [[ "${DRY_RUN}" == 1 ]] || ! command -v nvidia-smi >/dev/null; then
    die "--gpus is required (nvidia-smi is not available to count them)"
  fi
  GPUS="$(nvidia-smi --list-gpus | wc -l)"
fi
[[ "${GPUS}" =~ ^[1-9][0-9]*$ ]] || die "--gpus must be a positive integer, got '${GPUS}'"
[[ "${PORT}" =~ ^[0-9]+$ ]] || die "--port must be a port number, got '${PORT}'"

visible="$(seq -s, 0 $((GPUS - 1)))"
if [[ "${PER_GPU}" == 0 ]]; then
  run env "CUDA_VISIBLE_DEVICES=${visible}" "$@"
  exit 0
fi
pids=()
for ((i = 0; i < GPUS; i++)); do
  cmd=(env "CUDA_VISIBLE_DEVICES=${visible}" "$@"
       "distributed.coordinator_address=127.0.0.1:${PORT}" "distributed.num_processes=${GPUS}"
       "distributed.process_id=${i}" "distributed.local_device_ids=[${i}]")
  if [[ "${DRY_RUN}" == 1 ]]; then
    run "${cmd[@]}"
  else
    "${cmd[@]}" &
    pids+=("$!")
  fi
done
status=0
for pid in "${pids[@]}"; do
  wait "${pid}" || status=$?
done
exit "${status}"
