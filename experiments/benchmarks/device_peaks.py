"""Datasheet peaks of accelerators, for MFU and HBM-bandwidth use in the benchmarks' JSON.

`DEVICE_PEAKS` is keyed by a substring of `jax.Device.device_kind` (the first match in table
order wins, so the more specific names come first): dense (no sparsity) matmul FLOP/s in
bfloat16 and in float32 as JAX runs it by default (TF32 tensor cores on NVIDIA Ampere and later,
`jax.default_matmul_precision` "default"), and HBM bytes/s. Sources: NVIDIA's H100/H200, A100
and L4 datasheets (SXM parts unless the name says PCIe), Google's TPU v4/v5e/v5p pages.

`peaks(kind)` returns the row (or None for an unknown device, e.g. a CPU: the benchmarks then
keep their measured matmul peak); `utilisation(...)` turns measured FLOP/s and bytes/s into the
`mfu` and `hbm_bandwidth_use` fractions. The environment variable `BENCH_DEVICE_KIND` replaces
the device kind (accelerator.sh --dry-run sets it, so that a CPU smoke run fills every field).
"""

from __future__ import annotations

import os

T = 1e12
DEVICE_PEAKS: dict[str, dict[str, float]] = {
    "H200": dict(bf16_flops=989 * T, fp32_flops=494.7 * T, hbm_bytes_s=4.8 * T),
    "H100 PCIe": dict(bf16_flops=756 * T, fp32_flops=378 * T, hbm_bytes_s=2.0 * T),
    "H100": dict(bf16_flops=989 * T, fp32_flops=494.7 * T, hbm_bytes_s=3.35 * T),
    "A100 80GB PCIe": dict(bf16_flops=312 * T, fp32_flops=156 * T, hbm_bytes_s=1.935 * T),
    "A100-SXM4-80GB": dict(bf16_flops=312 * T, fp32_flops=156 * T, hbm_bytes_s=2.039 * T),
    "A100": dict(bf16_flops=312 * T, fp32_flops=156 * T, hbm_bytes_s=1.555 * T),
    "L4": dict(bf16_flops=121 * T, fp32_flops=60 * T, hbm_bytes_s=0.3 * T),
    "TPU v5p": dict(bf16_flops=459 * T, fp32_flops=459 * T / 3, hbm_bytes_s=2.765 * T),
    "TPU v5 lite": dict(bf16_flops=197 * T, fp32_flops=197 * T / 3, hbm_bytes_s=0.819 * T),
    "TPU v4": dict(bf16_flops=275 * T, fp32_flops=275 * T / 3, hbm_bytes_s=1.2 * T),
}


def peaks(device_kind: str) -> dict[str, float] | None:
  """The `DEVICE_PEAKS` row whose key occurs in `device_kind`, or None."""
  for key, row in DEVICE_PEAKS.items():
    if key.lower() in device_kind.lower():
      return {"table_key": key, **row}
  return None


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
