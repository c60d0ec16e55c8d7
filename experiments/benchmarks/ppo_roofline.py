"""The roofline of a measured PPO update: XLA's compiled cost of the same run's programs on this
process's device, beside the times `ppo_step.py` measured.

`ppo_step.py --json MEASURED` times PPO updates split into rollout (sampling), score (the reward
model) and update (reference log-probs, advantages and the training epochs). This script reads
the workload from that record's "config" (model shape, batch, response tokens, dtype, remat,
layer loops) and compiles the run's programs as `jax-ppo plan` does
(`jax_ppo.diagnostics.ppo_plan`: `generate`, `score`, `experience_update` with one minibatch),
on this process's first device instead of a TPU slice, with every loop trip counted
(`ppo_plan.layer_costs`, `loop_corrected`: XLA counts a loop body once). Each program's roofline
time is `max(FLOPs / peak, bytes accessed / HBM bandwidth)` on the card's datasheet row
(`jax_ppo.parallel.chips`; the compute dtype picks the peak), and each phase is set beside its
measured median:

    rollout ~ generate      score ~ score      update ~ experience_update (or experience + update)

A ratio (measured / roofline) near 1 leaves nothing to gain on the chip; a large one is time the
compiled programs do not account for by FLOPs or bytes: launch and host overhead between
kernels, the host work of each phase (prompt batches, the step's bookkeeping), kernels below the
chip's peaks. The roofline is a bound from XLA's own counts, not a prediction: every decode step
runs to `max_new_tokens` in both (the workload has no stop token). XLA's GPU cost analysis counts
the FLOPs of cuBLAS matmuls; a custom call it has no model for (a cuDNN attention kernel, in some
XLA versions) may add its bytes without its FLOPs, which can only lower the bound.

On a CPU there is no datasheet row: the costs are reported without a roofline time, unless
`BENCH_DEVICE_KIND` names a chip (accelerator.sh --dry-run sets the H200's, so that the CPU smoke
run fills every field with meaningless numbers).

    python experiments/benchmarks/ppo_roofline.py --measured OUT/ppo_bf16.json [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_line, host_record  # noqa: E402

PHASES = {"rollout": ("generate",), "score": ("score",),
          "update": ("experience_update", "experience", "update")}
"""The programs of each phase `ppo_step.py` times (those the run compiles: one minibatch fuses
the experience with the first epoch, `experience_update`)."""
RECORD_FIELDS = ("shape", "batch", "response_length", "dtype", "remat", "warmup", "updates",
                 "train_layers", "rollout_layers")
"""The fields of a `ppo_step.py` record's "config" that define the workload."""


def read_measured(path: str) -> dict:
  """The `ppo_step.py` record at `path`; SystemExit naming the file and the missing field when
  it is not one."""
  try:
    with open(path) as f:
      record = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise SystemExit(f"--measured {path}: not a readable ppo_step.py JSON record ({e}); run "
                     "experiments/benchmarks/ppo_step.py --json PATH first.") from None
  config = record.get("config") if isinstance(record, dict) else None
  missing = [f for f in RECORD_FIELDS if not isinstance(config, dict) or f not in config]
  if missing or "jax_ppo" not in record:
    raise SystemExit(f"--measured {path}: a ppo_step.py record needs 'jax_ppo' and config "
                     f"fields {list(RECORD_FIELDS)}; missing: {missing or ['jax_ppo']}.")
  return record


def run_shape(workload: dict):
  """The `ppo_plan.RunShape` of the run `ppo_step.py` times for `workload` (a record's
  "config"): its policy, reward model and critic of `ppo_step.SHAPES[shape]`, its `PPOConfig`
  (`ppo_step.ppo_config`), and the prompt length the sampler pads the benchmark's prompts
  (`ppo_step.make_prompts`) to (`rollout.batching.left_pad_prompts`, as the trainer pads them)."""
  import ppo_step

  from jax_ppo.diagnostics.ppo_plan import RunShape, sampling_config
  from jax_ppo.diagnostics.shapes import plan_model_config
  from jax_ppo.rollout.batching import left_pad_prompts

  shape = ppo_step.SHAPES[workload["shape"]]
  with tempfile.TemporaryDirectory() as tmp:
    configs = {}
    for name, hf in ppo_step.hf_configs(shape).items():
      hf.save_pretrained(os.path.join(tmp, name))
      configs[name] = plan_model_config(os.path.join(tmp, name))
  ppo = ppo_step.ppo_config(types.SimpleNamespace(**workload), shape["vocab_size"])
  ids, _ = left_pad_prompts(ppo_step.make_prompts(shape["vocab_size"]), sampling_config(ppo),
                            max_context=configs["policy"].max_position_embeddings)
  return RunShape(model=configs["policy"], ppo=ppo, prompt_length=ids.shape[1],
                  dtype=workload["dtype"], remat=workload["remat"],
                  reward_models=(configs["reward"],), critic=configs["value"])


