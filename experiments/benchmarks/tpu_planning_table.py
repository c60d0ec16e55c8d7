"""The planning table of docs/accelerators.md: the smallest TPU slice, and the fewest H100 or
H200 GPUs, a PPO run fits, from `jax-ppo plan`'s compiles on this CPU host (libtpu and JAX's CUDA
plugin; no TPU, no GPU).

For each model (`jax_ppo.diagnostics.shapes`), run kind and TPU generation or GPU part it walks
the generation's slices (for GPUs: 1, 2, 4, 8 GPUs on one node, then 2, 4, 8 nodes of 8) from the
smallest whose resident arrays (parameters, moments, reference, reward model, critic; no compile
needed) fit one chip's HBM (on GPUs `GPU_MEM_FRACTION` of it: JAX's allocator takes a share),
re-planning the programs' memory (`ppo_plan.memory_peaks`) until every program fits, then plans
that slice in full (`ppo_plan.plan_run`: costs with every loop trip, roofline time; GPUs have no
costs without a GPU, so their cells have memory only). It writes one JSON per cell (`--out`, the
plan's JSON plus the cell's names) and prints the table; `--table` prints the table from the
JSON already written (no compile).

The runs (all bfloat16 compute with float32 masters and moments, the default remat "dots",
1024 prompt tokens + 1024 response tokens, 64 responses per update (one per chip on slices of
more than 64 chips), one PPO epoch of one minibatch (the fused program), microbatches of
max(16, chips) rows, FSDP over every chip). A slice whose resident arrays fit but whose
programs do not with the default remat is tried again with full remat (`FALLBACK_REMAT`: every
layer recomputed in the backward pass, no activations saved but the layers' inputs), and the
cell names it when that is what fits:

* `ppo`: PPO with a critic: the policy, its reference, a reward model and a critic of the
  policy's architecture (the critic a copy of the reward model, as `jax-ppo train` starts it);
* `grpo`: GRPO without a critic, 8 prompts x 8 samples, a reward function (no reward model);
* `lora-ppo`: PPO with LoRA adapters (rank 16 on q, k, v, o) and a value head on the policy
  trunk, the reward model of `ppo` (no reference copy: the base weights with adapters off).

The roofline time per update is the sum of the programs' `max(FLOPs / peak, bytes / HBM
bandwidth)` on one chip: a lower bound (no communication, no host work, every decode step at the
full `max_new_tokens`).

    pip install -e ".[tpu,plan-gpu]"   # in a virtual environment of its own
    python experiments/benchmarks/tpu_planning_table.py [--models qwen3-0.6b,...]
        [--runs ppo,grpo,lora-ppo] [--generations v5e,v5p,v6e,h100,h200] [--out DIR] [--table]
        [--memory-only] [--skip-existing] [--add-costs] [--recost-generate]

`--add-costs` plans the TPU cells that were written with `--memory-only` in full, at the slice
and remat they record, without walking the slices again. `--recost-generate` re-plans the
rollout (`generate`) alone of the cells planned in full when the sampler's decode step still
gathered every layer's weights on every chip (`DECODE_WEIGHTS`).

JAX's persistent compilation cache is not used: it cannot load executables compiled for devices
that are not present (every program here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_record  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "tpu_planning"
MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "llama-3.1-8b")
RUNS = ("ppo", "grpo", "lora-ppo")
SLICES = {
    "v5e": ("v5e:2x2", "v5e:2x4", "v5e:4x4", "v5e:4x8", "v5e:8x8", "v5e:8x16", "v5e:16x16"),
    "v5p": ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4", "v5p:4x4x8"),
    "v6e": ("v6e:2x2", "v6e:2x4", "v6e:4x4", "v6e:4x8", "v6e:8x8", "v6e:8x16", "v6e:16x16"),
    "h100": ("h100:1", "h100:2", "h100:4", "h100:8", "h100:2x8", "h100:4x8", "h100:8x8"),
    "h200": ("h200:1", "h200:2", "h200:4", "h200:8", "h200:2x8", "h200:4x8", "h200:8x8"),
}
GPUS = ("h100", "h200")
"""The GPU parts of `SLICES`: their plans have memory only (XLA's GPU compiler gives no costs
without a GPU)."""
GPU_MEM_FRACTION = 0.95
"""The share of a GPU's memory a GPU cell's programs must fit: the runs start with
`XLA_CLIENT_MEM_FRACTION=0.95` (`jax_ppo.diagnostics.gpu_topology.RAISED_MEM_FRACTION`; JAX's
allocator takes 75% by default)."""
PROMPT, RESPONSE, ROWS = 1024, 1024, 64
FALLBACK_REMAT = "full"
DECODE_WEIGHTS = "in place"
"""A record's `decode_weights` when its `generate` was compiled with the decode step leaving
FSDP's weights in place (`jax_ppo.parallel.rules.stationary_activations`). Records without it
were compiled when every decode step gathered every layer's weights on every chip: their
rollout's cost is that layout's, marked `†` in the table (`--recost-generate` recompiles it)."""
"""The remat policy a slice is tried with when its programs do not fit with the default's."""


