"""The optimizer every stage trains with, and the checks of its fields.

`make_optimizer` reads the optimizer fields of a stage config (`PPOConfig`, `SFTConfig`,
`RewardModelConfig`): AdamW with global-norm clipping, warm-up and a decay schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import optax

LR_SCHEDULES = ("constant", "linear", "cosine")
"""Learning-rate decay after the warm-up."""


def make_optimizer(config: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
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


def is_int(value: Any) -> bool:
  """An int that is not a bool."""
  return isinstance(value, int) and not isinstance(value, bool)


def check_stage_fields(config: Any, bad: Callable[[str, str], None], *, lr_hint: str,
                       data: str) -> None:
  """Validates the fields `SFTConfig` and `RewardModelConfig` share: run length, token ids, the
  optimizer (AdamW, schedule, clipping), the non-finite stop and the layer loop.

  Args:
    config: the stage config (a frozen dataclass with those fields).
    bad: `bad(field, fix)` raises the config's ValueError naming the field and the fix.
    lr_hint: the learning-rate range suggested in the error (e.g. "1e-5 to 1e-4 for full SFT").
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
  for field in ("learning_rate", "adam_b1", "adam_b2", "adam_eps", "weight_decay"):
    value = getattr(config, field)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
      bad(field, "use a finite number")
  if config.lr_schedule not in LR_SCHEDULES:
    bad("lr_schedule", f"choose one of {LR_SCHEDULES}")
  if not config.learning_rate > 0:
    bad("learning_rate", f"use a value > 0 ({lr_hint})")
  if not config.adam_eps > 0:
    bad("adam_eps", "use a value > 0 (1e-8)")
  for field in ("adam_b1", "adam_b2"):
    if not 0 <= getattr(config, field) < 1:
      bad(field, "use a value in [0, 1)")
  if not config.weight_decay >= 0:
    bad("weight_decay", "use a value >= 0")
  if config.max_grad_norm is not None and not config.max_grad_norm > 0:
    bad("max_grad_norm", "use a value > 0 or None")
  if config.train_scan_layers is not None and not isinstance(config.train_scan_layers, bool):
    bad("train_scan_layers", "use True (lax.scan), False (unrolled) or None")
  if config.total_steps is not None and config.warmup_steps > config.total_steps:
    bad("warmup_steps", f"it exceeds the run's total_steps ({config.total_steps})")


__all__ = ["LR_SCHEDULES", "check_stage_fields", "is_int", "make_optimizer"]
