"""The machine a benchmark ran on, for its JSON record and its table (shared by the scripts here).

The same ratio to a PyTorch reference has differed by 2x from one host to another (torch's CPU
kernels depend on the instruction sets far more than XLA's), so every record names the CPU model
and the vector instruction sets it offers.
"""

from __future__ import annotations

import os
import platform

VECTOR_PREFIXES = ("sse4", "avx", "fma", "amx", "asimd", "sve")
"""The cpuinfo flags (x86) and features (Arm) recorded: the vector and matrix instruction sets."""


def host_record(cpuinfo: str = "/proc/cpuinfo") -> dict:
  """The host: `{"cpu": model name, "instruction_sets": sorted vector flags, "cores": logical
  CPUs, "machine": architecture, "python": version}`, from `cpuinfo` where there is one (the
  first processor's `model name` and `flags`; Arm's `Model` and `Features`)."""
  model, flags = None, set()
  try:
    with open(cpuinfo) as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and model is None:
          model = value.strip()
        elif key in ("flags", "Features") and not flags:
          flags = set(value.split())
  except OSError:
    pass
  isa = sorted(f for f in flags if f.startswith(VECTOR_PREFIXES))
  return {"cpu": model or platform.processor() or "unknown", "instruction_sets": isa,
          "cores": os.cpu_count(), "machine": platform.machine(),
          "python": platform.python_version()}


def host_line(record: dict | None = None) -> str:
  """One line for a table's header: the CPU model, its cores and its widest instruction sets."""
  r = record or host_record()
  wide = [f for f in r["instruction_sets"] if f.startswith(("avx512", "amx", "sve"))]
  shown = wide or [f for f in r["instruction_sets"] if f.startswith(("avx2", "asimd"))]
  return (f"host: {r['cpu']}, {r['cores']} cores, {r['machine']}"
          f" ({' '.join(shown) if shown else 'no wide vector sets'})")
