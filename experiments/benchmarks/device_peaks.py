"""Datasheet peaks of accelerators, for MFU and HBM-bandwidth use in the benchmarks' JSON.

`DEVICE_PEAKS` is the library's datasheet table (`jax_ppo.diagnostics.chips.CHIPS`, which also
gives `jax-ppo plan` its HBM sizes) keyed by chip name: dense (no sparsity) matmul FLOP/s in
bfloat16 and in float32 as JAX runs it by default (TF32 tensor cores on NVIDIA Ampere and later,
`jax.default_matmul_precision` "default"), and HBM bytes/s.

`peaks(kind)` returns the row of a `jax.Device.device_kind` (or None for an unknown device, e.g.
a CPU: the benchmarks then keep their measured matmul peak); `utilisation(...)` turns measured
FLOP/s and bytes/s into the `mfu` and `hbm_bandwidth_use` fractions. The environment variable
`BENCH_DEVICE_KIND` replaces the device kind (accelerator.sh --dry-run sets it, so that a CPU smoke
run fills every field).
"""

from __future__ import annotations

import os

from jax_ppo.diagnostics.chips import CHIPS, chip_for

DEVICE_PEAKS: dict[str, dict[str, float]] = {
    chip.name: dict(bf16_flops=chip.bf16_flops, fp32_flops=chip.fp32_flops,
                    hbm_bytes_s=chip.hbm_bytes_s)
    for chip in CHIPS
}


def peaks(device_kind: str) -> dict[str, float] | None:
  """The `DEVICE_PEAKS` row of `device_kind` (`chips.chip_for`), or None."""
  chip = chip_for(device_kind)
  return None if chip is None else {"table_key": chip.name, **DEVICE_PEAKS[chip.name]}


def utilisation(device_kind: str, *, dtype: str = "float32", flops_per_s: float | None = None,
                bytes_per_s: float | None = None) -> dict:
  """`{"device_kind", "peak_flops", "mfu", "peak_hbm_bytes_s", "hbm_bandwidth_use"}` from
  measured rates; the fractions are None when the device or the rate is unknown."""
  device_kind = os.environ.get("BENCH_DEVICE_KIND", device_kind)
  row = peaks(device_kind)
  out = {"device_kind": device_kind, "peak_table_key": row and row["table_key"],
         "peak_flops": None, "mfu": None, "peak_hbm_bytes_s": None, "hbm_bandwidth_use": None}
  if row is None:
    return out
  out["peak_flops"] = row["bf16_flops" if dtype in ("bfloat16", "float16") else "fp32_flops"]
  out["peak_hbm_bytes_s"] = row["hbm_bytes_s"]
  if flops_per_s is not None:
    out["mfu"] = flops_per_s / out["peak_flops"]
  if bytes_per_s is not None:
    out["hbm_bandwidth_use"] = bytes_per_s / out["peak_hbm_bytes_s"]
  return out
