"""A PPO update on a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices equals the
single-device update (`jax_ppo.parallel`, `PPOSteps(mesh=...)`, `Sampler(mesh=...)`).

The script (`scripts/sharded_update.py`) runs in a subprocess (`multidevice.run_on_devices`):
the pytest process has one device.
"""

import pytest
from multidevice import run_on_devices

TOL = 1e-5


@pytest.fixture(scope="module")
def results():
  return run_on_devices("sharded_update.py", "gae,grpo", "2", "2", "2")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gae", "grpo"])
def test_update_on_mesh_equals_single_device(results, mode):
  r = results[mode]
  assert r["devices"] == 8 and r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  # The parameters really are split (not replicated on every device) ...
  assert r["param_devices"] == 8
  assert any("fsdp" in s for s in r["param_specs"]) and any("tensor" in s for s in r["param_specs"])
  assert r["batch_spec"] == "P(('data', 'fsdp'), None)"
  # ... and the update is the single-device one: global statistics (whitening, group
  # advantages, masked means, the adaptive KL controller) are taken over the whole batch.
  assert r["max_param_diff"] < TOL
  assert r["max_opt_diff"] < TOL
  assert r["max_batch_diff"] < TOL
  assert r["max_score_diff"] < TOL
  loss1, loss8 = r["loss"]
  assert abs(loss1 - loss8) < TOL
  assert abs(r["adv_std"][0] - r["adv_std"][1]) < TOL
  assert abs(r["kl_coef_next"][0] - r["kl_coef_next"][1]) < TOL
  # The sharded sampler draws the same tokens from the same key.
  assert r["rollout_equal"]
  assert r["rollout_logprob_diff"] < TOL
