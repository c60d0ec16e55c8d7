"""Parallelism: device meshes, sharding and multi-host runs (`distributed`)."""

from jax_ppo.parallel.distributed import DistributedConfig

__all__ = ["DistributedConfig"]
