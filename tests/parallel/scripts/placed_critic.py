"""One PPO update with every role on the policy's 4-device mesh, and with the critic on devices
4-5 and the reference and reward model on devices 6-7 (`jax_ppo.ppo.placed_critic`).

Usage: `placed_critic.py MODES CHECKPOINT_DIR`, MODES comma-separated among `gae` (experience
then update over 2 minibatches of 2 microbatches, 2 epochs, gradient clipping off, then a
replayed batch; the split state is saved and restored) and `fused` (the fused
experience_update, 3 epochs with an early stop after the second, clipping on with the norms
under it). Prints JSON `{mode: result}`: the largest differences between the two runs, where
each array lives (device ids), the early-stop metrics and, for `gae`, the checkpoint round
trips.
"""

import faulthandler
import json
import pathlib
import sys

import jax
import numpy as np
from flax import nnx
from tiny_setup import (
  MODEL,
  PAD,
  TARGET,
  max_abs_diff,
  one_update,
  policy,
  prompts,
  rollout_and_scores,
)

from jax_ppo.checkpoint import RunCheckpointer
from jax_ppo.models.heads import ScalarModel, value_model_from_reward_model
from jax_ppo.parallel import MeshConfig, shard_params
from jax_ppo.parallel.placement import PlacementConfig, RoleMesh, make_placement
from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling, PPOTrainer
from jax_ppo.ppo.placed_critic import split_state
from jax_ppo.ppo.placed_steps import PlacedSteps

POLICY_MESH = MeshConfig(data=2, fsdp=2)


def placements():
  shared = make_placement(PlacementConfig(policy_devices=(0, 4)), POLICY_MESH)
  frozen = RoleMesh(devices=(6, 8), mesh=MeshConfig(data=2))
  split = make_placement(PlacementConfig(
      policy_devices=(0, 4), reference=frozen, reward=frozen,
      critic=RoleMesh(devices=(4, 6), mesh=MeshConfig(data=1, fsdp=2))), POLICY_MESH)
  return shared, split


def build(mode: str, placement):
  common = dict(sampling=PPOSampling(max_new_tokens=6, temperature=1.0, stop_token_ids=(TARGET,),
                                    pad_token_id=PAD),
                total_updates=4, reward_clip=None,
                kl_controller="adaptive", kl_target=0.01, kl_horizon=10, vf_coef=0.5)
  opt = dict(learning_rate=1e-3, lr_schedule="constant")
  if mode == "gae":
    config = PPOConfig(batch_size=8, num_minibatches=2, gradient_accumulation_steps=2,
                       ppo_epochs=2, optimizer=PPOOptimizer(max_grad_norm=None, **opt),
                       replay_buffer_size=2, **common)
  else:
    config = PPOConfig(batch_size=8, ppo_epochs=3, target_kl=1e-7,
                       optimizer=PPOOptimizer(max_grad_norm=1e4, **opt), **common)
  rm = ScalarModel(MODEL, rngs=nnx.Rngs(5))
  model = policy()
  nnx.update(model, shard_params(nnx.state(model), placement.policy))
  return PPOTrainer(config, model, reward=rm, prompts=prompts(),
                    value_model=value_model_from_reward_model(rm), placement=placement)


def devices_of(tree) -> list[int]:
  return sorted({d.id for x in jax.tree.leaves(tree) for d in x.sharding.device_set})


def layout(state) -> dict[str, list[int]]:
  """Device ids of the state's parts: the policy's (and its half of the optimizer moments),
  the critic's (and its half), and the optimizer's step counters."""
  policy_state, value_opt, _ = split_state(state)
  counters = [x for x in jax.tree.leaves(policy_state.opt_state) if x.ndim == 0]
  moments = [x for x in jax.tree.leaves(value_opt) if x.ndim > 0]
  return {"policy": devices_of(policy_state.policy),
          "policy_moments": devices_of([x for x in jax.tree.leaves(policy_state.opt_state)
                                        if x.ndim > 0]),
          "value": devices_of(state.value), "value_moments": devices_of(moments),
          "counters": devices_of(counters)}


