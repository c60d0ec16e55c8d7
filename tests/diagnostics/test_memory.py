"""The compiled update's memory analysis on 8 fake CPU devices: FSDP cuts the per-device bytes
of parameters and optimizer state about 8x against plain data parallelism (issue 11 item 7;
`experiments/benchmarks/sharding_memory.py` gives the figures for real model shapes)."""

import pytest

from tests.parallel.multidevice import run_on_devices


@pytest.mark.slow
def test_fsdp_cuts_parameter_and_optimizer_bytes():
  r = run_on_devices("memory_tiny.py")
  rep, fsdp = r["replicated"], r["fsdp"]
  # Norm gains and the [D, 1] value head stay replicated, so slightly under 8x on this tiny
  # model (their share vanishes for real model sizes).
  assert 6.5 < rep["params"] / fsdp["params"] <= 8
  assert 6.5 < rep["optimizer"] / fsdp["optimizer"] <= 8
  assert rep["reference"] == rep["params"] and fsdp["reference"] == fsdp["params"]
  # The program's arguments hold the parameters and Adam moments of this device.
  for m in (rep, fsdp):
    assert m["arguments"] >= m["params"] + m["optimizer"]
    assert m["activations"] > 0
  assert fsdp["arguments"] < rep["arguments"] / 4
