"""Advantage modes as a name -> function table (PureJaxRL's `_calculate_gae`, Tunix's algorithm
table, without global registry state).

`ADVANTAGE_FNS[mode](inputs, config) -> (advantages [B, T], returns [B, T])`: every mode is one
pure function of the same `AdvantageInputs` and the run's `PPOConfig` (its hyperparameters
only), returning float32 `[B, T]` arrays that are 0 on padding; `returns` (the critic's value
targets) are zeros for modes without a critic. `PPOConfig.advantage_mode` is validated against
the table's keys; a new mode is one function and one entry here (plus its name in
`CRITIC_MODES` when it trains a critic, or in `GROUP_MODES` when it compares the `n_samples`
responses of one prompt).

* "gae": `A_t = sum_l (gamma lam)^l delta_{t+l}`, `delta_t = r_t + gamma V_{t+1} - V_t` over the
  per-token rewards (whitened first with `whiten_rewards`), returns `A + V`; advantages
  whitened over valid tokens with `whiten_advantages` (docs/rlhf_details.md items 10, 11).
* "reinforce++": discounted return-to-go of the per-token rewards, whitened over the batch
  (Hu 2025), no critic.
* "grpo": each response's sequence reward minus its group's mean, divided by the group's (or the
  batch's) std (`grpo_scale`; Shao et al. 2024), broadcast over its tokens.
* "rloo": each response's sequence reward minus the mean of the other `n_samples - 1` of its
  prompt (Ahmadian et al. 2024), broadcast over its tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_ppo import core

Array = jax.Array


class AdvantageInputs(NamedTuple):
  """What an advantage mode reads of one batch (`B` responses, `T` response slots).

  Attributes:
    rewards: `[B, T]` float32 per-token rewards: the score at the last token, minus
      `beta * kl_t` per token when the KL enters the reward (`core.shape_rewards`).
    seq_rewards: `[B]` float32 sequence rewards: `score - beta * sum_t kl_t` (beta 0 when the KL
      is a loss term).
    values: `[B, T]` float32 critic values at the positions that predict each token, 0 on
      padding (zeros without a critic).
    mask: `[B, T]` bool, True on response tokens.
  """

  rewards: Array
  seq_rewards: Array
  values: Array
  mask: Array


AdvantageFn = Callable[[AdvantageInputs, Any], tuple[Array, Array]]
"""`fn(inputs, config) -> (advantages [B, T], returns [B, T])`, float32."""


def gae_advantages(inputs: AdvantageInputs, config: Any) -> tuple[Array, Array]:
  """GAE over the per-token rewards and the critic's values; returns `A + V` (`core.gae`)."""
  rewards, mask = inputs.rewards, inputs.mask
  if config.whiten_rewards:
    rewards = core.masked_whiten(rewards, mask, shift_mean=False)
  advantages, returns = core.gae(rewards, inputs.values, mask, gamma=config.gamma, lam=config.lam)
  if config.whiten_advantages:
    advantages = core.masked_whiten(advantages, mask)
  return advantages, returns


def reinforce_pp_advantages(inputs: AdvantageInputs, config: Any) -> tuple[Array, Array]:
  """REINFORCE++: whitened discounted returns-to-go (`core.reinforce_plus_plus_advantages`)."""
  advantages = core.reinforce_plus_plus_advantages(inputs.rewards, inputs.mask,
                                                   gamma=config.gamma)
  return advantages, jnp.zeros(inputs.mask.shape, jnp.float32)


def _per_token(seq_advantages: Array, mask: Array) -> tuple[Array, Array]:
  """`[B]` sequence advantages broadcast over the valid tokens, and zero returns."""
  return (jnp.where(mask, seq_advantages[:, None], 0.0),
          jnp.zeros(mask.shape, jnp.float32))


def grpo_advantages(inputs: AdvantageInputs, config: Any) -> tuple[Array, Array]:
  """GRPO: group-normalised sequence rewards (`core.grpo_advantages`, scale `grpo_scale`)."""
  seq = core.grpo_advantages(inputs.seq_rewards, config.n_samples, scale=config.grpo_scale)
  return _per_token(seq, inputs.mask)


def rloo_advantages(inputs: AdvantageInputs, config: Any) -> tuple[Array, Array]:
  """RLOO: sequence rewards minus the leave-one-out mean of the group (`core.rloo_advantages`)."""
  return _per_token(core.rloo_advantages(inputs.seq_rewards, config.n_samples), inputs.mask)


ADVANTAGE_FNS: Mapping[str, AdvantageFn] = MappingProxyType({
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce++": reinforce_pp_advantages,
})
"""Advantage mode -> its function (read-only)."""

CRITIC_MODES = frozenset({"gae"})
"""Modes that read a critic's values (and train it on the returns)."""

GROUP_MODES = frozenset({"grpo", "rloo"})
"""Modes that compare the `n_samples` responses of a prompt (they need `n_samples >= 2`)."""


__all__ = [
    "ADVANTAGE_FNS",
    "CRITIC_MODES",
    "GROUP_MODES",
    "AdvantageFn",
    "AdvantageInputs",
    "gae_advantages",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
]
