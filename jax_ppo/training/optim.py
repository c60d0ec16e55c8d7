"""The optimizer every stage trains with: one `OptimizerConfig` block and `make_optimizer`.

Each stage config nests the block (`PPOConfig.optimizer`, `SFTConfig.optimizer`,
`RewardModelConfig.optimizer`; `ppo.optimizer.learning_rate=1e-6` on the command line); the
stages differ only in their defaults, which live in small subclasses next to each stage config
(a file that gives `optimizer: {learning_rate: ...}` keeps the stage's other defaults).

`make_optimizer(config, total_steps)` builds AdamW (decoupled weight decay) behind one
global-norm clip, with a linear warm-up and a constant, linear or cosine decay to 0 over the
remaining steps (docs/rlhf_details.md item 17). `scale_updates` gives part of the parameters a
learning rate of its own (PPO's `critic_learning_rate`) without changing the optimizer's state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

LR_SCHEDULES = ("constant", "linear", "cosine")
"""Learning-rate decay after the warm-up."""


def is_int(value: Any) -> bool:
  """An int that is not a bool."""
  return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """AdamW with global-norm clipping, warm-up and a decay schedule (the fields every stage has).

  Errors name the field as `<owner>.optimizer.<field>` when the block sits in a stage config.
  """

  learning_rate: float = 1e-5
  """Peak learning rate of AdamW (reached after the warm-up)."""
  lr_schedule: str = "linear"
  """"constant", "linear" (decay to 0) or "cosine" (to 0), after the warm-up."""
  warmup_steps: int = 0
  """Optimizer steps of linear warm-up from 0."""
  adam_b1: float = 0.9
  """AdamW's first-moment decay."""
  adam_b2: float = 0.999
  """AdamW's second-moment decay."""
  adam_eps: float = 1e-8
  """AdamW's epsilon (PyTorch's default 1e-8; PPO uses 1e-5, item 17)."""
  weight_decay: float = 0.0
  """Decoupled weight decay of AdamW."""
  max_grad_norm: float | None = 1.0
  """Clip gradients by global norm (None disables)."""

  LR_HINT = "a value suited to the stage"

  def __post_init__(self):
    def bad(field: str, fix: str):
      raise ValueError(f"{type(self).__name__}.{field}={getattr(self, field)!r} is invalid: "
                       f"{fix}.")

    for field in ("learning_rate", "adam_b1", "adam_b2", "adam_eps", "weight_decay"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        bad(field, "use a finite number")
    if self.lr_schedule not in LR_SCHEDULES:
      bad("lr_schedule", f"choose one of {LR_SCHEDULES}")
    if not self.learning_rate > 0:
      bad("learning_rate", f"use a value > 0 ({self.LR_HINT})")
    if not is_int(self.warmup_steps) or self.warmup_steps < 0:
      bad("warmup_steps", "use an int >= 0")
    if not self.adam_eps > 0:
      bad("adam_eps", "use a value > 0 (1e-8; 1e-5 for PPO)")
    for field in ("adam_b1", "adam_b2"):
      if not 0 <= getattr(self, field) < 1:
        bad(field, "use a value in [0, 1)")
    if not self.weight_decay >= 0:
      bad("weight_decay", "use a value >= 0")
    if self.max_grad_norm is not None and (
        isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, (int, float))
        or not self.max_grad_norm > 0):
      bad("max_grad_norm", "use a value > 0 or None")


def make_optimizer(config: OptimizerConfig, total_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with global-norm clipping, warm-up and decay over `total_steps` optimizer steps.

  Args:
    config: the stage's optimizer block.
    total_steps: optimizer steps of the whole run (the decay ends there).

  Returns:
    `(optimizer, schedule)`; `schedule(step)` is the learning rate of optimizer step `step`.
  """
  lr = config.learning_rate
  decay_steps = max(total_steps - config.warmup_steps, 1)
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


def scale_updates(optimizer: optax.GradientTransformation,
                  scale_of: Callable[[tuple], float]) -> optax.GradientTransformation:
  """`optimizer` with each leaf's update multiplied by `scale_of(path)` (its key path in the
  parameters' tree, as `jax.tree_util.tree_map_with_path` gives it): e.g. a learning rate of its
  own for part of the model, with the same schedule shape. The state and `init` are
  `optimizer`'s, so a state saved with one restores into the other; leaves scaled by 1 are left
  as they are.
  """

  def update(updates, state, params=None):
    updates, state = optimizer.update(updates, state, params)

    def scale(path, u):
      factor = scale_of(path)
      return u if factor == 1 else u * jnp.asarray(factor, u.dtype)

    return jax.tree_util.tree_map_with_path(scale, updates), state

  return optax.GradientTransformation(optimizer.init, update)


def check_stage_fields(config: Any, bad: Callable[[str, str], None], *, data: str) -> None:
  """Validates the fields `SFTConfig` and `RewardModelConfig` share: run length, token ids, the
  non-finite stop, the layer loop and the warm-up against the run's length (the optimizer block
  checks its own fields).

  Args:
    config: the stage config (a frozen dataclass with those fields).
    bad: `bad(field, fix)` raises the config's ValueError naming the field and the fix.
    data: what one epoch passes over, for the `total_steps` error ("the data", "the pairs").
  """
  skips = config.max_consecutive_skips
  if skips is not None and (not is_int(skips) or skips < 1):
    bad("max_consecutive_skips", "use an int >= 1, or None (never stop)")
  if config.total_steps is not None and (not is_int(config.total_steps)
                                         or config.total_steps < 1):
    bad("total_steps", f"use an int >= 1, or None for num_epochs passes over {data}")
  for field in ("pad_token_id", "eos_token_id"):
    value = getattr(config, field)
    if value is not None and (not is_int(value) or value < 0):
      bad(field, "use a token id >= 0, or None to take it from the tokenizer")
  if not isinstance(config.optimizer, OptimizerConfig):
    bad("optimizer", "pass an OptimizerConfig (jax_ppo.training.optim)")
  if config.train_scan_layers is not None and not isinstance(config.train_scan_layers, bool):
    bad("train_scan_layers", "use True (lax.scan), False (unrolled) or None")
  if config.total_steps is not None and config.optimizer.warmup_steps > config.total_steps:
    bad("optimizer", f"its warmup_steps ({config.optimizer.warmup_steps}) exceeds the run's "
                     f"total_steps ({config.total_steps})")


__all__ = ["LR_SCHEDULES", "OptimizerConfig", "check_stage_fields", "is_int", "make_optimizer",
           "scale_updates"]
