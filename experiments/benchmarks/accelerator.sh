#!/usr/bin/env bash
# Rollout, forward/backward and PPO-step benchmarks on one accelerator, each writing JSON with MFU
# and HBM-bandwidth use against the card's datasheet peaks (experiments/benchmarks/device_peaks.py,
# keyed by jax's device_kind). Budget: under 8 minutes on one H100/H200-class GPU.
#
#   experiments/benchmarks/accelerator.sh [OUT_DIR]            # default OUT_DIR: bench_out
#   experiments/benchmarks/accelerator.sh --dry-run [OUT_DIR]  # tiny shapes on the CPU (smoke test)
#
# PYTHON selects the interpreter (default: python); it needs jax with the accelerator's plugin
# (e.g. jax[cuda12]), flax, optax, torch and transformers (the benchmarks build random Hugging Face
# models with torch; --no-torch / --no-hf keep torch off the timed path). Each step has a time
# limit (STEP_TIMEOUT seconds, default 150) so that one slow step cannot eat the others' budget;
# a failed step is recorded in summary.json and the script goes on.
set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-bench_out}
PY=${PYTHON:-python}
STEP_TIMEOUT=${STEP_TIMEOUT:-150}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false

if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  # Fill the MFU / HBM fields against the H200 row (meaningless numbers, but every code path runs).
  export BENCH_DEVICE_KIND="NVIDIA H200 (dry run on cpu)"
  ROLLOUT=(--shape tiny --batch 2 --prompt-len 8 --new-tokens 4 --warmup 1 --reps 1 --no-hf)
  FORWARD=(--shape tiny --batch 2 --seq 16 --reps 1 --matmul-size 256 --no-torch)
  PPO=(--shape tiny --batch 2 --response-length 4 --warmup 0 --updates 1)
else
  # GPT-2-small sampler at batch 64 (item 2's shape); fwd+bwd at GPT-2 small and Qwen3-0.6B in
  # bfloat16 (cuDNN attention) at 8 x 1024 tokens; the PPO update at the 86M "base" shape.
  ROLLOUT=(--shape gpt2-small --batch 64 --prompt-len 64 --new-tokens 128 --warmup 1 --reps 3
           --no-hf)
  FORWARD=(--shape gpt2-small qwen3-0.6b --batch 8 --seq 1024 --reps 5 --matmul-size 8192
           --dtype bfloat16 --no-torch)
  PPO=(--shape base --warmup 2 --updates 4 --train-layers scan)
fi

status=()
run_step() {  # name, script, args...
  local name=$1 script=$2; shift 2
  local start=$SECONDS
  echo "== $name: $PY $script $* --json $OUT/$name.json" >&2
  timeout "$STEP_TIMEOUT" "$PY" "$HERE/$script" "$@" --json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$OUT/$name.log" >&2
  status+=("\"$name\": {\"rc\": $rc, \"seconds\": $((SECONDS - start))}")
}

run_step rollout rollout.py "${ROLLOUT[@]}"
run_step forward forward.py "${FORWARD[@]}"
run_step ppo_step ppo_step.py "${PPO[@]}"

device=$("$PY" -c "import jax; d = jax.devices()[0]; print(d.platform + ': ' + d.device_kind)" \
         2>/dev/null || echo unknown)
joined=$(IFS=,; echo "${status[*]}")
printf '{"device": "%s", "dry_run": %s, "steps": {%s}}\n' "$device" \
  "$([ "$DRY" = 1 ] && echo true || echo false)" "$joined" > "$OUT/summary.json"
cat "$OUT/summary.json"
# Fail when any step failed, so that a caller notices.
! grep -q '"rc": [1-9]' "$OUT/summary.json"
