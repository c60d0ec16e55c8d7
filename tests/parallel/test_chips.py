"""Tests of jax_ppo.parallel.chips: device kinds as JAX names them find their datasheet row,
the more specific name first, and the dtype picks the peak."""

import pytest

from jax_ppo.parallel.chips import CHIPS, chip_for


@pytest.mark.parametrize("kind, name", [
    ("NVIDIA H200", "H200"),
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("TPU v5 lite", "TPU v5 lite"),
    ("TPU v5", "TPU v5p"),
    ("TPU v6 lite", "TPU v6 lite"),
    ("TPU v4", "TPU v4"),
])
def test_device_kinds_find_their_row(kind, name):
  assert chip_for(kind).name == name


def test_unknown_devices_have_no_row():
  assert chip_for("cpu") is None and chip_for("Some Accelerator 9000") is None


def test_dtype_picks_the_peak_and_rows_are_consistent():
  h200 = chip_for("NVIDIA H200")
  assert h200.peak_flops("bfloat16") == h200.peak_flops("float16") == pytest.approx(989e12)
  assert h200.peak_flops("float32") == pytest.approx(494.7e12)
  assert h200.hbm_bytes_s == pytest.approx(4.8e12)
  assert chip_for("TPU v5 lite").hbm_bytes == 16 * 2**30
  for spec in CHIPS:
    assert spec.bf16_flops >= spec.fp32_flops > 0 and spec.hbm_bytes_s > 0
    assert spec.hbm_bytes > 8 * 2**30
