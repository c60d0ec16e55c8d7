"""One PPO update on one device and on a (data, fsdp, tensor) mesh from the same rollout.

Usage: `sharded_update.py MODES DATA FSDP TENSOR`, MODES comma-separated among `gae` (full
fine-tune, a separate critic and a reward model: every role on the mesh, experience then update
over 2 minibatches, adaptive KL controller) and `grpo` (LoRA policy, a token reward, the fused
experience_update). Prints JSON `{mode: result}`, each result with the largest parameter,
optimizer-state and batch differences, both runs' losses and KL coefficients, and whether the
parameters are really split.
"""

import faulthandler
import json
import sys

import jax
import numpy as np
from flax import nnx
from tiny_setup import MODEL, PAD, TARGET, count_target, max_abs_diff, one_update, policy, prompts

from jax_ppo.models.heads import ScalarModel, value_model_from_reward_model
from jax_ppo.models.lora import LoRAConfig, add_lora
from jax_ppo.parallel import MeshConfig, make_mesh, shard_batch
from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling, PPOTrainer
from jax_ppo.rewards.scorers import TokenScorer


def build(mode: str, mesh):
  common = dict(sampling=PPOSampling(max_new_tokens=6, temperature=1.0, stop_token_ids=(TARGET,),
                                    pad_token_id=PAD),
                optimizer=PPOOptimizer(learning_rate=1e-2, lr_schedule="constant"),
                total_updates=4, reward_clip=None)
  if mode == "gae":
    config = PPOConfig(batch_size=8, num_minibatches=2, ppo_epochs=2, kl_controller="adaptive",
                       kl_target=0.01, kl_horizon=10, vf_coef=0.5, whiten_rewards=True, **common)
    rm = ScalarModel(MODEL, rngs=nnx.Rngs(5))
    return PPOTrainer(config, policy(), reward=rm, prompts=prompts(),
                      value_model=value_model_from_reward_model(rm), mesh=mesh)
  config = PPOConfig(batch_size=8, n_samples=2, advantage_mode="grpo", ppo_epochs=2,
                     kl_coef=0.05, **common)
  model = add_lora(policy(), LoRAConfig(rank=4, targets=("q", "v", "up")), rngs=nnx.Rngs(3))
  return PPOTrainer(config, model, reward=TokenScorer(count_target), prompts=prompts(), mesh=mesh)


def compare(mode: str, mesh) -> dict:
  single, sharded = build(mode, None), build(mode, mesh)
  prompt_ids, _ = single.dataset.batch(0, single.config.prompts_per_update)
  key = jax.random.PRNGKey(1)
  rollout = jax.block_until_ready(single.sampler(prompt_ids, key, state=single.policy_state()))
  sharded_rollout = jax.block_until_ready(
      sharded.sampler(prompt_ids, key, state=sharded.policy_state()))
  scores = jax.block_until_ready(single.scorer(rollout, single.frozen.reward))
  sharded_scores = jax.block_until_ready(
      sharded.scorer(shard_batch(rollout, mesh), sharded.frozen.reward))
  state1, batch1, m1 = one_update(single, rollout, scores)
  state8, batch8, m8 = one_update(sharded, rollout, scores)
  specs = {str(x.sharding.spec) for x in jax.tree.leaves(state8.params)}
  first = jax.tree.leaves(state8.params)[0]
  return {
      "devices": len(jax.devices()),
      "mesh": dict(mesh.shape),
      "max_param_diff": max_abs_diff(state1.params, state8.params),
      "max_opt_diff": max_abs_diff(state1.opt_state, state8.opt_state),
      "max_batch_diff": max_abs_diff(batch1, batch8),
      "max_score_diff": float(np.max(np.abs(np.asarray(scores) - np.asarray(sharded_scores)))),
      "rollout_equal": bool(np.array_equal(rollout.response_ids, sharded_rollout.response_ids)),
      "rollout_logprob_diff": float(np.max(np.abs(np.asarray(rollout.logprobs)
                                                  - np.asarray(sharded_rollout.logprobs)))),
      "loss": [float(m1["loss/total_avg"]), float(m8["loss/total_avg"])],
      "kl": [float(m1["objective/kl"]), float(m8["objective/kl"])],
      "adv_std": [float(m1["advantages/std"]), float(m8["advantages/std"])],
      "kl_coef_next": [float(state1.kl.coef), float(state8.kl.coef)],
      "param_specs": sorted(specs),
      "param_devices": len(first.sharding.device_set),
      "batch_spec": str(batch8.advantages.sharding.spec),
  }


def main():
  faulthandler.dump_traceback_later(360, exit=True)  # a stuck collective: say where, then exit
  mesh = make_mesh(MeshConfig(data=int(sys.argv[2]), fsdp=int(sys.argv[3]),
                              tensor=int(sys.argv[4])))
  print(json.dumps({mode: compare(mode, mesh) for mode in sys.argv[1].split(",")}))


if __name__ == "__main__":
  main()
