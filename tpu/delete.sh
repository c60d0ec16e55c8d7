#!/usr/bin/env bash
# Deletes a TPU VM, or a queued resource and its TPU (--queued).
#
#   tpu/delete.sh --name NAME --zone ZONE [--project P] [--queued] [--dry-run]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=common.sh
source "${here}/common.sh"

NAME="" ZONE="" PROJECT="" QUEUED=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) need_value "$1" "${2:-}"; NAME="$2"; shift 2 ;;
    --zone) need_value "$1" "${2:-}"; ZONE="$2"; shift 2 ;;
    --project) need_value "$1" "${2:-}"; PROJECT="$2"; shift 2 ;;
    --queued) QUEUED=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,4p' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -n "${NAME}" ]] || die "--name is required (the TPU's name)"
[[ -n "${ZONE}" ]] || die "--zone is required (the TPU's zone)"
gcloud_scope
if [[ "${QUEUED}" == 1 ]]; then
  run gcloud compute tpus queued-resources delete "${NAME}" "${SCOPE[@]}" --force --quiet
else
  run gcloud compute tpus tpu-vm delete "${NAME}" "${SCOPE[@]}" --quiet
fi