def rows_for(chips: int) -> int:
  """Responses per update: `ROWS`, or one per chip on a slice of more chips (FSDP shards the
  rows over every chip: fewer rows than chips leave chips without one)."""
  return max(ROWS, chips)


def run_shape_for(model: str, run: str, chips: int):
  """The `RunShape` of one cell (module docstring) with FSDP over `chips`."""
  from jax_ppo.diagnostics.ppo_plan import RunShape
  from jax_ppo.diagnostics.shapes import shape_config
  from jax_ppo.models import LoRAConfig
  from jax_ppo.parallel.mesh import MeshConfig
  from jax_ppo.ppo.config import PPOConfig, PPOSampling

  config = shape_config(model)
  rows = rows_for(chips)
  micro = min(rows, max(16, chips))
  common = dict(batch_size=rows, ppo_epochs=1, num_minibatches=1,
                gradient_accumulation_steps=rows // micro,
                sampling=PPOSampling(max_new_tokens=RESPONSE))
  if run == "grpo":
    ppo = PPOConfig(advantage_mode="grpo", n_samples=8, **common)
  else:
    ppo = PPOConfig(advantage_mode="gae", **common)
  return RunShape(
      model=config, ppo=ppo, prompt_length=PROMPT, dtype="bfloat16",
      lora=LoRAConfig(rank=16) if run == "lora-ppo" else None,
      mesh=MeshConfig(data=1, fsdp=chips),
      reward_models=() if run == "grpo" else (config,),
      critic=config if run == "ppo" else None)


def memory_fraction(generation: str) -> float:
  """The share of a chip's HBM a cell's programs must fit: `GPU_MEM_FRACTION` on GPUs, all of it
  on TPUs."""
  return GPU_MEM_FRACTION if generation in GPUS else 1.0


def stale(record: dict) -> bool:
  """Whether a cell written earlier fits no longer: a GPU cell whose peak is over
  `GPU_MEM_FRACTION` of the card (cells written before GPU cells were judged against JAX's
  allocator's share)."""
  if record["topology"] is None:
    return False
  usable = int(record["hbm_per_chip_bytes"] * memory_fraction(record["generation"]))
  return max(record["peak_bytes_per_chip"].values()) > usable


def plan_cell(model: str, run: str, generation: str, out: pathlib.Path, *,
              costs: bool = True, after: dict | None = None) -> dict:
  """Walks `generation`'s slices to the smallest that fits and writes its plan (module
  docstring); without `costs`, only the fitting slice's memory (no cost variants, no roofline
  time). `after`: a `stale` record of the cell, whose earlier slices do not fit: the walk goes
  on from its slice, keeping what it tried and compiling no slice and remat it tried again
  (each of those was over the share it fits now)."""
  from jax_ppo.diagnostics import ppo_plan
  from jax_ppo.diagnostics.plan import plan_chip, topology_devices
  from jax_ppo.diagnostics.topology import slice_mesh

  slices = SLICES[generation]
  tried = []
  if after is not None:
    slices = slices[slices.index(after["topology"]):]
    tried = list(after["tried"])
  for topology in slices:
    devices = topology_devices(topology)
    hbm = plan_chip(devices, topology).hbm_bytes
    usable = int(hbm * memory_fraction(generation))
    shape = run_shape_for(model, run, len(devices))
    mesh = slice_mesh(devices, shape.mesh, topology=topology)
    resident = sum(ppo_plan.RunPrograms(shape, mesh).resident_bytes.values())
    if resident > usable:
      tried.append({"topology": topology, "resident_bytes_per_chip": resident})
      continue
    peaks = None  # of the first remat that fits
    for remat in dict.fromkeys((shape.remat, FALLBACK_REMAT)):
      shape = dataclasses.replace(shape, remat=remat)
      if any(t["topology"] == topology and t.get("remat") == remat
             and t["peak_bytes_per_chip"] > usable for t in tried):
        continue
      start = time.perf_counter()
      peaks = ppo_plan.memory_peaks(shape, topology, devices=devices)
      tried.append({"topology": topology, "remat": remat,
                    "peak_bytes_per_chip": max(peaks.values()),
                    "compile_s": round(time.perf_counter() - start, 1)})
      if max(peaks.values()) <= usable:
        break
      peaks = None
    if peaks is not None:
      record = {"model": model, "run": run, "generation": generation,
                "prompt_tokens": PROMPT, "response_tokens": RESPONSE,
                "rows": rows_for(len(devices)), "remat": shape.remat,
                "topology": topology, "chips": len(devices),
                "hbm_per_chip_bytes": hbm,
                "memory_fraction": memory_fraction(generation),
                "peak_bytes_per_chip": peaks, "resident_bytes_per_chip": resident,
                "plan": None, "tried": tried, "host": host_record(),
                "jax": __import__("jax").__version__}
      if costs:
        start = time.perf_counter()
        record["plan"] = ppo_plan.plan_run(shape, topology, devices=devices,
                                           advice=False).to_json()
        record["plan_s"] = round(time.perf_counter() - start, 1)
        record["decode_weights"] = DECODE_WEIGHTS
      break
  else:
    record = {"model": model, "run": run, "generation": generation, "topology": None,
              "plan": None, "tried": tried, "host": host_record()}
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{model}_{run}_{generation}.json").write_text(json.dumps(record, indent=2) + "\n")
  return record


