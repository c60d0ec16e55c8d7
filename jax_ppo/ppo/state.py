"""The training state of a PPO run and the frozen arrays next to it.

`TrainState` holds everything that changes during training and nothing else; it is a pytree
(`flax.struct.PyTreeNode`) that only the jitted steps change, through `.replace(...)`, with buffer
donation. `FrozenParams` holds the arrays that never change (the reference policy, the reward
model, the frozen base weights of a LoRA policy); they are passed to the jitted steps as
arguments, never donated and never closed over (a closed-over array would be baked into the
compiled program as a constant).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jax_ppo import core
from jax_ppo.core import KLControllerState
from jax_ppo.ppo.config import PPOConfig

Array = jax.Array


def kl_controller(config: PPOConfig) -> core.KLController:
  """The KL controller `config.kl_controller` names, from the config's coefficient and target."""
  if config.kl_controller == "fixed":
    return core.fixed_kl_controller(config.kl_coef)
  if config.kl_controller == "adaptive":
    return core.adaptive_kl_controller(config.kl_coef, config.kl_target, config.kl_horizon)
  return core.multiplicative_kl_controller(
      min(max(config.kl_coef, 0.001), 1.0), config.kl_target
  )



class TrainState(struct.PyTreeNode):
  """Everything a PPO update changes.

  Attributes:
    policy: trainable policy variables: every `nnx.Param` of a full fine-tune, or only the
      LoRA adapters (plus a value head on the policy trunk, when there is one).
    value: parameters of a separate critic (`ScalarModel`), or None (no critic, or a value head
      on the policy trunk).
    opt_state: optax state over `{"policy": policy, "value": value}`.
    kl: the KL controller's state; `kl.coef` is the coefficient of the next rollout.
    rng: PRNG key, split once per update.
    step: int32, PPO updates done.
    opt_steps: int32, optimizer steps done (the learning-rate schedule's clock).
    episode: int32, responses trained on so far.
    lr_scale: float32 multiplier of the learning rate (a rollback lowers it).
  """

  policy: nnx.State
  value: nnx.State | None
  opt_state: optax.OptState
  kl: KLControllerState
  rng: Array
  step: Array
  opt_steps: Array
  episode: Array
  lr_scale: Array

  @property
  def params(self) -> dict[str, Any]:
    return {"policy": self.policy, "value": self.value}


class FrozenParams(struct.PyTreeNode):
  """Arrays the PPO steps read but never change.

  Attributes:
    policy_rest: the policy's variables that are not trained (the base weights of a LoRA
      policy; empty for a full fine-tune).
    ref: parameters of the reference policy for a full fine-tune (the policy's starting
      weights, or a checkpoint of its own: `PPOTrainer(reference=...)`, `RunConfig.
      reference_path`), or None for a LoRA policy (whose reference is its own base weights with
      the adapters switched off: no second copy).
    value_rest: the critic's non-trained variables (empty or None).
    reward: reward-model state, or None when rewards come from a function.
  """

  policy_rest: nnx.State
  ref: nnx.State | None
  value_rest: nnx.State | None
  reward: nnx.State | None


def check_reference(policy: nnx.State, ref: nnx.State, *, field: str = "reference") -> None:
  """Raises ValueError (naming `field`) unless the reference policy's parameters `ref` have the
  policy's tree, shapes and dtypes (the reference runs through the policy's graph definition, so
  it must be the same architecture)."""
  ours = dict(jax.tree_util.tree_flatten_with_path(policy)[0])
  theirs = dict(jax.tree_util.tree_flatten_with_path(ref)[0])
  for path in sorted(set(ours) | set(theirs), key=jax.tree_util.keystr):
    name = jax.tree_util.keystr(path)
    if path not in theirs or path not in ours:
      side = "lacks" if path not in theirs else "has an extra"
      raise ValueError(
          f"{field}: the reference policy {side} parameter {name} (the policy's parameters "
          "differ); give a checkpoint of the policy's architecture and vocabulary.")
    a, b = ours[path], theirs[path]
    if a.shape != b.shape or a.dtype != b.dtype:
      raise ValueError(
          f"{field}: the reference policy's parameter {name} is {b.dtype}{list(b.shape)}, the "
          f"policy's {a.dtype}{list(a.shape)}; give a checkpoint of the policy's architecture "
          "and vocabulary.")


def init_train_state(
    config: PPOConfig,
    optimizer: optax.GradientTransformation,
    *,
    policy: nnx.State,
    value: nnx.State | None,
    rng: Array,
) -> TrainState:
  """A fresh `TrainState` (step 0) for the trainable policy (and critic) variables."""
  params = {"policy": policy, "value": value}
  return TrainState(
      policy=policy,
      value=value,
      opt_state=optimizer.init(params),
      kl=kl_controller(config).init(),
      rng=rng,
      step=jnp.zeros((), jnp.int32),
      opt_steps=jnp.zeros((), jnp.int32),
      episode=jnp.zeros((), jnp.int32),
      lr_scale=jnp.ones((), jnp.float32),
  )
