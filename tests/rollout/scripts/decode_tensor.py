"""Rollouts of one model on one device, on an FSDP mesh and on the same mesh with a
tensor-parallel rollout (`SamplingConfig.decode_tensor`), from the same prompts and keys
(tests/rollout/test_layout.py; run in a subprocess with 8 fake CPU devices).

Usage: `decode_tensor.py`. Prints JSON: per case the largest log-prob difference from the
single-device rollout and whether the tokens are equal; the decode layout's shardings and dtypes;
the shapes all-gathered by one compiled decode step; the errors of bad widths; and one PPO update
of a trainer on the FSDP mesh with and without the tensor-parallel rollout.
"""

import dataclasses
import faulthandler
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ppo.models import init_cache
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.heads import ScalarModel, value_model_from_reward_model
from jax_ppo.models.lora import LoRAConfig, add_lora
from jax_ppo.models.transformer import CausalLM
from jax_ppo.parallel import MeshConfig, make_mesh, rules
from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling, PPOTrainer
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Sampler

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "parallel" / "scripts"))
import tiny_setup  # noqa: E402

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [4], [20, 21]]
CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=8, num_kv_heads=4, head_dim=4,
                     max_position_embeddings=96)


def model(*, lora: bool = False, dtype=jnp.float32) -> CausalLM:
  """Random weights of std ~0.3 (greedy paths not flat); LoRA adapters with a non-zero `B`."""
  m = CausalLM(CONFIG, dtype=dtype, rngs=nnx.Rngs(0))
  if lora:
    add_lora(m, LoRAConfig(rank=2, alpha=4.0), rngs=nnx.Rngs(1))
  graphdef, state = nnx.split(m)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  leaves = [0.3 * jax.random.normal(k, x.shape, x.dtype) if x.ndim >= 2 else x
            for k, x in zip(keys, leaves, strict=True)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def compare(a, b) -> dict:
  return {"tokens_equal": bool(np.array_equal(np.asarray(a.response_ids),
                                              np.asarray(b.response_ids))),
          "mask_equal": bool(np.array_equal(np.asarray(a.response_mask),
                                            np.asarray(b.response_mask))),
          "logprob_diff": float(np.max(np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs))))}


