"""How `PPOSteps` compiles its four programs: `jax.jit` on one device, `MeshJit` on a mesh."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh

from jax_ppo.parallel.jit import MeshJit

_STEP_IN = ("params", "params", "batch")  # state, frozen parameters, rollout or batch
PROGRAM_ROLES: dict[str, dict] = {
    "experience": dict(in_roles=(*_STEP_IN, "batch"), out_roles=("batch", "replicated"),
                       donate_argnums=()),
    "update": dict(in_roles=(*_STEP_IN, "replicated"), out_roles=("params", "replicated"),
                   donate_argnums=(0,)),
    "replay_update": dict(in_roles=(*_STEP_IN, "replicated"),
                          out_roles=("params", "replicated"), donate_argnums=(0,)),
    "experience_update": dict(in_roles=(*_STEP_IN, "batch"),
                              out_roles=("params", "batch", "replicated", "replicated"),
                              donate_argnums=(0,)),
}
"""`MeshJit` arguments of each program on a mesh: state and frozen parameters by the
logical-axis rules, rollouts, scores and batches split on rows over `data` x `fsdp`, metrics and
the scalar KL replicated; the returned state keeps the rules' shardings (and is donated).
`jax_ppo.diagnostics.ppo_plan` compiles the same programs for a TPU topology from this table."""


def ppo_step_jits(experience: Callable, update: Callable, replay_update: Callable,
                  experience_update: Callable, *, mesh: Mesh | None):
  """The four compiled programs of `PPOSteps`: `jax.jit` without a mesh (the state donated
  by the three updates), else `MeshJit`s with the roles of `PROGRAM_ROLES`."""
  if mesh is None:
    return (jax.jit(experience), jax.jit(update, donate_argnums=(0,)),
            jax.jit(replay_update, donate_argnums=(0,)),
            jax.jit(experience_update, donate_argnums=(0,)))
  fns = dict(experience=experience, update=update, replay_update=replay_update,
             experience_update=experience_update)
  return tuple(MeshJit(fn, mesh, **PROGRAM_ROLES[name]) for name, fn in fns.items())


__all__ = ["PROGRAM_ROLES", "ppo_step_jits"]
