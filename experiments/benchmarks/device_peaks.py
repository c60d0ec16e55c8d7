"""MFU and HBM-bandwidth use of a benchmark against the card's datasheet peaks.

The table is the library's (`jax_ppo.parallel.chips.CHIPS`, found by `chip_for` from a
`jax.Device.device_kind`): dense matmul FLOP/s in bfloat16 and in float32 as JAX runs it by
default (TF32 on NVIDIA Ampere and later), and HBM bytes/s. `peaks(kind)` returns the row as a
dict (None for an unknown device, e.g. a CPU: the benchmarks then keep their measured matmul
peak); `utilisation(...)` turns measured FLOP/s and bytes/s into the `mfu` and
`hbm_bandwidth_use` fractions. The environment variable `BENCH_DEVICE_KIND` replaces the device
kind (accelerator.sh --dry-run sets it, so that a CPU smoke run fills every field).
"""

from __future__ import annotations

import os

from jax_ppo.parallel.chips import Chip, chip_for


def peaks(device_kind: str) -> dict[str, float] | None:
  """`{"table_key", "bf16_flops", "fp32_flops", "hbm_bytes_s"}` of the chip, or None."""
  chip = chip_for(device_kind)
  if chip is None:
    return None
  return {"table_key": chip.name, "bf16_flops": chip.bf16_flops, "fp32_flops": chip.fp32_flops,
          "hbm_bytes_s": chip.hbm_bytes_s}


def bench_chip(device_kind: str) -> tuple[str, Chip | None]:
  """`(kind, row)`: the device kind the benchmark reports (`BENCH_DEVICE_KIND` when set, else
  `device_kind`) and its datasheet row (None for an unknown device, e.g. a CPU)."""
  device_kind = os.environ.get("BENCH_DEVICE_KIND", device_kind)
  return device_kind, chip_for(device_kind)


def utilisation(device_kind: str, *, dtype: str = "float32", flops_per_s: float | None = None,
                bytes_per_s: float | None = None) -> dict:
  """`{"device_kind", "peak_flops", "mfu", "peak_hbm_bytes_s", "hbm_bandwidth_use"}` from
  measured rates; the fractions are None when the device or the rate is unknown."""
  device_kind, chip = bench_chip(device_kind)
  out = {"device_kind": device_kind, "peak_table_key": chip and chip.name,
         "peak_flops": None, "mfu": None, "peak_hbm_bytes_s": None, "hbm_bandwidth_use": None}
  if chip is None:
    return out
  out["peak_flops"] = chip.peak_flops(dtype)
  out["peak_hbm_bytes_s"] = chip.hbm_bytes_s
  if flops_per_s is not None:
    out["mfu"] = flops_per_s / out["peak_flops"]
  if bytes_per_s is not None:
    out["hbm_bandwidth_use"] = bytes_per_s / out["peak_hbm_bytes_s"]
  return out
