"""One PPO update with every role on the policy's 4-device mesh, and with the reference and the
reward model on the other 4 devices (`jax_ppo.parallel.placement`, `jax_ppo.ppo.placed_steps`).

Usage: `placed_update.py MODES`, MODES comma-separated among `gae` (full fine-tune, a separate
critic, a reward model; experience then update over 2 minibatches), `grpo` (full fine-tune, a
reward model, the fused experience_update) and `lora` (LoRA policy, reward model split, the
reference shared: the base weights with the adapters off). Prints JSON `{mode: result}` with the
largest differences between the two runs, where each array lives (device ids), and for `lora`
how many distinct copies of the base embedding are alive.
"""

import faulthandler
import gc
import json
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

from jax_ppo.models.heads import ScalarModel, value_model_from_reward_model
from jax_ppo.models.lora import LoRAConfig, add_lora
from jax_ppo.parallel import MeshConfig, shard_params
from jax_ppo.parallel.placement import PlacementConfig, RoleMesh, make_placement
from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling, PPOTrainer
from jax_ppo.ppo.placed_steps import PlacedSteps
from jax_ppo.ppo.steps import PPOSteps

POLICY_MESH = MeshConfig(data=2, fsdp=2)


def placements():
  shared = make_placement(PlacementConfig(policy_devices=(0, 4)), POLICY_MESH)
  other = RoleMesh(devices=(4, 8), mesh=MeshConfig(data=2, fsdp=2))
  split = make_placement(PlacementConfig(reference=other, reward=other), POLICY_MESH)
  reward_only = make_placement(PlacementConfig(reward=other), POLICY_MESH)
  return shared, split, reward_only


def build(mode: str, placement):
  common = dict(sampling=PPOSampling(max_new_tokens=6, temperature=1.0, stop_token_ids=(TARGET,),
                                    pad_token_id=PAD),
                optimizer=PPOOptimizer(learning_rate=1e-2, lr_schedule="constant"),
                total_updates=4, reward_clip=None)
  rm = ScalarModel(MODEL, rngs=nnx.Rngs(5))
  if mode == "gae":
    config = PPOConfig(batch_size=8, num_minibatches=2, ppo_epochs=2, kl_controller="adaptive",
                       kl_target=0.01, kl_horizon=10, vf_coef=0.5, **common)
    return PPOTrainer(config, policy(), reward=rm, prompts=prompts(),
                      value_model=value_model_from_reward_model(rm), placement=placement)
  config = PPOConfig(batch_size=8, n_samples=2, advantage_mode="grpo", ppo_epochs=2,
                     kl_coef=0.05, **common)
  model = policy()
  if mode == "lora":
    model = add_lora(model, LoRAConfig(rank=4, targets=("q", "v", "up")), rngs=nnx.Rngs(3))
  # As `from_pretrained(mesh=...)` does: the weights are on the policy mesh before the trainer.
  nnx.update(model, shard_params(nnx.state(model), placement.policy))
  return PPOTrainer(config, model, reward=rm, prompts=prompts(), placement=placement)


def devices_of(tree) -> list[int]:
  return sorted({d.id for x in jax.tree.leaves(tree) for d in x.sharding.device_set})


def base_copies(shape, devices) -> int:
  """Distinct sets of device buffers among the live float32 arrays of `shape` on `devices`
  (the policy's: the reward model, on other devices, has an embedding of the same shape)."""
  gc.collect()
  copies = set()
  for x in jax.live_arrays():
    if (x.shape == shape and x.dtype == np.float32 and not x.is_deleted()
        and {d.id for d in x.sharding.device_set} <= set(devices)):
      copies.add(frozenset(s.data.unsafe_buffer_pointer() for s in x.addressable_shards))
  return len(copies)


def compare(mode: str) -> dict:
  shared_p, split_p, reward_only = placements()
  placed = reward_only if mode == "lora" else split_p
  shared, split = build(mode, shared_p), build(mode, placed)
  if mode != "lora":  # a reference unlike the policy, so that the KL and its gradient are not 0
    ref = nnx.split(policy(seed=1), nnx.Param, ...)[1]
    for t in (shared, split):
      t.frozen = t.frozen.replace(ref=shard_params(ref, t.placement.reference))
  out = {"shared_steps": type(shared.steps).__name__, "split_steps": type(split.steps).__name__,
         "shared_is_ppo_steps": isinstance(shared.steps, PPOSteps),
         "split_is_placed": isinstance(split.steps, PlacedSteps)}
  rollout, scores1, scores2 = rollout_and_scores(shared, split)
  out["scores_devices"] = devices_of(scores2)
  out["max_score_diff"] = float(np.max(np.abs(np.asarray(scores1) - np.asarray(scores2))))
  out["reward_devices"] = devices_of(split.frozen.reward)
  if split.frozen.ref is not None:
    out["ref_devices"] = devices_of(split.frozen.ref)
    ref = jax.block_until_ready(split.steps.reference(
        split.frozen.ref, split.frozen.policy_rest,
        jax.device_put(rollout, jax.sharding.NamedSharding(split.placement.reference,
                                                           jax.sharding.PartitionSpec()))))
    out["ref_program_devices"] = devices_of(ref)
    out["ref_transferred_devices"] = devices_of(
        split.steps.reference_logprobs(split.frozen, rollout))
  if mode == "grpo":  # evaluation's log-probs (placed: on the reference's mesh) = training's
    placed_eval = split.eval_logprobs(split.state.policy, split.frozen, rollout)
    shared_eval = shared.eval_logprobs(shared.state.policy, shared.frozen, rollout)
  state1, batch1, m1 = one_update(shared, rollout, scores1)
  if mode == "grpo":
    train = (batch1.old_logprobs, batch1.ref_logprobs)
    out["eval_is_placed"] = type(split.eval_logprobs).__name__ == "PlacedEvalLogprobs"
    out["max_eval_train_diff"] = max(max_abs_diff(a, b)
                                     for a, b in zip(shared_eval, train, strict=True))
    out["max_placed_eval_train_diff"] = max(max_abs_diff(a, b)
                                            for a, b in zip(placed_eval, train, strict=True))
  state2, batch2, m2 = one_update(split, rollout, scores2)
  out.update({
      "state_devices": devices_of(state2),
      "batch_devices": devices_of(batch2),
      "max_param_diff": max_abs_diff(state1.params, state2.params),
      "max_opt_diff": max_abs_diff(state1.opt_state, state2.opt_state),
      "max_batch_diff": max_abs_diff(batch1, batch2),
      "max_ref_diff": max_abs_diff(batch1.ref_logprobs, batch2.ref_logprobs),
      "loss": [float(m1["loss/total_avg"]), float(m2["loss/total_avg"])],
      "kl": [float(m1["objective/kl"]), float(m2["objective/kl"])],
  })
  if mode == "lora":
    embed = (MODEL.vocab_size, MODEL.hidden_size)
    out["lora_ref_is_none"] = split.frozen.ref is None and shared.frozen.ref is None
    policy_devices = devices_of(state2)
    del shared, state1
    out["base_embedding_copies"] = base_copies(embed, policy_devices)
    del split, state2
    full = build("grpo", reward_only)  # a full fine-tune: policy, reference, Adam mu and nu
    out["full_embedding_copies"] = base_copies(embed, policy_devices)
    del full
  return out


def main():
  faulthandler.dump_traceback_later(360, exit=True)  # a stuck collective: say where, then exit
  print(json.dumps({mode: compare(mode) for mode in sys.argv[1].split(",")}))


if __name__ == "__main__":
  main()
