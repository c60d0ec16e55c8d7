"""Reward-model training on a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices equals the
single-device run (`RewardModelTrainer(..., mesh=...)`, gradient accumulation 2): parameters,
optimizer state, metrics, evaluation and scores within 1e-5.

The script (`scripts/sharded_step.py`) runs in a subprocess (`tests/parallel/multidevice.py`):
the pytest process has one device.
"""

import pathlib

import pytest

from tests.parallel.multidevice import assert_steps_and_evals_agree, run_on_devices

SCRIPT = pathlib.Path(__file__).resolve().parent / "scripts" / "sharded_step.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def result():
  return run_on_devices(SCRIPT, "2", "2", "2")


@pytest.mark.slow
def test_reward_model_steps_on_a_mesh_equal_one_device(result):
  r = result
  assert r["devices"] == 8 and r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  assert r["steps"] == [2, 2]
  # The parameters really are split (not replicated on every device) ...
  assert r["param_devices"] == 8
  assert any("fsdp" in s for s in r["param_specs"]) and any("tensor" in s for s in r["param_specs"])
  # ... and the steps are the single-device ones: the loss is the mean over the global batch.
  assert r["max_param_diff"] < TOL
  assert r["max_opt_diff"] < TOL
  assert_steps_and_evals_agree(r, {"train/loss", "train/accuracy", "lr"}, TOL, eval_pairs=12)
  assert r["max_score_diff"] < TOL


@pytest.mark.slow
def test_a_run_on_a_mesh_resumes_on_another_mesh_like_the_uninterrupted_run(tmp_path):
  r = run_on_devices(pathlib.Path(SCRIPT).parent / "mesh_resume.py", str(tmp_path / "run"))
  # Stopped at 2, restored at 2 into (data=2, fsdp=4, tensor=1) shardings, finished at 4.
  assert r["steps"] == [2, 2, 4, 4]
  assert r["resumed_mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
  assert r["param_mesh_shapes"] == ["{'data': 2, 'fsdp': 4, 'tensor': 1}"]
  assert any("fsdp" in s for s in r["param_specs"])
  assert r["moved"] > 1e-3
  assert r["max_param_diff"] < TOL and r["max_opt_diff"] < TOL
  assert r["logged_steps"] == [1, 2, 3, 4]
