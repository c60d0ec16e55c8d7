"""Datasheet figures of accelerator chips: peak matmul FLOP/s, HBM bandwidth and HBM size.

`chip_spec(device_kind)` finds the row of a `jax.Device.device_kind` ("TPU v5 lite",
"NVIDIA H200", ...): the first `ChipSpec` of `CHIPS` whose `match` occurs in it (case
ignored), so the more specific names come first. The MFU metric of a run divides its model
FLOP/s by `peak_flops(dtype) x chips` (`jax_ppo.ppo.perf.job_peak_flops`), and a memory plan
compares a program's per-chip peak with `hbm_bytes`.

FLOP/s are dense (no structured sparsity) matmul rates: `bf16_flops` for bfloat16/float16
compute; `fp32_flops` as JAX runs a float32 matmul by default, i.e. TF32 tensor cores on NVIDIA
Ampere and later (`jax.default_matmul_precision` "default") and bf16 passes on TPU (a third of
the bf16 rate, the usual three-pass figure). Sources: NVIDIA's H100, H200, A100 and L4
datasheets (SXM parts unless the name says PCIe); Google Cloud's TPU v4, v5e, v5p and v6e
system-architecture pages. The rows are leads, not measurements: a benchmark measures its own
ceilings where it can (`experiments/benchmarks/`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

T = 1e12
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
  """One chip's datasheet figures (per chip, not per host or per slice)."""

  name: str
  """Name used in reports, e.g. "TPU v5e"."""
  match: str
  """Substring of `jax.Device.device_kind` that selects this row."""
  bf16_flops: float
  """Dense bfloat16 matmul peak, FLOP/s."""
  fp32_flops: float
  """float32 matmul peak as JAX runs it by default (TF32 on NVIDIA, bf16 passes on TPU)."""
  hbm_bytes_s: float
  """HBM bandwidth, bytes/s."""
  hbm_bytes: int
  """HBM capacity, bytes."""

  def peak_flops(self, dtype) -> float:
    """The matmul peak for compute in `dtype` (bf16 row for 16-bit floats, else fp32)."""
    return self.bf16_flops if jnp.dtype(dtype).itemsize <= 2 else self.fp32_flops


CHIPS: tuple[ChipSpec, ...] = (
    ChipSpec("H200", "H200", 989 * T, 494.7 * T, 4.8 * T, 141 * 10**9),
    ChipSpec("H100 PCIe", "H100 PCIe", 756 * T, 378 * T, 2.0 * T, 80 * GIB),
    ChipSpec("H100", "H100", 989 * T, 494.7 * T, 3.35 * T, 80 * GIB),
    ChipSpec("A100 80GB PCIe", "A100 80GB PCIe", 312 * T, 156 * T, 1.935 * T, 80 * GIB),
    ChipSpec("A100 SXM4 80GB", "A100-SXM4-80GB", 312 * T, 156 * T, 2.039 * T, 80 * GIB),
    ChipSpec("A100", "A100", 312 * T, 156 * T, 1.555 * T, 40 * GIB),
    ChipSpec("L4", "L4", 121 * T, 60 * T, 0.3 * T, 24 * GIB),
    ChipSpec("TPU v6e", "TPU v6", 918 * T, 918 * T / 3, 1.64 * T, 32 * GIB),
    ChipSpec("TPU v5p", "TPU v5p", 459 * T, 459 * T / 3, 2.765 * T, 95 * GIB),
    ChipSpec("TPU v5e", "TPU v5 lite", 197 * T, 197 * T / 3, 0.819 * T, 16 * GIB),
    ChipSpec("TPU v5e", "TPU v5e", 197 * T, 197 * T / 3, 0.819 * T, 16 * GIB),
    ChipSpec("TPU v4", "TPU v4", 275 * T, 275 * T / 3, 1.2 * T, 32 * GIB),
)
"""The known chips, most specific `match` first."""


def chip_spec(device_kind: str) -> ChipSpec | None:
  """The `CHIPS` row whose `match` occurs in `device_kind` (case ignored), or None (a CPU, or
  a chip not in the table)."""
  kind = device_kind.lower()
  for spec in CHIPS:
    if spec.match.lower() in kind:
      return spec
  return None
