"""DPO training on a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices equals the
single-device run (`DPOTrainer(..., mesh=...)`, gradient accumulation 2): parameters, optimizer
state, TRL's metrics and evaluation within 1e-5; the policy and the reference are really split.

The script (`scripts/sharded_step.py`) runs in a subprocess (`tests/parallel/multidevice.py`):
the pytest process has one device.
"""

import pathlib

import pytest

from tests.parallel.multidevice import assert_steps_and_evals_agree, run_on_devices

SCRIPT = pathlib.Path(__file__).resolve().parent / "scripts" / "sharded_step.py"
TOL = 1e-5


@pytest.mark.slow
def test_dpo_steps_on_a_mesh_equal_one_device():
  r = run_on_devices(SCRIPT, "2", "2", "2")
  assert r["devices"] == 8 and r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  assert r["steps"] == [2, 2]
  assert r["param_devices"] == 8
  for specs in (r["param_specs"], r["ref_specs"]):
    assert any("fsdp" in s for s in specs) and any("tensor" in s for s in specs)
  assert r["max_ref_diff"] == 0.0  # the reference never moves
  assert r["max_param_diff"] < TOL and r["max_opt_diff"] < TOL
  assert_steps_and_evals_agree(r, {"train/loss", "rewards/margins", "lr"}, TOL, eval_pairs=12)
