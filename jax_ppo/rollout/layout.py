"""Where a rollout runs: the sampler's mesh and the policy's layout on it.

On a device mesh the sampler runs on the training mesh, or, with `SamplingConfig.decode_tensor =
k`, tensor-parallel on the same devices regrouped `(data=n/k, fsdp=1, tensor=k)`
(`jax_ppo.parallel.decode_mesh`): under FSDP every decode step gathers every layer's weights on
every device, while split `k` ways over heads, MLP width and vocabulary each device reads `1/k`
of every matrix per step. The policy then reaches the rollout through one program per call
(`decode_state_jit`), which casts its matrices to the compute dtype where they lie and moves
them to the tensor-parallel layout.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh

from jax_ppo.models.layers import compute_weights
from jax_ppo.parallel.mesh import decode_mesh
from jax_ppo.parallel.rules import param_shardings
from jax_ppo.rollout.config import SamplingConfig


def sampler_mesh(mesh: Mesh | None, config: SamplingConfig, model_config) -> Mesh | None:
  """The mesh a sampler's `generate` runs on: `mesh`, or with `config.decode_tensor = k` its
  devices regrouped `(data=n/k, fsdp=1, tensor=k)` (`jax_ppo.parallel.decode_mesh`).

  Raises:
    ValueError: `k` does not divide the model's key/value heads (whose KV cache it splits) or
      the mesh's devices; naming the field.
  """
  k = config.decode_tensor
  if mesh is None or k is None:
    return mesh
  heads = model_config.num_kv_heads
  if heads % k:
    divisors = [d for d in range(1, heads + 1) if heads % d == 0 and mesh.devices.size % d == 0]
    raise ValueError(
        f"SamplingConfig.decode_tensor={k} (PPOConfig.sampling.decode_tensor in a trainer) does "
        f"not divide the model's {heads} key/value heads, over which it splits the KV cache; "
        f"use one of {divisors} (divisors of the heads and of the {mesh.devices.size} devices).")
  return decode_mesh(mesh, k)


def decode_state_jit(state, decode: Mesh, dtype):
  """The jitted `state -> state` of a tensor-parallel rollout for states of `state`'s structure
  (arrays or `ShapeDtypeStruct`s): every matrix cast to the compute `dtype`
  (`jax_ppo.models.compute_weights`) where it lies, then laid out on the `decode` mesh
  (`jax_ppo.parallel.decode_mesh`) by the logical-axis rules.

  XLA moves each matrix with all-to-alls from an FSDP split of its model width to the split of
  its heads, MLP or vocabulary dimension: from a `(1, n, 1)` mesh its temporaries are about
  twice its decode-layout shard. From a mesh with several axes the partitioner may gather a
  whole matrix on each device instead (XLA warns "Involuntary full rematerialization");
  `jax-ppo plan` compiles this program (`decode_state`) with the others.
  """
  return jax.jit(functools.partial(compute_weights, dtype=dtype),
                 out_shardings=param_shardings(state, decode))


__all__ = ["decode_state_jit", "sampler_mesh"]
