"""experiments/benchmarks/accelerator.sh and its datasheet table (device_peaks.py): the device
lookup, the MFU / HBM-use arithmetic, and the script's CPU dry run end to end (tiny shapes; the
real run needs a GPU)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "benchmarks"


def _device_peaks():
  spec = importlib.util.spec_from_file_location("device_peaks", BENCH / "device_peaks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_device_table_lookup_and_fractions(monkeypatch):
  dp = _device_peaks()
  assert dp.peaks("NVIDIA H200")["hbm_bytes_s"] == pytest.approx(4.8e12)
  assert dp.peaks("NVIDIA H100 80GB HBM3")["table_key"] == "H100"
  assert dp.peaks("NVIDIA H100 PCIe")["table_key"] == "H100 PCIe"
  assert dp.peaks("NVIDIA A100-SXM4-80GB")["hbm_bytes_s"] == pytest.approx(2.039e12)
  assert dp.peaks("cpu") is None
  monkeypatch.delenv("BENCH_DEVICE_KIND", raising=False)
  u = dp.utilisation("NVIDIA H200", dtype="bfloat16", flops_per_s=494.5e12, bytes_per_s=2.4e12)
  assert u["mfu"] == pytest.approx(0.5) and u["hbm_bandwidth_use"] == pytest.approx(0.5)
  assert dp.utilisation("NVIDIA H200", flops_per_s=494.7e12)["mfu"] == pytest.approx(1.0)  # TF32
  cpu = dp.utilisation("cpu", flops_per_s=1e9)
  assert cpu["mfu"] is None and cpu["peak_flops"] is None


@pytest.mark.slow
def test_accelerator_script_dry_run(tmp_path):
  # The dry run checks the plumbing, not the figures: XLA:CPU's cheaper code generation halves
  # its compile-bound runs.
  flags = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"])
  env = {**os.environ, "PYTHON": sys.executable, "STEP_TIMEOUT": "900", "XLA_FLAGS": flags.strip()}
  proc = subprocess.run(["bash", str(BENCH / "accelerator.sh"), "--dry-run", str(tmp_path)],
                        env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["dry_run"] is True and summary["device"].startswith("cpu")
  assert {k: v["rc"] for k, v in summary["steps"].items()} == {
      "rollout": 0, "forward": 0, "ppo_step": 0}
  # The dry run computes the fractions against the H200 row (BENCH_DEVICE_KIND).
  rollout = json.loads((tmp_path / "rollout.json").read_text())["jax_ppo"]["accelerator"]
  assert rollout["peak_table_key"] == "H200"
  assert 0 < rollout["mfu"] < 1 and 0 < rollout["hbm_bandwidth_use"] < 1
  forward = json.loads((tmp_path / "forward.json").read_text())["shapes"]["tiny"]["jax"]
  assert 0 < forward["train_accelerator"]["mfu"] < 1
  ppo = json.loads((tmp_path / "ppo_step.json").read_text())["jax_ppo"]["accelerator"]
  assert 0 < ppo["mfu"] < 1
