# Shared helpers of the tpu/ scripts; sourced, never run.
# shellcheck shell=bash

DRY_RUN=0

# run CMD ARGS...: runs the command, or with --dry-run prints it (shell-quoted) to stdout.
run() {
  if [[ "${DRY_RUN}" == 1 ]]; then
    local arg line=""
    for arg in "$@"; do
      if [[ "${arg}" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
        line+="${arg} "
      else
        line+="'${arg//\'/\'\\\'\'}' "
      fi
    done
    printf '%s\n' "${line% }"
  else
    "$@"
  fi
}

die() {
  printf '%s: error: %s\n' "$(basename "$0")" "$*" >&2
  exit 2
}

# need_value FLAG VALUE: a flag given without its value is an error naming the flag.
need_value() {
  if [[ -z "${2:-}" || "${2}" == --* ]]; then
    die "$1 needs a value"
  fi
}

# runtime_version GENERATION: the TPU software version Google documents for JAX on it.
runtime_version() {
  case "$1" in
    v5e) echo "v2-alpha-tpuv5-lite" ;;
    v5p) echo "v2-alpha-tpuv5" ;;
    v6e) echo "v2-alpha-tpuv6e" ;;
    *) die "--generation must be v5e, v5p or v6e, got '$1'" ;;
  esac
}

# accelerator_type GENERATION CHIPS: e.g. v5e 16 -> v5litepod-16, v5p 8 -> v5p-8.
# (v5p names count TensorCores: a v5p-8 slice has 4 chips; see tpu/README.md.)
accelerator_type() {
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "--size must be a positive integer, got '$2'"
  case "$1" in
    v5e) echo "v5litepod-$2" ;;
    v5p) echo "v5p-$2" ;;
    v6e) echo "v6e-$2" ;;
    *) die "--generation must be v5e, v5p or v6e, got '$1'" ;;
  esac
}

# gcloud_scope: the --project/--zone arguments (empty values are left to gcloud's defaults).
gcloud_scope() {
  SCOPE=()
  if [[ -n "${PROJECT:-}" ]]; then SCOPE+=("--project=${PROJECT}"); fi
  if [[ -n "${ZONE:-}" ]]; then SCOPE+=("--zone=${ZONE}"); fi
}
