"""The optimizer and the KL controller of a PPO run, from its `PPOConfig`."""

from __future__ import annotations

import optax

from jax_ppo import core
from jax_ppo.trainer.config import PPOConfig


def make_optimizer(config: PPOConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW (PyTorch-style eps 1e-5) with global-norm clipping, warm-up and decay (item 17)."""
  total = config.total_optimizer_steps
  lr = config.learning_rate
  decay_steps = max(total - config.warmup_steps, 1)
  if config.lr_schedule == "constant":
    decay = optax.constant_schedule(lr)
  elif config.lr_schedule == "linear":
    decay = optax.linear_schedule(lr, 0.0, decay_steps)
  else:
    decay = optax.cosine_decay_schedule(lr, decay_steps)
  if config.warmup_steps:
    warm = optax.linear_schedule(0.0, lr, config.warmup_steps)
    schedule = optax.join_schedules([warm, decay], [config.warmup_steps])
  else:
    schedule = decay
  parts = []
  if config.max_grad_norm is not None:
    parts.append(optax.clip_by_global_norm(config.max_grad_norm))
  parts.append(
      optax.adamw(
          schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
          weight_decay=config.weight_decay,
      )
  )
  return optax.chain(*parts), schedule


def kl_controller(config: PPOConfig) -> core.KLController:
  if config.kl_controller == "fixed":
    return core.fixed_kl_controller(config.kl_coef)
  if config.kl_controller == "adaptive":
    return core.adaptive_kl_controller(config.kl_coef, config.kl_target, config.kl_horizon)
  return core.multiplicative_kl_controller(
      min(max(config.kl_coef, 0.001), 1.0), config.kl_target
  )


__all__ = ["kl_controller", "make_optimizer"]
