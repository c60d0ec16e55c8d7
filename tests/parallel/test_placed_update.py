"""The reference and the reward model on their own 4 devices give the same PPO update as every
role on the policy's 4-device mesh (`jax_ppo.parallel.placement`, `jax_ppo.ppo.placed_steps`), the
arrays live where the docstrings say, and a LoRA policy keeps one copy of its base weights.

The script (`scripts/placed_update.py`) runs on 8 fake CPU devices in a subprocess
(`multidevice.run_on_devices`): the pytest process has one device. The experience-then-update
path (gae) with a split reference and reward model is covered by `test_placed_critic.py`, which
splits them together with the critic (the script still takes `gae`).
"""

import pytest
from multidevice import run_on_devices

TOL = 1e-5
POLICY, OTHER = [0, 1, 2, 3], [4, 5, 6, 7]


@pytest.fixture(scope="module")
def results():
  return run_on_devices("placed_update.py", "grpo,lora")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grpo", "lora"])
def test_split_roles_give_the_shared_update(results, mode):
  r = results[mode]
  # Shared: the four PPOSteps programs as without placement; split: the placed programs.
  assert r["shared_is_ppo_steps"] and r["split_is_placed"]
  assert r["max_score_diff"] < TOL
  assert r["max_ref_diff"] < TOL
  assert r["max_batch_diff"] < TOL
  assert r["max_param_diff"] < TOL
  assert r["max_opt_diff"] < TOL
  loss_shared, loss_split = r["loss"]
  assert abs(loss_shared - loss_split) < TOL
  if mode != "lora":  # the reference differs from the policy: the KL is not trivially 0
    assert abs(r["kl"][0]) > 1e-4 and abs(r["kl"][0] - r["kl"][1]) < TOL
  if mode == "grpo":  # one log-prob path: evaluation (shared and placed) = training's
    assert r["eval_is_placed"]
    assert r["max_eval_train_diff"] < TOL and r["max_placed_eval_train_diff"] < TOL


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grpo", "lora"])
def test_arrays_live_where_documented(results, mode):
  r = results[mode]
  # The reward model's weights on its devices; its scores come back to the policy's.
  assert r["reward_devices"] == OTHER
  assert r["scores_devices"] == POLICY
  # The training state and the batch (with the transferred reference log-probs) on the policy's.
  assert r["state_devices"] == POLICY and r["batch_devices"] == POLICY
  if mode == "lora":
    assert "ref_devices" not in r
  else:
    # The reference weights and its program on the other devices, its log-probs sent back.
    assert r["ref_devices"] == OTHER and r["ref_program_devices"] == OTHER
    assert r["ref_transferred_devices"] == POLICY


@pytest.mark.slow
def test_lora_keeps_one_copy_of_the_base_weights(results):
  r = results["lora"]
  assert r["lora_ref_is_none"]  # the reference is the base with the adapters off
  # Live float32 arrays shaped like the base embedding on the policy's devices: one copy under
  # LoRA (no reference copy, no optimizer moments), against 4 for a full fine-tune (policy,
  # reference, Adam's mu and nu).
  assert r["base_embedding_copies"] == 1
  assert r["full_embedding_copies"] == 4
