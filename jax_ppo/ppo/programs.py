"""How `PPOSteps` compiles its four programs: `jax.jit` on one device, `MeshJit` on a mesh."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh

from jax_ppo.parallel.jit import MeshJit


def ppo_step_jits(experience: Callable, update: Callable, replay_update: Callable,
                  experience_update: Callable, *, mesh: Mesh | None):
  """The four compiled programs of `PPOSteps`: `jax.jit` without a mesh (the state donated
  by the three updates), else `MeshJit`s: state and frozen parameters by the logical-axis
  rules, rollouts, scores and batches split on rows over `data` x `fsdp`, metrics and the
  scalar KL replicated; the returned state keeps the rules' shardings (and is donated)."""
  if mesh is None:
    return (jax.jit(experience), jax.jit(update, donate_argnums=(0,)),
            jax.jit(replay_update, donate_argnums=(0,)),
            jax.jit(experience_update, donate_argnums=(0,)))
  step_in = ("params", "params", "batch")
  updates = (MeshJit(fn, mesh, in_roles=(*step_in, "replicated"),
                     out_roles=("params", "replicated"), donate_argnums=(0,))
             for fn in (update, replay_update))
  return (
      MeshJit(experience, mesh, in_roles=(*step_in, "batch"), out_roles=("batch", "replicated")),
      *updates,
      MeshJit(experience_update, mesh, in_roles=(*step_in, "batch"),
              out_roles=("params", "batch", "replicated", "replicated"), donate_argnums=(0,)),
  )


__all__ = ["ppo_step_jits"]
