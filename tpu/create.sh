#!/usr/bin/env bash
# Creates a Cloud TPU VM (single- or multi-host slice) or a queued resource for one.
#
#   tpu/create.sh --name NAME --zone ZONE --generation v5e|v5p|v6e --size N \
#       [--project P] [--queued] [--spot] [--runtime-version V] [--dry-run]
#
# --size is the number in the accelerator type (v5litepod-16, v5p-32, v6e-8...). --queued asks
# for a queued resource (the way to get large or spot slices): the TPU named NAME appears when
# the request is granted; `gcloud compute tpus queued-resources describe NAME` shows its state.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=common.sh
source "${here}/common.sh"

NAME="" ZONE="" PROJECT="" GENERATION="" SIZE="" QUEUED=0 SPOT=0 RUNTIME=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) need_value "$1" "${2:-}"; NAME="$2"; shift 2 ;;
    --zone) need_value "$1" "${2:-}"; ZONE="$2"; shift 2 ;;
    --project) need_value "$1" "${2:-}"; PROJECT="$2"; shift 2 ;;
    --generation) need_value "$1" "${2:-}"; GENERATION="$2"; shift 2 ;;
    --size) need_value "$1" "${2:-}"; SIZE="$2"; shift 2 ;;
    --runtime-version) need_value "$1" "${2:-}"; RUNTIME="$2"; shift 2 ;;
    --queued) QUEUED=1; shift ;;
    --spot) SPOT=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -n "${NAME}" ]] || die "--name is required (the TPU's name)"
[[ -n "${ZONE}" ]] || die "--zone is required (e.g. us-east5-b for v6e; see tpu/README.md)"
[[ -n "${GENERATION}" ]] || die "--generation is required: v5e, v5p or v6e"
[[ -n "${SIZE}" ]] || die "--size is required (8 for v6e-8, 16 for v5litepod-16...)"
TYPE="$(accelerator_type "${GENERATION}" "${SIZE}")"
if [[ -z "${RUNTIME}" ]]; then RUNTIME="$(runtime_version "${GENERATION}")"; fi
gcloud_scope

if [[ "${QUEUED}" == 1 ]]; then
  args=(gcloud compute tpus queued-resources create "${NAME}" "--node-id=${NAME}"
        "${SCOPE[@]}" "--accelerator-type=${TYPE}" "--runtime-version=${RUNTIME}")
  if [[ "${SPOT}" == 1 ]]; then args+=(--spot); fi
else
  args=(gcloud compute tpus tpu-vm create "${NAME}" "${SCOPE[@]}"
        "--accelerator-type=${TYPE}" "--version=${RUNTIME}")
  if [[ "${SPOT}" == 1 ]]; then args+=(--spot); fi
fi
run "${args[@]}"
