"""Advantage estimators: GAE (masked LLM form and per-step form with dones), GRPO, RLOO,
REINFORCE++.

Token-level estimators take batch-major `[B, T]` arrays and run one reverse `jax.lax.scan` over
time. Sequence-level estimators (GRPO, RLOO) take one score per sample `[B]`, where consecutive
groups of `group_size` rows are samples of the same prompt.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from jax_ppo.core import _checks
from jax_ppo.core.stats import masked_whiten

Array = jax.Array

GRPO_SCALES = ("group", "batch", "none")


def _reverse_discounted_sum(deltas_bt: Array, decays_bt: Array) -> Array:
  """`out_t = deltas_t + decays_t * out_{t+1}` with `out_T = 0`, by a reverse scan over time."""

  def step(next_out_b, inputs):
    delta_b, decay_b = inputs
    out_b = delta_b + decay_b * next_out_b
    return out_b, out_b

  init = jnp.zeros(deltas_bt.shape[:1], jnp.float32)
  _, out_tb = jax.lax.scan(step, init, (deltas_bt.T, decays_bt.T), reverse=True)
  return out_tb.T


def _check_discounts(gamma, lam) -> None:
  _checks.check_scalar_range("gamma", gamma, low=0.0, high=1.0)
  _checks.check_scalar_range("lam", lam, low=0.0, high=1.0)


def gae(
    rewards: Array, values: Array, mask: Array, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Array, Array]:
  r"""Generalised advantage estimation over masked response tokens.

  Schulman et al. (2016), "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation". The episode ends at the last valid token, so the value after it is 0:

  .. math::  \delta_t = r_t + \gamma V_{t+1} m_{t+1} - V_t, \qquad
             A_t = \delta_t + \gamma \lambda m_{t+1} A_{t+1}, \qquad R_t = A_t + V_t

  with :math:`m_T = 0`. Returns are computed before any advantage whitening
  (docs/rlhf_details.md item 10). `gamma = 1, lam = 0.95` are the LLM defaults.

  Args:
    rewards: `[B, T]` per-token rewards (e.g. from `shape_rewards`).
    values: `[B, T]` value predictions :math:`V_t` for each response token.
    mask: `[B, T]` bool or float, 1 on valid response tokens.
    gamma: discount in [0, 1].
    lam: GAE lambda in [0, 1].

  Returns:
    `(advantages, returns)`, both `[B, T]` float32 and exactly 0 where `mask` is 0.
  """
  _checks.check_rank("rewards", rewards, 2, "[B, T]")
  _checks.check_same_shape(rewards=rewards, values=values, mask=mask)
  _check_discounts(gamma, lam)
  valid = jnp.asarray(mask) != 0
  r = jnp.where(valid, jnp.asarray(rewards, jnp.float32), 0.0)
  v = jnp.where(valid, jnp.asarray(values, jnp.float32), 0.0)
  next_valid = jnp.pad(valid[:, 1:], ((0, 0), (0, 1))).astype(jnp.float32)
  next_v = jnp.pad(v[:, 1:], ((0, 0), (0, 1)))
  deltas = r + gamma * next_v * next_valid - v
  advantages = _reverse_discounted_sum(deltas, gamma * lam * next_valid)
  advantages = jnp.where(valid, advantages, 0.0)
  returns = jnp.where(valid, advantages + v, 0.0)
  return advantages, returns


def gae_from_dones(
    rewards: Array,
    values: Array,
    dones: Array,
    bootstrap_value: Array,
    *,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> tuple[Array, Array]:
  r"""Generalised advantage estimation for per-step rewards with episode ends (control tasks).

  The form PPO uses on vectorised environments (e.g. CartPole in PureJaxRL), where a rollout of
  `T` steps may span several episodes. `dones[:, t] = 1` means the episode ended with step `t`,
  so :math:`V_{t+1}` is not bootstrapped from:

  .. math::  \delta_t = r_t + \gamma V_{t+1} (1 - d_t) - V_t, \qquad
             A_t = \delta_t + \gamma \lambda (1 - d_t) A_{t+1}, \qquad R_t = A_t + V_t

  with :math:`V_T` = `bootstrap_value`, the value of the state after the last step.
  `gae(r, v, m)` is this function with :math:`d_t = 1 - m_{t+1}` and a zero bootstrap, then
  masked.

  Args:
    rewards: `[B, T]` rewards, `B` environments, `T` steps.
    values: `[B, T]` values of the states the steps started from.
    dones: `[B, T]` bool or float episode-end flags.
    bootstrap_value: `[B]` value of the state after step `T - 1`.
    gamma: discount in [0, 1].
    lam: GAE lambda in [0, 1].

  Returns:
    `(advantages, returns)`, both `[B, T]` float32.
  """
  _checks.check_rank("rewards", rewards, 2, "[B, T]")
  _checks.check_same_shape(rewards=rewards, values=values, dones=dones)
  _checks.check_per_row("bootstrap_value", bootstrap_value, "rewards", rewards)
  _check_discounts(gamma, lam)
  v = jnp.asarray(values, jnp.float32)
  not_done = 1.0 - jnp.asarray(dones, jnp.float32)
  next_v = jnp.concatenate([v[:, 1:], jnp.asarray(bootstrap_value, jnp.float32)[:, None]], 1)
  deltas = jnp.asarray(rewards, jnp.float32) + gamma * next_v * not_done - v
  advantages = _reverse_discounted_sum(deltas, gamma * lam * not_done)
  return advantages, advantages + v


def reinforce_plus_plus_advantages(
    rewards: Array, mask: Array, *, gamma: float = 1.0, eps: float = 1e-8
) -> Array:
  r"""REINFORCE++ advantages: whitened discounted return-to-go of the shaped rewards.

  Hu (2025), "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
  Models". With the per-token rewards :math:`r_t` of `shape_rewards` (score at the last token,
  :math:`-\beta\,\mathrm{KL}_t` everywhere):

  .. math::  G_t = r_t + \gamma m_{t+1} G_{t+1}, \qquad A = \mathrm{whiten}(G)

  where the whitening uses the mean and unbiased std of all valid tokens in the batch.

  Args:
    rewards: `[B, T]` per-token shaped rewards.
    mask: `[B, T]` bool or float mask.
    gamma: discount in [0, 1] (1 for LLMs).
    eps: added to the variance before the square root.

  Returns:
    `[B, T]` float32 advantages, 0 where `mask` is 0.
  """
  returns_to_go, _ = gae(rewards, jnp.zeros_like(rewards, jnp.float32), mask, gamma=gamma, lam=1.0)
  return masked_whiten(returns_to_go, mask, eps=eps)


def _group_size(group_size) -> int:
  """`group_size` as a Python int (NumPy integers accepted), or a ValueError naming it."""
  try:
    size = operator.index(group_size)
  except TypeError:
    raise ValueError(f"`group_size` must be a positive int, got {group_size!r}.") from None
  if size < 1:
    raise ValueError(f"`group_size` must be a positive int, got {group_size!r}.")
  return size


def _grouped(scores: Array, group_size: int) -> Array:
  _checks.check_rank("scores", scores, 1, "[B]")
  group_size = _group_size(group_size)
  batch = _checks.shape_of(scores)[0]
  if batch % group_size:
    raise ValueError(
        f"`group_size` ({group_size}) must divide the batch of `scores` {(batch,)}: "
        f"pass all {group_size} samples of every prompt, consecutively."
    )
  return jnp.asarray(scores, jnp.float32).reshape(batch // group_size, group_size)


def _std(x: Array, axis=None, keepdims: bool = False) -> Array:
  """Unbiased standard deviation (as `torch.std` in TRL and verl); 0 for a single element."""
  n = x.size if axis is None else x.shape[axis]
  return jnp.std(x, axis=axis, keepdims=keepdims, ddof=1 if n > 1 else 0)


def grpo_advantages(
    scores: Array, group_size: int, *, scale: str = "group", eps: float = 1e-6
) -> Array:
  r"""Group-relative advantages (GRPO).

  Shao et al. (2024), "DeepSeekMath", section 4.1.2. For sample :math:`i` of group :math:`g`:

  .. math::  A_i = (s_i - \mathrm{mean}_g(s)) / (\sigma + \epsilon)

  with :math:`\sigma` the unbiased std of the group (`"group"`), of the whole batch (`"batch"`,
  as recommended by Liu et al. 2025, "Understanding R1-Zero-Like Training") or 1 (`"none"`,
  Dr. GRPO).

  Args:
    scores: `[B]` sequence scores; rows `[k*group_size, (k+1)*group_size)` share a prompt.
    group_size: samples per prompt; must divide `B`.
    scale: "group", "batch" or "none".
    eps: added to the std.

  Returns:
    `[B]` float32 advantages, to be broadcast over each response's tokens.
  """
  _checks.check_choice("scale", scale, GRPO_SCALES)
  groups = _grouped(scores, group_size)
  centred = groups - jnp.mean(groups, axis=1, keepdims=True)
  if scale == "group":
    centred = centred / (_std(groups, axis=1, keepdims=True) + eps)
  elif scale == "batch":
    centred = centred / (_std(groups) + eps)
  return centred.reshape(-1)


def rloo_advantages(scores: Array, group_size: int) -> Array:
  r"""REINFORCE leave-one-out advantages.

  Kool et al. (2019), "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al.
  (2024), "Back to Basics". For sample :math:`i` of a group of :math:`k`:

  .. math::  A_i = s_i - \frac{1}{k - 1} \sum_{j \ne i} s_j

  Args:
    scores: `[B]` sequence scores in consecutive groups.
    group_size: samples per prompt, >= 2, dividing `B`.

  Returns:
    `[B]` float32 advantages.
  """
  group_size = _group_size(group_size)
  if group_size < 2:
    raise ValueError(f"`group_size` must be >= 2 for leave-one-out baselines, got {group_size}.")
  groups = _grouped(scores, group_size)
  others = (jnp.sum(groups, axis=1, keepdims=True) - groups) / (group_size - 1)
  return (groups - others).reshape(-1)