def program_costs(shape) -> dict:
  """`{program: Cost}` of the run's programs on this process's first device (`PPOTrainer`
  without a mesh, as `ppo_step.py` builds it, runs on one), every loop trip counted."""
  import jax

  from jax_ppo.diagnostics.ppo_plan import layer_costs, loop_corrected, sampling_config
  from jax_ppo.parallel.mesh import MeshConfig, make_mesh

  devices = jax.devices()[:1]
  mesh = make_mesh(MeshConfig(), devices=devices)
  label = f"{devices[0].platform}:{len(devices)} ({devices[0].device_kind})"
  xla = layer_costs(shape, mesh, topology=label)
  return loop_corrected(xla, shape.ppo, max_new_tokens=sampling_config(shape.ppo).max_new_tokens)


def compare(costs: dict, measured: dict, chip, dtype: str) -> dict:
  """Per program its FLOPs, bytes, roofline seconds and bound; per phase (`PHASES`) the summed
  roofline beside the measured median (`{phase}_s` of the record's "jax_ppo") and their ratio.
  Without a `chip` row the roofline fields are None."""
  from jax_ppo.parallel.chips import roofline_seconds

  programs = {}
  for name, cost in costs.items():
    entry = {"flops": cost.flops, "bytes_accessed": cost.bytes_accessed,
             "roofline_s": None, "bound": None}
    if chip is not None:
      compute, memory = cost.flops / chip.peak_flops(dtype), cost.bytes_accessed / chip.hbm_bytes_s
      entry["roofline_s"] = roofline_seconds(cost.flops, cost.bytes_accessed, chip, dtype=dtype)
      entry["bound"] = "flops" if compute >= memory else "bytes"
    programs[name] = entry
  unplaced = sorted(set(programs) - {p for names in PHASES.values() for p in names})
  if unplaced:
    raise ValueError(f"programs {unplaced} belong to no phase of ppo_step.py's split (PHASES)")
  phases = {}
  for phase, names in PHASES.items():
    present = [n for n in names if n in programs]
    roofline = (None if chip is None or not present else
                sum(programs[n]["roofline_s"] for n in present))
    time_s = measured[f"{phase}_s"]
    phases[phase] = {"programs": present, "measured_s": time_s, "roofline_s": roofline,
                     "measured_over_roofline": None if not roofline else time_s / roofline}
  total = None if chip is None else sum(p["roofline_s"] for p in phases.values())
  phases["total"] = {"programs": sorted(programs), "measured_s": measured["s_per_update"],
                     "roofline_s": total,
                     "measured_over_roofline": (None if not total else
                                                measured["s_per_update"] / total)}
  return {"programs": programs, "phases": phases}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--measured", required=True,
                  help="the JSON record of ppo_step.py --json whose workload to compile")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  record = read_measured(args.measured)
  workload = record["config"]

  import device_peaks
  import jax

  kind, chip = device_peaks.bench_chip(jax.devices()[0].device_kind)
  start = time.perf_counter()
  shape = run_shape(workload)
  costs = program_costs(shape)
  compile_s = time.perf_counter() - start
  result = compare(costs, record["jax_ppo"], chip, workload["dtype"])
  result.update(
      measured=os.path.abspath(args.measured), workload={f: workload[f] for f in RECORD_FIELDS},
      device_kind=kind, peak_table_key=chip and chip.name,
      peak_flops=chip and chip.peak_flops(workload["dtype"]),
      peak_hbm_bytes_s=chip and chip.hbm_bytes_s, compile_s=compile_s,
      backend=jax.default_backend(), jax=jax.__version__,
      host=host_record())
  row = (f"on the {chip.name} row ({result['peak_flops'] / 1e12:.1f} TFLOP/s {workload['dtype']}, "
         f"{chip.hbm_bytes_s / 1e12:.2f} TB/s)" if chip else "(no datasheet row: costs only)")
  print(f"\nPPO update roofline ({workload['shape']}, batch {workload['batch']}, "
        f"{workload['response_length']} response tokens, {workload['dtype']}) {row}; "
        f"costs compiled in {compile_s:.0f} s")
  print(f"{'phase':<8} {'programs':<20} {'GFLOP':>10} {'GB':>9} {'bound':>6} {'roofline s':>11} "
        f"{'measured s':>11} {'ratio':>7}")
  for phase, entry in result["phases"].items():
    names = entry["programs"]
    flops = sum(result["programs"][n]["flops"] for n in names)
    gbytes = sum(result["programs"][n]["bytes_accessed"] for n in names)
    bounds = {result["programs"][n]["bound"] for n in names} - {None}
    bound = "-" if not bounds else "/".join(sorted(bounds))
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    print(f"{phase:<8} {'+'.join(names) if phase != 'total' else 'all':<20} {flops / 1e9:>10.1f} "
          f"{gbytes / 1e9:>9.2f} {bound:>6} {fmt(entry['roofline_s'], '11.4g')} "
          f"{entry['measured_s']:>11.4f} {fmt(entry['measured_over_roofline'], '7.1f')}")
  print(host_line(result["host"]))
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()