def cell_shape(record: dict):
  """The `RunShape` and devices of a cell already planned: its own slice, rows and remat."""
  from jax_ppo.diagnostics.plan import topology_devices

  devices = topology_devices(record["topology"])
  shape = dataclasses.replace(run_shape_for(record["model"], record["run"], len(devices)),
                              remat=record["remat"])
  assert shape.ppo.batch_size == record["rows"], (shape.ppo.batch_size, record["rows"])
  return shape, devices


def write_cell(record: dict, out: pathlib.Path) -> dict:
  """Writes `record` to its JSON under `out`; returns it."""
  name = f"{record['model']}_{record['run']}_{record['generation']}.json"
  (out / name).write_text(json.dumps(record, indent=2) + "\n")
  return record


def add_costs(record: dict, out: pathlib.Path) -> dict:
  """Plans a memory-only cell's slice in full (costs with every loop trip, roofline time), with
  the cell's own shape and remat, and rewrites its JSON; a cell without a fitting slice, one
  planned with costs already and a GPU cell (no costs without a GPU) are returned unchanged."""
  from jax_ppo.diagnostics import ppo_plan

  if record["topology"] is None or record["plan"] is not None or record["generation"] in GPUS:
    return record
  shape, devices = cell_shape(record)
  start = time.perf_counter()
  record = dict(record, plan=ppo_plan.plan_run(shape, record["topology"], devices=devices,
                                               advice=False).to_json(),
                decode_weights=DECODE_WEIGHTS)
  record["plan_s"] = round(time.perf_counter() - start, 1)
  return write_cell(record, out)


def recost_generate(record: dict, out: pathlib.Path) -> dict:
  """Re-plans the `generate` program alone (its peak, costs and roofline time) of a cell planned
  in full before the decode step left FSDP's weights in place (`DECODE_WEIGHTS`), with the
  cell's own shape, slice and remat, and rewrites its JSON (`recost_host`: the host it was
  recompiled on, `host` the one that planned the rest); other cells are returned unchanged.
  Its other programs keep their plan: the change touched the decode step alone."""
  from jax_ppo.diagnostics import ppo_plan

  if record["plan"] is None or record.get("decode_weights") == DECODE_WEIGHTS:
    return record
  shape, devices = cell_shape(record)
  start = time.perf_counter()
  plan = ppo_plan.plan_run(shape, record["topology"], devices=devices, advice=False,
                           only=("generate",))
  generate = plan.to_json()["programs"]["generate"]
  peaks = dict(record["peak_bytes_per_chip"], generate=generate["peak_bytes_per_chip"])
  usable = int(record["hbm_per_chip_bytes"] * memory_fraction(record["generation"]))
  record = dict(record, peak_bytes_per_chip=peaks, decode_weights=DECODE_WEIGHTS,
                recost_s=round(time.perf_counter() - start, 1), recost_host=host_record(),
                plan=dict(record["plan"], fits=max(peaks.values()) <= usable,
                          costs_rows_divisor=(record["plan"]["costs_rows_divisor"]
                                              or plan.costs_rows_divisor),
                          programs=dict(record["plan"]["programs"], generate=generate)))
  return write_cell(record, out)


RUN_LABELS = {
    "ppo": "ppo (policy, reference, reward model, critic)",
    "grpo": "grpo (policy, reference, reward function)",
    "lora-ppo": "lora-ppo (rank-16 adapters, value head, reward model)",
}