def checkpoints(root: pathlib.Path, split, shared_state) -> dict:
  """Saves the split state, restores it into itself (same arrays, same devices) and into the
  shared run's layout (a run may resume with another placement)."""
  ckpt = RunCheckpointer(root, async_save=False)
  ckpt.save(1, split.state, extra={"step": 1})
  ckpt.wait()
  restored, _ = ckpt.restore(1, like=split.state)
  into_shared, _ = ckpt.restore(1, like=shared_state)
  ckpt.close()
  same_place = jax.tree.map(lambda a, b: a.sharding == b.sharding, restored, split.state)
  return {"restored_diff": max_abs_diff(restored, split.state),
          "restored_same_shardings": all(jax.tree.leaves(same_place)),
          "restored_layout": layout(restored),
          "into_shared_diff": max_abs_diff(into_shared, split.state),
          "into_shared_devices": devices_of(into_shared)}


def compare(mode: str, root: pathlib.Path) -> dict:
  shared_p, split_p = placements()
  shared, split = build(mode, shared_p), build(mode, split_p)
  # A reference unlike the policy, so that the KL and its gradient are not 0.
  ref = nnx.split(policy(seed=1), nnx.Param, ...)[1]
  for t in (shared, split):
    t.frozen = t.frozen.replace(ref=shard_params(ref, t.placement.reference))
  out = {"split_is_placed": isinstance(split.steps, PlacedSteps),
         "split_has_critic": getattr(split.steps, "critic", None) is not None,
         "initial_layout": layout(split.state),
         "ref_devices": devices_of(split.frozen.ref),
         "reward_devices": devices_of(split.frozen.reward)}
  rollout, scores1, scores2 = rollout_and_scores(shared, split)
  values = jax.block_until_ready(split.steps.critic.values(
      split.state.value, split.frozen.value_rest,
      jax.device_put(rollout, jax.sharding.NamedSharding(split.placement.critic,
                                                         jax.sharding.PartitionSpec()))))
  out["values_program_devices"] = devices_of(values)
  values = split.steps.critic_values(split.state, split.frozen, rollout)
  out["values_transferred_devices"] = devices_of(values)
  shared.state, batch1, m1 = one_update(shared, rollout, scores1)
  split.state, batch2, m2 = one_update(split, rollout, scores2)
  out.update({
      "batch_devices": devices_of(batch2),
      "layout": layout(split.state),
      # The critic's values of the rollout (its own program, before the update) are the old
      # values of both batches, and not 0.
      "max_values_diff": max(max_abs_diff(batch1.old_values, values),
                             max_abs_diff(batch2.old_values, values)),
      "values_size": float(np.max(np.abs(np.asarray(values)))),
      "max_batch_diff": max_abs_diff(batch1, batch2),
      "max_policy_diff": max_abs_diff(shared.state.policy, split.state.policy),
      "max_value_diff": max_abs_diff(shared.state.value, split.state.value),
      "max_opt_diff": max_abs_diff(shared.state.opt_state, split.state.opt_state),
      "value_moved": max_abs_diff(batch2.old_values, split.steps.critic_values(
          split.state, split.frozen, rollout)),
      "metrics": {k: [float(m1[k]), float(m2[k])] for k in (
          "loss/total_avg", "loss/value_avg", "loss/policy_avg", "val/clipfrac_avg",
          "policy/epochs_run", "policy/early_stopped", "skipped_updates", "objective/kl")},
      "grad_norms": [float(m2["policy/grad_norm"]), float(m2["critic/grad_norm"])],
      "steps": [int(shared.state.opt_steps), int(split.state.opt_steps)],
  })
  if mode == "gae":
    kl = jax.numpy.zeros((), jax.numpy.float32)
    s1, r1 = jax.block_until_ready(shared.steps.replay_update(shared.state, shared.frozen,
                                                              batch1, kl))
    s2, r2 = jax.block_until_ready(split.steps.replay_update(split.state, split.frozen,
                                                             batch2, kl))
    shared.state, split.state = s1, s2
    out["replay_param_diff"] = max_abs_diff(s1.params, s2.params)
    out["replay_loss"] = [float(r1["loss/total_avg"]), float(r2["loss/total_avg"])]
    out["replay_layout"] = layout(s2)
    out.update(checkpoints(root / mode, split, shared.state))
  return out


def main():
  faulthandler.dump_traceback_later(360, exit=True)  # a stuck collective: say where, then exit
  root = pathlib.Path(sys.argv[2])
  print(json.dumps({mode: compare(mode, root) for mode in sys.argv[1].split(",")}))


if __name__ == "__main__":
  main()
