"""experiments/benchmarks/accelerator.sh and device_peaks.py: the MFU / HBM-use arithmetic
against the datasheet rows, and the script's CPU dry run end to end (tiny shapes; the real run
needs a GPU)."""

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
  # The rows are the library's (jax_ppo.parallel.chips; its lookup: tests/parallel/test_chips.py).
  assert dp.peaks("NVIDIA H200")["hbm_bytes_s"] == pytest.approx(4.8e12)
  assert dp.peaks("NVIDIA H100 PCIe")["table_key"] == "H100 PCIe"
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
  env = {**os.environ, "PYTHON": sys.executable, "STEP_TIMEOUT": "900", "BUDGET": "3000",
         "XLA_FLAGS": flags.strip()}
  proc = subprocess.run(["bash", str(BENCH / "accelerator.sh"), "--dry-run", str(tmp_path)],
                        env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["dry_run"] is True and summary["device"].startswith("cpu")
  assert {k: v["rc"] for k, v in summary["steps"].items()} == {
      "ppo_bf16": 0, "rollout_bf16": 0, "forward": 0, "rollout_bf16w": 0, "ppo_fp32": 0}
  # The dry run computes the fractions against the H200 row (BENCH_DEVICE_KIND), each against
  # the peak of the step's compute dtype.
  for name, dtype in (("rollout_bf16", "bfloat16"), ("rollout_bf16w", "bfloat16")):
    record = json.loads((tmp_path / f"{name}.json").read_text())
    rollout = record["jax_ppo"]["accelerator"]
    assert rollout["peak_table_key"] == "H200" and rollout["peak_flops"] == pytest.approx(989e12)
    assert 0 < rollout["mfu"] < 1 and 0 < rollout["hbm_bandwidth_use"] < 1
    assert record["config"]["dtype"] == dtype
  # bfloat16 weights: half the weight bytes per decode step of the float32 ones.
  floors = [json.loads((tmp_path / f"{n}.json").read_text())["memory_floor"]
            for n in ("rollout_bf16", "rollout_bf16w")]
  assert floors[1]["bytes_per_decode_step"] < floors[0]["bytes_per_decode_step"]
  forward = json.loads((tmp_path / "forward.json").read_text())["shapes"]["tiny"]["jax"]
  assert 0 < forward["train_accelerator"]["mfu"] < 1
  for name, peak in (("ppo_bf16", 989e12), ("ppo_fp32", 494.7e12)):
    ppo = json.loads((tmp_path / f"{name}.json").read_text())["jax_ppo"]["accelerator"]
    assert 0 < ppo["mfu"] < 1 and ppo["peak_flops"] == pytest.approx(peak)
  assert summary["host_cpu"] and summary["versions"].startswith("jax ")
