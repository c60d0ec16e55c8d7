"""The rollout's layout on a TPU slice: the sampler on the run's FSDP mesh against the
tensor-parallel rollout (`SamplingConfig.decode_tensor`), compiled for the slice from this CPU
host (libtpu; no TPU runs anything).

For cells of the planning table (`tpu_planning_table.py`: their slice, rows and remat read from
its records in `results/tpu_planning/`) it compiles the rollout's programs twice, once as the
table planned them (the sampler on the run's mesh, FSDP over every chip: each decode step
reads a chip's own `1/n` of every matrix, `jax_ppo.parallel.rules.stationary_layer_weights`,
and all-reduces partial sums over the `n` chips) and once with `decode_tensor = k` (the chips
regrouped `(n/k, 1, k)`: each chip holds `1/k` of every matrix in the compute dtype, moved there
once per rollout by the `decode_state` program), and reports per chip:

* the HBM peak of `generate` (and of `decode_state`), compiled as the run compiles them;
* XLA's FLOPs and bytes accessed of one decode step (the sampler's length-bucketed loops'
  steps, each compiled at full depth, averaged over the steps), and of the whole rollout with
  every loop trip counted, as `jax-ppo plan` counts them (`ppo_plan.loop_corrected`);
* the rollout's roofline time `max(FLOPs / peak, bytes / HBM bandwidth)` on the chip.

    pip install -e ".[tpu]"   # a virtual environment of its own (libtpu)
    python experiments/benchmarks/decode_layout.py --cells llama-3.1-8b:lora-ppo:v5e \\
        [--decode-tensor K] [--json PATH]

`k` defaults to the largest divisor of the model's key/value heads that divides the chips.
The XLA counts carry the TPU cost model's staging over-count (docs/accelerators.md, the decode
ratio): compare the two layouts by them, do not read them as HBM traffic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_line, host_record  # noqa: E402
from tpu_planning_table import RESULTS, run_shape_for  # noqa: E402
from tpu_waste import libtpu_version  # noqa: E402

ROLLOUT = ("decode_state", "generate")
"""The rollout's programs (`decode_state` only with `decode_tensor`)."""


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cells", required=True,
                 help="comma-separated MODEL:RUN:GENERATION cells of the planning table")
  p.add_argument("--decode-tensor", type=int, default=None,
                 help="the rollout's tensor-parallel width (default: the largest divisor of the "
                      "key/value heads that divides the chips)")
  p.add_argument("--records", default=str(RESULTS), help="the planning table's records")
  p.add_argument("--json", help="write the results here")
  return p.parse_args(argv)


def default_width(kv_heads: int, chips: int) -> int:
  """The largest `k` dividing both the key/value heads and the chips."""
  return max(k for k in range(1, kv_heads + 1) if kv_heads % k == 0 and chips % k == 0)


def with_decode_tensor(shape, k: int | None):
  """`shape` with the run's `sampling.decode_tensor = k`."""
  sampling = dataclasses.replace(shape.ppo.sampling, decode_tensor=k)
  return dataclasses.replace(shape, ppo=dataclasses.replace(shape.ppo, sampling=sampling))


