"""Datasheet figures of accelerator chips: matmul peak, HBM bandwidth and HBM size per chip.

`CHIPS` lists one `Chip` per part: dense (no sparsity) matmul FLOP/s in bfloat16 and in float32
as JAX runs it by default (TF32 tensor cores on NVIDIA Ampere and later; three bfloat16 passes on
TPUs), HBM bytes/s and HBM bytes. Sources: NVIDIA's H100/H200, A100 and L4 datasheets (SXM parts
unless the name says PCIe), Google Cloud's TPU v4 / v5e / v5p / v6e pages. `chip_for(kind)` finds
the row of a `jax.Device.device_kind` (TPU v5e reports "TPU v5 lite", v5p "TPU v5", v6e
"TPU v6 lite").

The MFU metric of a run divides its model FLOP/s by one chip's `peak_flops` times the chips
(`jax_ppo.ppo.perf.job_peak_flops`); `jax-ppo plan` (`jax_ppo.diagnostics.plan`) compares a
program's per-chip peak with `hbm_bytes`. The roofline lower bound on a program's time on one
chip (`roofline_seconds`) is

.. math::  t \\ge \\max(F / F_{peak},\\; Q / W_{HBM})

with `F` its FLOPs and `Q` its HBM bytes accessed on that chip.
"""

from __future__ import annotations

import dataclasses

T = 1e12
GiB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
  """One accelerator part's datasheet row."""

  name: str
  """Its name in this table (a substring of its `device_kind`, e.g. "TPU v5 lite")."""
  kinds: tuple[str, ...]
  """Lower-case substrings of `jax.Device.device_kind` that identify it (first match wins)."""
  bf16_flops: float
  """Dense bfloat16 matmul FLOP/s."""
  fp32_flops: float
  """Dense float32 matmul FLOP/s as JAX runs it by default."""
  hbm_bytes_s: float
  """HBM bandwidth, bytes/s."""
  hbm_bytes: int
  """HBM capacity, bytes."""

  def peak_flops(self, dtype: str) -> float:
    """The matmul peak of the compute dtype ("bfloat16" and "float16": the bfloat16 row)."""
    return self.bf16_flops if dtype in ("bfloat16", "float16") else self.fp32_flops


CHIPS: tuple[Chip, ...] = (
    Chip(name="H200", kinds=("h200",), bf16_flops=989 * T, fp32_flops=494.7 * T,
         hbm_bytes_s=4.8 * T, hbm_bytes=141 * GiB),
    Chip(name="H100 PCIe", kinds=("h100 pcie",), bf16_flops=756 * T, fp32_flops=378 * T,
         hbm_bytes_s=2.0 * T, hbm_bytes=80 * GiB),
    Chip(name="H100", kinds=("h100",), bf16_flops=989 * T, fp32_flops=494.7 * T,
         hbm_bytes_s=3.35 * T, hbm_bytes=80 * GiB),
    Chip(name="A100 80GB PCIe", kinds=("a100 80gb pcie",), bf16_flops=312 * T,
         fp32_flops=156 * T, hbm_bytes_s=1.935 * T, hbm_bytes=80 * GiB),
    Chip(name="A100-SXM4-80GB", kinds=("a100-sxm4-80gb",), bf16_flops=312 * T,
         fp32_flops=156 * T, hbm_bytes_s=2.039 * T, hbm_bytes=80 * GiB),
    Chip(name="A100", kinds=("a100",), bf16_flops=312 * T, fp32_flops=156 * T,
         hbm_bytes_s=1.555 * T, hbm_bytes=40 * GiB),
    Chip(name="L4", kinds=("l4",), bf16_flops=121 * T, fp32_flops=60 * T, hbm_bytes_s=0.3 * T,
         hbm_bytes=24 * GiB),
    Chip(name="TPU v6 lite", kinds=("tpu v6 lite", "tpu v6e"), bf16_flops=918 * T,
         fp32_flops=918 * T / 3, hbm_bytes_s=1.64 * T, hbm_bytes=32 * GiB),
    Chip(name="TPU v5 lite", kinds=("tpu v5 lite", "tpu v5e"), bf16_flops=197 * T,
         fp32_flops=197 * T / 3, hbm_bytes_s=0.819 * T, hbm_bytes=16 * GiB),
    Chip(name="TPU v5p", kinds=("tpu v5p", "tpu v5"), bf16_flops=459 * T,
         fp32_flops=459 * T / 3, hbm_bytes_s=2.765 * T, hbm_bytes=95 * GiB),
    Chip(name="TPU v4", kinds=("tpu v4",), bf16_flops=275 * T, fp32_flops=275 * T / 3,
         hbm_bytes_s=1.2 * T, hbm_bytes=32 * GiB),
)
"""The datasheet table, more specific names first ("TPU v5 lite" before "TPU v5")."""


def chip_for(device_kind: str) -> Chip | None:
  """The first `CHIPS` row one of whose `kinds` occurs in `device_kind` (case-insensitive), or
  None (a CPU, an unknown part)."""
  kind = device_kind.lower()
  for chip in CHIPS:
    if any(k in kind for k in chip.kinds):
      return chip
  return None


def roofline_seconds(flops: float, bytes_accessed: float, chip: Chip, *, dtype: str) -> float:
  """`max(flops / peak, bytes_accessed / bandwidth)` on one `chip` (module docstring)."""
  return max(flops / chip.peak_flops(dtype), bytes_accessed / chip.hbm_bytes_s)


__all__ = ["CHIPS", "Chip", "chip_for", "roofline_seconds"]
