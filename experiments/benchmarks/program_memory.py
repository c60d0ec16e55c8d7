"""Per-program memory of one planning-table run on TPU slices, as XLA's TPU compiler reports it:
arguments, outputs, aliased and temporary bytes per chip (`compiled.memory_analysis()`), the
resident arrays the program does not take, and the peak (`jax_ppo.diagnostics.plan`), or what
XLA said when it refused the program for want of HBM.

It shows where a run's memory goes when the planning table's walk
(`tpu_planning_table.py`, same run shapes: `run_shape_for`) finds no fit, and whether a per-chip
figure grows with the slice: compiled for a chip with HBM to spare (v5p), the temporaries of a
run at one response per chip stay flat as the slice grows; compiled for a chip that is short
(v5e), XLA's memory-saving passes squeeze them by different amounts on different slices.

    pip install -e ".[tpu]"   # a virtual environment of its own
    python experiments/benchmarks/program_memory.py --model qwen3-8b --run ppo \\
        --topologies v5p:4x4x4,v5p:4x4x8,v5e:8x8,v5e:8x16 [--remat full] [--programs NAME,...]
        [--out results/tpu_planning_memory/NAME.json]

Writes JSON (the host, versions, and per topology the run's rows and resident bytes and per
program the bytes or the refusal) and prints a table in GiB per chip.
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
from host import host_line, host_record  # noqa: E402
from tpu_planning_table import MODELS, RUNS, run_shape_for  # noqa: E402

GIB = 2.0**30


def program_memory(model: str, run: str, topology: str, *, remat: str | None = None,
                   programs: list[str] | None = None) -> dict:
  """The run's rows, its resident bytes per chip and, per program, XLA's memory analysis (or
  its refusal) on `topology`."""
  from jax_ppo.diagnostics import ppo_plan
  from jax_ppo.diagnostics.plan import DoesNotFit, compile_program, peak_bytes, topology_devices
  from jax_ppo.diagnostics.topology import slice_mesh

  devices = topology_devices(topology)
  shape = run_shape_for(model, run, len(devices))
  if remat is not None:
    shape = dataclasses.replace(shape, remat=remat)
  mesh = slice_mesh(devices, shape.mesh, topology=topology)
  planned = ppo_plan.RunPrograms(shape, mesh)
  result = {"topology": topology, "chips": len(devices), "rows": shape.ppo.batch_size,
            "remat": shape.remat, "resident_bytes_per_chip": planned.resident_bytes,
            "programs": {}}
  for name, program in planned.programs().items():
    if programs and name not in programs:
      continue
    start = time.perf_counter()
    try:
      memory = compile_program(name, program, topology=topology).memory_analysis()
    except DoesNotFit as e:
      result["programs"][name] = {"refused": str(e).splitlines()[0],
                                  "required_bytes": e.required_bytes,
                                  "temporaries_only": e.temporaries_only,
                                  "compile_s": round(time.perf_counter() - start, 1)}
      continue
    entry = {"argument_bytes": int(memory.argument_size_in_bytes),
             "output_bytes": int(memory.output_size_in_bytes),
             "alias_bytes": int(memory.alias_size_in_bytes),
             "temp_bytes": int(memory.temp_size_in_bytes),
             "outside_bytes": int(program.outside_bytes)}
    entry["peak_bytes_per_chip"] = peak_bytes(memory, program.outside_bytes)
    entry["compile_s"] = round(time.perf_counter() - start, 1)
    result["programs"][name] = entry
  return result


def table(results: list[dict]) -> str:
  """Markdown, GiB per chip: one row per topology and program."""
  lines = ["| slice | rows | remat | program | arguments | outputs - aliased | temporaries | "
           "resident, not taken | peak |", "|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    for name, p in r["programs"].items():
      head = f"| {r['topology']} | {r['rows']} | {r['remat']} | {name} | "
      if "refused" in p:
        what = "temporaries" if p["temporaries_only"] else "total"
        need = ("?" if p["required_bytes"] is None else
                f"{p['required_bytes'] / GIB:.2f} ({what})")
        lines.append(head + f"refused: needs {need} | | | | |")
        continue
      lines.append(head + " | ".join(f"{x / GIB:.2f}" for x in (
          p["argument_bytes"], p["output_bytes"] - p["alias_bytes"], p["temp_bytes"],
          p["outside_bytes"], p["peak_bytes_per_chip"])) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="qwen3-8b", choices=MODELS)
  parser.add_argument("--run", default="ppo", choices=RUNS)
  parser.add_argument("--topologies", default="v5p:4x4x4,v5p:4x4x8,v5e:8x8,v5e:8x16")
  parser.add_argument("--remat", default=None, help="default: the run's (the default remat)")
  parser.add_argument("--programs", default=None, help="comma-separated; default: all")
  parser.add_argument("--out", type=pathlib.Path, default=None)
  args = parser.parse_args(argv)
  programs = args.programs.split(",") if args.programs else None
  results = [program_memory(args.model, args.run, t, remat=args.remat, programs=programs)
             for t in args.topologies.split(",")]
  record = {"model": args.model, "run": args.run, "results": results, "host": host_record(),
            "jax": __import__("jax").__version__}
  if args.out is not None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
  print(f"{args.model} {args.run}, GiB per chip; {host_line(record['host'])}")
  print(table(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
