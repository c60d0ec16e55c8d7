"""experiments/scale_check.py at a smaller size: the update on 1 device, on 8 fake devices
(data=2, fsdp=2, tensor=2) and over 2 processes x 4 devices agree within 1e-4, and the JSON report
has the keys issue #11 item 6 names."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "scale_check.py"
# Compile-bound (a few steps of a tiny model) and every case runs under the same flags: XLA:CPU's
# cheaper code generation shortens the test.
CHEAP_CODEGEN = " ".join([os.environ.get("XLA_FLAGS", ""),
                          "--xla_backend_optimization_level=0"]).strip()


@pytest.mark.slow
def test_scale_check_agrees_and_reports(tmp_path):
  out = tmp_path / "scale.json"
  run = subprocess.run(
      [sys.executable, str(SCRIPT), "--json", str(out), "--hidden-size", "16", "--num-layers",
       "1", "--max-new-tokens", "4", "--ppo-epochs", "1", "--timeout", "300"],
      capture_output=True, text=True, timeout=600, cwd=SCRIPT.parents[1],
      env={**os.environ, "XLA_FLAGS": CHEAP_CODEGEN,
           "PYTHONPATH": os.pathsep.join(  # this checkout's jax_ppo
          filter(None, [str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH")]))},
  )
  assert run.returncode == 0, run.stdout + run.stderr
  report = json.loads(out.read_text())
  assert set(report) == {"max_param_diff_8dev", "max_param_diff_2proc", "loss",
                         "bytes_per_device"}
  assert set(report["loss"]) == set(report["bytes_per_device"]) == {"1dev", "8dev", "2proc"}
  assert report["max_param_diff_8dev"] < 1e-4 and report["max_param_diff_2proc"] < 1e-4
  for case in ("8dev", "2proc"):
    assert report["loss"][case] == pytest.approx(report["loss"]["1dev"], abs=1e-4)
  # fsdp=2 x tensor=2 shards the parameters and optimizer state: less memory per device.
  assert report["bytes_per_device"]["8dev"] < report["bytes_per_device"]["1dev"]
  lines = run.stdout.splitlines()
  assert lines[0].split()[:2] == ["case", "devices"] and lines[-1].startswith("OK:")
  assert any(line.startswith("(c) 2 processes x 4") for line in lines)