def rollout_figures(shape, devices, topology: str) -> dict:
  """Per-chip HBM peaks and loop-corrected XLA costs of the rollout's programs of `shape`."""
  from jax_ppo.diagnostics import ppo_plan
  from jax_ppo.diagnostics.plan import plan_chip, program_peaks
  from jax_ppo.diagnostics.topology import slice_mesh
  from jax_ppo.parallel.chips import roofline_seconds
  from jax_ppo.rollout.layout import sampler_mesh

  mesh = slice_mesh(devices, shape.mesh, topology=topology)
  t0 = time.perf_counter()
  run = ppo_plan.RunPrograms(shape, mesh, only=ROLLOUT)
  peaks = program_peaks(run.programs(), topology=topology)
  costs = ppo_plan.layer_costs(shape, mesh, topology=topology, only=ROLLOUT)
  corrected = ppo_plan.loop_corrected(costs, shape.ppo,
                                      max_new_tokens=run.sampling.max_new_tokens)
  chip = plan_chip(devices, topology)
  # One decode step, averaged over the loops' steps (each loop's step at its cache prefix).
  segments = ppo_plan.decode_segments(shape.ppo, prompt_length=shape.prompt_length)
  steps = [(seg.steps, costs[ppo_plan.decode_piece(k)]) for k, seg in enumerate(segments)
           if ppo_plan.decode_piece(k) in costs]
  n_steps = sum(n for n, _ in steps)
  step = {"flops": sum(n * c.flops for n, c in steps) / n_steps,
          "bytes_accessed": sum(n * c.bytes_accessed for n, c in steps) / n_steps}
  return {
      "mesh": dict(sampler_mesh(mesh, run.sampling, run.model_config).shape),
      "peak_bytes_per_chip": peaks,
      "decode_step": step,
      "programs": {n: {"flops": c.flops, "bytes_accessed": c.bytes_accessed,
                       "roofline_s": roofline_seconds(c.flops, c.bytes_accessed, chip,
                                                      dtype=shape.dtype)}
                   for n, c in corrected.items()},
      "roofline_s": sum(roofline_seconds(c.flops, c.bytes_accessed, chip, dtype=shape.dtype)
                        for c in corrected.values()),
      "chip": chip.name,
      "compile_s": round(time.perf_counter() - t0, 1),
  }


def cell(name: str, args) -> dict:
  from jax_ppo.diagnostics.plan import topology_devices

  model, run, generation = name.split(":")
  with open(os.path.join(args.records, f"{model}_{run}_{generation}.json")) as f:
    record = json.load(f)
  topology = record["topology"]
  if topology is None:
    raise SystemExit(f"{name}: the planning table found no slice that fits; nothing to compile.")
  devices = topology_devices(topology)
  shape = dataclasses.replace(run_shape_for(model, run, len(devices)), remat=record["remat"])
  k = args.decode_tensor or default_width(shape.model.num_kv_heads, len(devices))
  out = {"cell": name, "topology": topology, "chips": len(devices), "rows": record["rows"],
         "remat": record["remat"], "prompt_tokens": shape.prompt_length,
         "response_tokens": shape.ppo.sampling.max_new_tokens, "decode_tensor": k,
         "layouts": {}}
  for label, width in (("training mesh", None), (f"decode_tensor={k}", k)):
    figures = rollout_figures(with_decode_tensor(shape, width), devices, topology)
    out["layouts"][label] = figures
    print(f"{name} {label}: {json.dumps(figures)}", flush=True)
  return out


def table(results: list[dict]) -> str:
  gib = 2**30
  lines = ["| cell | slice | layout | generate peak GiB/chip | decode step GB/chip | decode step "
           "GFLOP/chip | rollout roofline s |", "|---|---|---|---|---|---|---|"]
  for r in results:
    for label, f in r["layouts"].items():
      peak = f["peak_bytes_per_chip"]
      lines.append(
          f"| {r['cell']} | {r['topology']} | {label} | {peak['generate'] / gib:.2f}"
          + (f" (+ decode_state {peak['decode_state'] / gib:.2f})" if "decode_state" in peak
             else "")
          + f" | {f['decode_step']['bytes_accessed'] / 1e9:.2f}"
          f" | {f['decode_step']['flops'] / 1e9:.1f} | {f['roofline_s']:.2f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax

  results = [cell(name, args) for name in args.cells.split(",")]
  record = {"benchmark": "decode_layout", "host": host_record(),
            "versions": {"jax": jax.__version__, "libtpu": libtpu_version(),
                         "python": platform.python_version()},
            "cells": results}
  print(host_line(record["host"]))
  print(table(results))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(record, f, indent=2)
      f.write("\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
