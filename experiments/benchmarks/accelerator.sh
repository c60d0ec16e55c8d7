#!/usr/bin/env bash
# Rollout, forward/backward and PPO-step benchmarks on one accelerator, each writing JSON with MFU
# and HBM-bandwidth use against the card's datasheet peaks (experiments/benchmarks/device_peaks.py,
# keyed by jax's device_kind), the PPO step's compiled roofline beside its measured time
# (ppo_roofline.py) and the decode step's compiled bytes over the ideal (tpu_waste.py).
# Budget: BUDGET seconds (default 420, 7 minutes) on one GPU.
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

# Steps in order of importance; each is one benchmark invocation writing $OUT/<name>.json and
# .log. The whole script stays inside BUDGET seconds (default 420): a step gets
# min(STEP_TIMEOUT, what is left) and is skipped (rc 124, "skipped") when under 20 s are left.
if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  # Fill the MFU / HBM fields against the H200 row (meaningless numbers, but every code path runs).
  export BENCH_DEVICE_KIND="NVIDIA H200 (dry run on cpu)"
  PPO_BF16=(--shape tiny --dtype bfloat16 --batch 2 --response-length 4 --warmup 0 --updates 1)
  ROLLOUT_BF16=(--shape tiny --batch 2 --prompt-len 8 --new-tokens 4 --warmup 1 --reps 1 --no-hf
                --dtype bfloat16 --param-dtype float32)
  FORWARD=(--shape tiny --batch 2 --seq 16 --reps 1 --matmul-size 256 --no-torch
           --dtype bfloat16)
  ROLLOUT_BF16W=(--shape tiny --batch 2 --prompt-len 8 --new-tokens 4 --warmup 1 --reps 1 --no-hf
                 --dtype bfloat16 --param-dtype bfloat16)
  PPO_FP32=(--shape tiny --batch 2 --response-length 4 --warmup 0 --updates 1
            --no-second-invocation)
  DECODE_WASTE=(--topology local --parts decode --layers 2 --rows 2 --microbatch 2 --prompt 16
                --response 16)
else
  # ppo_bf16: the PPO update (rollout / score / update split, MFU) at the 86M "base" shape in
  # bfloat16 compute with float32 master weights, 64 rows of ~30 prompt + 128 response tokens.
  PPO_BF16=(--shape base --dtype bfloat16 --batch 64 --response-length 128 --warmup 2
            --updates 4 --train-layers scan)
  # rollout_bf16: the sampler alone, GPT-2 small at batch 64, 64 + 128 tokens, bfloat16 compute
  # reading float32 weights (what a PPO run samples from); rollout_bf16w: bfloat16 weights.
  ROLLOUT_BF16=(--shape gpt2-small --batch 64 --prompt-len 64 --new-tokens 128 --warmup 1
                --reps 3 --no-hf --dtype bfloat16 --param-dtype float32)
  # forward: fwd+bwd at GPT-2 small and Qwen3-0.6B in bfloat16 at 8 x 1024 tokens.
  FORWARD=(--shape gpt2-small qwen3-0.6b --batch 8 --seq 1024 --reps 5 --matmul-size 8192
           --dtype bfloat16 --no-torch)
  ROLLOUT_BF16W=(--shape gpt2-small --batch 64 --prompt-len 64 --new-tokens 128 --warmup 1
                 --reps 3 --no-hf --dtype bfloat16 --param-dtype bfloat16)
  # ppo_fp32: the CPU reference workload (base shape, batch 8, 48 tokens, float32), whose CPU
  # and TRL figures docs/benchmarks.md gives.
  PPO_FP32=(--shape base --warmup 2 --updates 4 --train-layers scan --no-second-invocation)
  # decode_waste: the sampler's decode step compiled for this card at Qwen3-0.6B's shapes (64
  # rows of 512 + 512 slots, bfloat16), XLA's bytes accessed over the ideal (weights and live KV
  # cache read once) and over the GPU cost model's own floor: tpu_waste.py's decode ratio, as the
  # GPU's cost analysis counts it (compiles only; nothing is allocated).
  DECODE_WASTE=(--topology local --parts decode)
fi
BUDGET=${BUDGET:-420}

status=()
run_step() {  # name, script, args...
  local name=$1 script=$2; shift 2
  local start=$SECONDS left=$((BUDGET - SECONDS)) rc
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped, ${left}s of the ${BUDGET}s budget left" >&2
    status+=("\"$name\": {\"rc\": 124, \"seconds\": 0, \"skipped\": true}")
    return
  fi
  local limit=$(( left < STEP_TIMEOUT ? left : STEP_TIMEOUT ))
  echo "== $name (limit ${limit}s): $PY $script $* --json $OUT/$name.json" >&2
  timeout "$limit" "$PY" "$HERE/$script" "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n 15 "$OUT/$name.log" >&2
  status+=("\"$name\": {\"rc\": $rc, \"seconds\": $((SECONDS - start))}")
}

run_step ppo_bf16 ppo_step.py "${PPO_BF16[@]}"
# ppo_roofline: XLA's compiled cost of ppo_bf16's programs on this card (every loop trip counted)
# and their roofline time, beside ppo_bf16's measured rollout / score / update.
run_step ppo_roofline ppo_roofline.py --measured "$OUT/ppo_bf16.json"
run_step rollout_bf16 rollout.py "${ROLLOUT_BF16[@]}"
run_step decode_waste tpu_waste.py "${DECODE_WASTE[@]}"
run_step forward forward.py "${FORWARD[@]}"
run_step rollout_bf16w rollout.py "${ROLLOUT_BF16W[@]}"
run_step ppo_fp32 ppo_step.py "${PPO_FP32[@]}"

device=$("$PY" -c "import jax; d = jax.devices()[0]; print(d.platform + ': ' + d.device_kind)" \
         2>/dev/null || echo unknown)
versions=$("$PY" -c "import jax, flax; print(f'jax {jax.__version__}, flax {flax.__version__}')" \
           2>/dev/null || echo unknown)
cpu=$(grep -m1 "model name" /proc/cpuinfo 2>/dev/null | cut -d: -f2 | xargs)
joined=$(IFS=,; echo "${status[*]}")
printf '{"device": "%s", "host_cpu": "%s", "versions": "%s", "dry_run": %s, "steps": {%s}}\n' \
  "$device" "$cpu" "$versions" "$([ "$DRY" = 1 ] && echo true || echo false)" "$joined" \
  > "$OUT/summary.json"
cat "$OUT/summary.json"
# Fail when any step failed, so that a caller notices.
! grep -q '"rc": [1-9]' "$OUT/summary.json"
