"""Per-device memory of one compiled PPO update on a mesh, from abstract arrays (no weights).

`update_memory(model_config, ppo_config, mesh)` builds the policy (with a value head on its
trunk), its frozen reference copy, the AdamW state and a rollout batch as
`jax.ShapeDtypeStruct`s carrying their `NamedSharding`s, lowers `PPOSteps.update` for `mesh`
and compiles it, and reads

* the bytes of one device's shards of the trainable parameters, the reference parameters and
  the optimizer state, from the compiled program's input shardings (`Sharding.shard_shape`);
* `compiled.memory_analysis()`: `argument_size_in_bytes` (everything the program reads; the
  reference is not among them, `update` does not use it), and `temp_size_in_bytes`, the
  scratch XLA allocates while the program runs: activations of the forward and backward
  passes, the gradients and the optimizer's temporaries (reported as `activations`).

Nothing is allocated: the numbers are what the program would need per device.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax_ppo.models.config import ModelConfig
from jax_ppo.models.transformer import CausalLM, layer_loop
from jax_ppo.parallel.jit import shardings_for


def placed_abstract(tree: Any, role: str, mesh: Mesh) -> Any:
  """`tree`'s arrays as `jax.ShapeDtypeStruct`s carrying the `NamedSharding`s of `role`
  ("params", "batch" or "replicated"; `jax_ppo.parallel.jit.shardings_for`) on `mesh`."""
  shardings = shardings_for(role, tree, mesh)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      tree, shardings)


def shard_bytes(tree: Any) -> int:
  """Bytes of one device's shards of the `ShapeDtypeStruct`s/arrays of `tree` (the largest
  shard of each leaf: shards are equal when the mesh divides the dimensions)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def update_memory(model_config: ModelConfig, ppo_config, mesh: Mesh, *, prompt_length: int,
                  param_dtype=jnp.float32, dtype=jnp.float32) -> dict[str, int]:
  """Per-device bytes of one `PPOSteps.update` of a full fine-tune with a value head.

  Args:
    model_config: the architecture (e.g. Qwen3-0.6B's shapes).
    ppo_config: a `PPOConfig`; its `batch_size` rows of `prompt_length +
      sampling.max_new_tokens` tokens form the batch.
    mesh: the device mesh.
    prompt_length: `S`, prompt slots per row.
    param_dtype, dtype: parameter storage and compute dtypes.

  Returns:
    `{"params", "reference", "optimizer", "arguments", "activations", "output", "alias"}` bytes
    per device (see the module docstring; `alias`: output bytes that reuse donated inputs).
  """
  from jax_ppo.ppo.batch import Batch
  from jax_ppo.ppo.state import FrozenParams, init_train_state
  from jax_ppo.ppo.steps import PPOSteps
  from jax_ppo.training.optim import make_optimizer

  c = ppo_config

  def build():
    model = CausalLM(model_config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    model.add_value_head()
    return model

  model = nnx.eval_shape(build)
  with layer_loop(model, c.train_scan_layers):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  optimizer, schedule = make_optimizer(c.optimizer, c.total_optimizer_steps)
  steps = PPOSteps(c, policy_graphdef=graphdef, value_graphdef=None,
                   shared_value_head=c.uses_critic, lora=False, optimizer=optimizer,
                   schedule=schedule, mesh=mesh)
  state = jax.eval_shape(
      lambda p: init_train_state(c, optimizer, policy=p, value=None,
                                 rng=jax.random.PRNGKey(0)), params)
  state = placed_abstract(state, "params", mesh)
  frozen = placed_abstract(FrozenParams(policy_rest=rest, ref=params, value_rest=None,
                                        reward=None), "params", mesh)
  b, t = c.batch_size, c.sampling.max_new_tokens
  n = prompt_length + t
  tokens = lambda *shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
  batch = Batch(
      input_ids=tokens(b, n), attention_mask=tokens(b, n), positions=tokens(b, n),
      response_ids=tokens(b, t), response_mask=tokens(b, t, dt=jnp.bool_),
      old_logprobs=tokens(b, t, dt=jnp.float32), ref_logprobs=tokens(b, t, dt=jnp.float32),
      old_values=tokens(b, t, dt=jnp.float32), advantages=tokens(b, t, dt=jnp.float32),
      returns=tokens(b, t, dt=jnp.float32),
  )
  batch = placed_abstract(batch, "batch", mesh)
  kl = placed_abstract(jax.ShapeDtypeStruct((), jnp.float32), "replicated", mesh)
  compiled = steps.update.lower(state, frozen, batch, kl).compile()
  analysis = compiled.memory_analysis()
  return {
      "params": shard_bytes(state.policy),
      "reference": shard_bytes(frozen.ref),
      "optimizer": shard_bytes(state.opt_state),
      "arguments": int(analysis.argument_size_in_bytes),
      "activations": int(analysis.temp_size_in_bytes),
      "output": int(analysis.output_size_in_bytes),
      "alias": int(analysis.alias_size_in_bytes),
  }
