"""DPO training on a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices equals the
single-device run (`DPOTrainer(..., mesh=...)`, gradient accumulation 2): parameters, optimizer
state, TRL's metrics and evaluation within 1e-5; the policy and the reference are really split.
With `precompute_reference` on a (data=2, tensor=2) mesh the cached reference log-probs give the
single-device on-the-fly run's results, and the reference is freed.

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


@pytest.mark.slow
def test_dpo_with_a_precomputed_reference_on_a_mesh_equals_one_device():
  r = run_on_devices(SCRIPT, "2", "1", "2", "1", devices=4)
  assert r["devices"] == 4 and r["steps"] == [2, 2]
  assert r["reference_freed"] and r["reference_s"] > 0 and r["ref_specs"] == []
  assert r["max_param_diff"] < TOL and r["max_opt_diff"] < TOL
  # At the first step the policy is the reference: on the fly both log-probs come from one
  # program and every margin is exactly 0 (no wins); the cached ones come from another program,
  # so a margin is +-1e-7 and a tie may count as a win. Accuracy is compared from step 2 on.
  first = [h[0] for h in r["history"]]
  assert all(abs(h["rewards/margins"]) < TOL for h in first)
  assert first[0]["rewards/accuracies"] == 0.0
  for h in first:
    h.pop("rewards/accuracies")
  assert_steps_and_evals_agree(r, {"train/loss", "rewards/margins", "lr"}, TOL, eval_pairs=12)
