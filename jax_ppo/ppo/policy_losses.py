"""The policy-gradient losses a PPO run can train with: a name -> function table.

    POLICY_LOSS_FNS[config.policy_loss](config, logprobs, mb) -> (loss, metrics)

* "ppo": PPO's clipped surrogate (`core.ppo_policy_loss`: `clip_eps`, DAPO's clip-higher
  `clip_eps_high`, `dual_clip`, `loss_reduction`);
* "gspo": GSPO's sequence-level ratio, clipped per sequence (`core.gspo_policy_loss`, Zheng et
  al. 2025), with `clip_eps` / `clip_eps_high` as its clip ranges (the paper's 3e-4 / 4e-4: see
  the "gspo" preset) and each row's advantage the masked mean of its token advantages (the
  sequence advantage itself in the group modes, which broadcast it);
* "cispo": CISPO's clipped stop-gradient importance weight (`core.cispo_policy_loss`,
  MiniMax-M1), bounded above by `clip_eps_high` (else `clip_eps`) and unbounded below.

Every function returns `(loss, metrics)` with at least `clipfrac`, `approx_kl`, `ratio_mean`
and `ratio_var`. A new loss is one function here and one entry in the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jax_ppo import core

Array = jax.Array
PolicyLossFn = Callable[[Any, Array, Any], tuple[Array, dict[str, Array]]]


def ppo_loss(config: Any, logprobs: Array, mb: Any) -> tuple[Array, dict[str, Array]]:
  """PPO's clipped surrogate on the microbatch `mb` (a `Batch`)."""
  c = config
  return core.ppo_policy_loss(
      logprobs, mb.old_logprobs, mb.advantages, mb.response_mask, clip_eps=c.clip_eps,
      clip_eps_high=c.clip_eps_high, dual_clip=c.dual_clip, reduction=c.loss_reduction,
  )


def gspo_loss(config: Any, logprobs: Array, mb: Any) -> tuple[Array, dict[str, Array]]:
  """GSPO on `mb`: one advantage per row, the masked mean of its token advantages."""
  c = config
  mask = mb.response_mask
  advantages = core.masked_mean(mb.advantages, mask, axis=1)
  return core.gspo_policy_loss(
      logprobs, mb.old_logprobs, advantages, mask, clip_eps=c.clip_eps,
      clip_eps_high=c.clip_eps if c.clip_eps_high is None else c.clip_eps_high,
  )


def cispo_loss(config: Any, logprobs: Array, mb: Any) -> tuple[Array, dict[str, Array]]:
  """CISPO on `mb`: the weight clipped above at `1 + (clip_eps_high or clip_eps)`."""
  c = config
  return core.cispo_policy_loss(
      logprobs, mb.old_logprobs, mb.advantages, mb.response_mask, clip_eps_low=None,
      clip_eps_high=c.clip_eps if c.clip_eps_high is None else c.clip_eps_high,
      reduction=c.loss_reduction,
  )


POLICY_LOSS_FNS: dict[str, PolicyLossFn] = {
    "ppo": ppo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
"""`PPOConfig.policy_loss` -> its loss function."""

SEQUENCE_LEVEL_LOSSES = ("gspo",)
"""Losses whose terms are per sequence: they need a sequence-level `loss_reduction` to weigh
microbatches exactly, and sequence-level rollout correction."""

__all__ = ["POLICY_LOSS_FNS", "SEQUENCE_LEVEL_LOSSES", "cispo_loss", "gspo_loss", "ppo_loss"]