def decode_step_gathers(sampler, state) -> list[list[int]]:
  """Result shapes of the all-gathers of one decode step compiled on `sampler`'s mesh as its
  decode loop runs it (the policy `state` where the sampler keeps it, the cache split on rows)."""
  mesh = sampler.mesh
  cache = init_cache(sampler.model_config, batch_size=8, max_length=16,
                     dtype=sampler.compute_dtype)
  cache = jax.device_put(cache, rules.cache_shardings(cache, mesh))
  tokens = jax.device_put(np.ones((8,), np.int32), rules.batch_shardings(np.ones((8,)), mesh))

  def step(state, tokens, cache):
    return nnx.merge(sampler.graphdef, state).decode_step(tokens, cache)

  with rules.gather_layers(mesh):
    text = jax.jit(step).lower(state, tokens, cache).compile().as_text()
  return [[int(d) for d in dims.split(",") if d]
          for dims in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", text)]


def layer_matrix_shapes(state) -> list[list[int]]:
  """The shapes of one layer's weight matrices (the stacked `[L, ...]` kernels less `L`) and of
  the embedding and head."""
  shapes = []
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    stacked = any(getattr(k, "key", None) == "layers" for k in path)
    if x.ndim >= 2 + stacked:
      shapes.append(list(x.shape[1:] if stacked else x.shape))
  return shapes


def main() -> dict:
  out = {"devices": jax.device_count()}
  mesh = make_mesh(MeshConfig(data=1, fsdp=8))
  greedy = SamplingConfig(max_new_tokens=9, greedy=True, n_samples=2, pad_token_id=0,
                          stop_token_ids=(3,))
  sampled = dataclasses.replace(greedy, greedy=False, temperature=1.0)
  key = jax.random.key(5)
  cases = {}
  for name, cfg in (("greedy", greedy), ("sampled", sampled)):
    m = model()
    one = Sampler(m, cfg)(PROMPTS, key)
    cases[f"{name}/fsdp"] = compare(Sampler(m, cfg, mesh=mesh)(PROMPTS, key), one)
    for k in (1, 2, 4):
      tp = Sampler(m, dataclasses.replace(cfg, decode_tensor=k), mesh=mesh)
      cases[f"{name}/decode_tensor={k}"] = compare(tp(PROMPTS, key), one)
      if k == 4 and name == "greedy":
        out["decode_mesh"] = dict(tp.mesh.shape)
        out["same_devices"] = list(tp.mesh.devices.flat) == list(mesh.devices.flat)
        state = tp.decode_state(tp.state)
        q = state["decoder"]["layers"]["q"]["kernel"]
        out["q_spec"] = str(q.sharding.spec)
        out["q_shard_shape"] = list(q.addressable_shards[0].data.shape)
        out["trained_q_spec"] = str(tp.state["decoder"]["layers"]["q"]["kernel"].sharding.spec)
        fsdp = Sampler(m, cfg, mesh=mesh)
        out["decode_step_gathers"] = {"fsdp": decode_step_gathers(fsdp, fsdp.state),
                                      "decode_tensor=4": decode_step_gathers(tp, state)}
        out["layer_matrix_shapes"] = layer_matrix_shapes(fsdp.state)
  # A LoRA policy's `(adapters, rest)` state, handed in at each call as the trainer does.
  m = model(lora=True)
  _, adapters, rest = nnx.split(m, nnx.LoRAParam, ...)
  one = Sampler(m, greedy)(PROMPTS, key, state=(adapters, rest))
  tp = Sampler(m, dataclasses.replace(greedy, decode_tensor=4), mesh=mesh)
  cases["lora/decode_tensor=4"] = compare(tp(PROMPTS, key, state=(adapters, rest)), one)
  out["cases"] = cases
  # bfloat16 compute: the rollout's copy holds its matrices in bfloat16, its norm gains in float32.
  m = model(dtype=jnp.bfloat16)
  tp = Sampler(m, dataclasses.replace(greedy, decode_tensor=4), mesh=mesh)
  state = tp.decode_state(tp.state)
  layers = state["decoder"]["layers"]
  out["bf16_dtypes"] = {"q_kernel": str(layers["q"]["kernel"].dtype),
                        "norm_scale": str(layers["attn_norm"]["scale"].dtype),
                        "embedding": str(state["decoder"]["embed"]["embedding"].dtype)}
  bad = {}
  for k in (3, 8, 16):
    try:
      Sampler(model(), dataclasses.replace(greedy, decode_tensor=k), mesh=mesh)
      bad[str(k)] = None
    except ValueError as e:
      bad[str(k)] = str(e)
  out["errors"] = bad
  out["trainer"] = trainer_steps(mesh)
  return out


def trainer_steps(mesh) -> dict:
  """Two PPO updates (a reward model and a critic made from it, adaptive KL) on `mesh`, with the
  rollout on the training mesh and tensor-parallel over 2 devices: their metrics and the largest
  difference of the trained parameters."""
  def run(decode_tensor):
    sampling = PPOSampling(max_new_tokens=6, temperature=1.0, stop_token_ids=(tiny_setup.TARGET,),
                           pad_token_id=tiny_setup.PAD, decode_tensor=decode_tensor)
    config = PPOConfig(batch_size=8, num_minibatches=2, ppo_epochs=2, kl_controller="adaptive",
                       kl_target=0.01, kl_horizon=10, vf_coef=0.5, whiten_rewards=True,
                       sampling=sampling, total_updates=2, reward_clip=None,
                       optimizer=PPOOptimizer(learning_rate=1e-2, lr_schedule="constant"))
    rm = ScalarModel(tiny_setup.MODEL, rngs=nnx.Rngs(5))
    trainer = PPOTrainer(config, tiny_setup.policy(), reward=rm, prompts=tiny_setup.prompts(),
                         value_model=value_model_from_reward_model(rm), mesh=mesh)
    metrics = [trainer.step() for _ in range(2)]
    keep = ("loss/total_avg", "objective/kl", "objective/scores", "response/length_mean")
    return trainer, {"sampler_mesh": dict(trainer.sampler.mesh.shape),
                     "metrics": [{k: float(m[k]) for k in keep if k in m} for m in metrics]}

  base, base_out = run(None)
  tp, tp_out = run(2)
  return {"training_mesh": base_out, "decode_tensor=2": tp_out,
          "max_param_diff": tiny_setup.max_abs_diff(base.state.params, tp.state.params)}


if __name__ == "__main__":
  faulthandler.dump_traceback_later(560, exit=True)  # under run_on_devices' 600 s
  print(json.dumps(main()))
