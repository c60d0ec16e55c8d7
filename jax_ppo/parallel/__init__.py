"""Scale-out over a device mesh: SPMD with `jax.jit` + `NamedSharding` (no `pmap`).

Public API (everything a run needs; see each module for details):

* `MeshConfig(data=-1, fsdp=1, tensor=1)` and `make_mesh(config)`: the mesh, axes
  `("data", "fsdp", "tensor")` (`jax_ppo.parallel.mesh`); `decode_mesh(mesh, k)`: its devices
  regrouped `(n/k, 1, k)` for a tensor-parallel rollout (`SamplingConfig.decode_tensor`);
* `param_shardings(tree, mesh)` / `shard_params(tree, mesh)`: parameters, optimizer states,
  `TrainState` and `FrozenParams` placed by the logical-axis rules (`jax_ppo.parallel.rules`:
  `MESH_RULES`, `PARAM_AXES`, `logical_axes`, `partition_spec`);
* `batch_shardings(tree, mesh)` / `shard_batch(tree, mesh)`: rows split over `data` x `fsdp`;
  `cache_shardings(cache, mesh)` for the KV cache;
* `MeshJit(fn, mesh, in_roles=..., out_roles=...)`: the jit with explicit in/out shardings that
  the PPO, SFT and reward-model steps and `Sampler(..., mesh=mesh)` use; it traces under
  `rules.gather_layers(mesh)`, under which the decoder's layer loop gathers each layer's
  FSDP-split weights (and does not keep them for the backward pass) and keeps activations split
  on rows (`rules.gather_layer_weights`, `rules.remat_gathered`, `rules.constrain_activations`),
  except in the one-token decode step, which pins the weights to their FSDP split and splits
  its activations on the model width like them (`rules.stationary_layer_weights`,
  `rules.stationary_activations`; all identities without a mesh);
* `DistributedConfig` and `distributed.initialize(config)`: multi-host runs through
  `jax.distributed` (`jax_ppo.parallel.distributed`); `host_rows`: each process's own rows of
  a global batch.

* `PlacementConfig`, `RoleMesh`, `make_placement` and `Placement`: the reference, the reward
  model and a separate critic on sub-meshes of their own, or sharing the policy's
  (`jax_ppo.parallel.placement`; `RunConfig.placement`, `PPOTrainer(..., placement=...)`).

Runs take the mesh from `RunConfig.mesh` (`jax-ppo train ... mesh.fsdp=2`), `PPOTrainer(...,
mesh=mesh)` places the policy, reference, critic and reward model on the same mesh (a LoRA
policy's reference is its own base weights: one copy), and `from_pretrained(path, mesh=mesh)`
(`jax_ppo.models.hf`) reads each tensor straight into its shards (`rules.partition_spec`).
Global statistics (masked means, whitening, group advantages, the KL controller's KL) are
computed over the whole batch by XLA's SPMD partitioner: they equal the single-device values
(`tests/parallel`).

This package imports nothing of jax_ppo above it: the per-device memory plan of a PPO update and
the scale check that runs one on several processes are in `jax_ppo.diagnostics`.
"""

from jax_ppo.parallel.distributed import DistributedConfig
from jax_ppo.parallel.jit import MeshJit, shardings_for
from jax_ppo.parallel.mesh import (
  AXES,
  BATCH_AXES,
  MeshConfig,
  batch_axis_size,
  decode_mesh,
  make_mesh,
)
from jax_ppo.parallel.placement import Placement, PlacementConfig, RoleMesh, make_placement
from jax_ppo.parallel.rules import (
    MESH_RULES,
    PARAM_AXES,
    batch_shardings,
    batch_spec,
    cache_shardings,
    logical_axes,
    param_shardings,
    partition_spec,
    replicated,
    shard_batch,
    shard_params,
)

__all__ = [
    "AXES",
    "BATCH_AXES",
    "DistributedConfig",
    "MESH_RULES",
    "PARAM_AXES",
    "MeshConfig",
    "MeshJit",
    "Placement",
    "PlacementConfig",
    "RoleMesh",
    "batch_axis_size",
    "batch_shardings",
    "batch_spec",
    "cache_shardings",
    "decode_mesh",
    "logical_axes",
    "make_mesh",
    "make_placement",
    "param_shardings",
    "partition_spec",
    "replicated",
    "shard_batch",
    "shard_params",
    "shardings_for",
]