def cell_text(record: dict | None) -> str:
  """One cell of the table: the smallest slice that fits, its chips, its peak HBM per chip of
  the chip's HBM, and its roofline time per update when the cell was planned with costs ("~"
  before it when the costs were extrapolated from fewer rows: `costs_rows_divisor`; "†" after
  it when its rollout was compiled gathering every layer's weights at every decode step:
  `DECODE_WEIGHTS`); "none up to" the largest slice tried; "not planned"."""
  from jax_ppo.models import DEFAULT_REMAT

  gib = 2.0**30
  if record is None:
    return "not planned"
  if record["topology"] is None:
    return f"none up to {record['tried'][-1]['topology']}"
  peak = max(record["peak_bytes_per_chip"].values()) / gib
  unit = ("GPU" if record["chips"] == 1 else "GPUs") if record.get("generation") in GPUS else (
      "chips")
  text = (f"{record['topology']} ({record['chips']} {unit}), "
          f"{peak:.1f} of {record['hbm_per_chip_bytes'] / gib:.0f}")
  if record.get("remat", DEFAULT_REMAT) != DEFAULT_REMAT:
    text += f" with remat={record['remat']}"
  times = ([] if record["plan"] is None else
           [x["roofline_s"] for x in record["plan"]["programs"].values()])
  if times and None not in times:  # "~": costs extrapolated from fewer rows (bytes approximate)
    approx = "~" if record["plan"].get("costs_rows_divisor") else ""
    text += f", {approx}{sum(times):.2f} s"
    if record.get("decode_weights") != DECODE_WEIGHTS:
      text += " †"
  return text


def table(records: list[dict]) -> str:
  """Markdown, as docs/accelerators.md shows it: one row per model and run planned, per TPU
  generation or GPU part planned the cell (`cell_text`: slice, peak GiB per chip of the chip's
  HBM, roofline seconds per update where planned with costs)."""
  gens = [g for g in SLICES if any(r["generation"] == g for r in records)]
  head = "| model | run | " + " | ".join(
      f"{g}: GPUs, peak GiB per GPU" if g in GPUS else
      f"{g}: slice, peak GiB per chip, roofline per update" for g in gens)
  lines = [head + " |", "|---|---|" + "---|" * len(gens)]
  cells = {(r["model"], r["run"], r["generation"]): r for r in records}
  for model in MODELS:
    for run in RUNS:
      row = [cell_text(cells.get((model, run, g))) for g in gens]
      if any(c != "not planned" for c in row):
        lines.append(f"| {model} | {RUN_LABELS[run]} | " + " | ".join(row) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--runs", default=",".join(RUNS))
  parser.add_argument("--generations", default=",".join(SLICES))
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
  parser.add_argument("--memory-only", action="store_true",
                      help="the fitting slice and its memory only (no cost variants, no roofline "
                           "time: the cost compiles take most of the time)")
  parser.add_argument("--skip-existing", action="store_true",
                      help="keep the cells whose JSON is already in --out (a run stopped part "
                           "way resumes where it stopped); a stale one (`stale`) is walked on "
                           "from its slice")
  parser.add_argument("--table", action="store_true",
                      help="print the table from the JSON in --out (no compile)")
  parser.add_argument("--add-costs", action="store_true",
                      help="plan the TPU cells already in --out that have memory only in full "
                           "(their roofline time), walking no slices")
  parser.add_argument("--recost-generate", action="store_true",
                      help="re-plan the `generate` program of the TPU cells planned in full "
                           "whose rollout gathered every layer's weights at every decode step "
                           "(marked †), walking no slices")
  args = parser.parse_args(argv)
  # a GPU plan's fit is judged against the share JAX's allocator takes (GPU_MEM_FRACTION)
  os.environ.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  os.environ["XLA_CLIENT_MEM_FRACTION"] = str(GPU_MEM_FRACTION)
  if args.recost_generate or args.add_costs:
    # Cells already in --out, re-planned in place (no walk): their rollout, or their costs.
    update, what = ((recost_generate, "generate") if args.recost_generate
                    else (add_costs, "costs"))
    for model in args.models.split(","):
      for run in args.runs.split(","):
        for generation in args.generations.split(","):
          path = args.out / f"{model}_{run}_{generation}.json"
          if not path.exists():
            continue
          start = time.perf_counter()
          record = json.loads(path.read_text())
          if update(record, args.out) is not record:
            print(f"{model} {run} {generation}: {what} of {record['topology']} "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
  elif not args.table:
    for model in args.models.split(","):
      for run in args.runs.split(","):
        for generation in args.generations.split(","):
          path = args.out / f"{model}_{run}_{generation}.json"
          after = None
          if args.skip_existing and path.exists():
            after = json.loads(path.read_text())
            if not stale(after):
              continue
          start = time.perf_counter()
          record = plan_cell(model, run, generation, args.out, costs=not args.memory_only,
                             after=after)
          found = record["topology"] or "none"
          print(f"{model} {run} {generation}: {found} "
                f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
  records = [json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))]
  print(table(records))
  return 0


if __name__ == "__main__":
  sys.exit(main())
