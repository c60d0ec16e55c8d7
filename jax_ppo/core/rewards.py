"""Per-token reward shaping for RLHF."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ppo.core import _checks

Array = jax.Array


def last_valid_index(mask: Array) -> Array:
  """Index of the last valid token of each row of a `[B, T]` mask (-1 for an empty row)."""
  _checks.check_rank("mask", mask, 2, "[B, T]")
  valid = jnp.asarray(mask) != 0
  t = valid.shape[1]
  last = t - 1 - jnp.argmax(valid[:, ::-1], axis=1)
  return jnp.where(jnp.any(valid, axis=1), last, -1).astype(jnp.int32)


def shape_rewards(scores: Array, kl: Array, mask: Array, *, kl_coef: float | Array) -> Array:
  r"""Per-token rewards: a KL penalty on every valid token plus the score on the last one.

  Ziegler et al. (2019); Stiennon et al. (2020):

  .. math::  r_t = -\beta\, \mathrm{KL}_t\, m_t + s \cdot [t = t_{last}]

  where :math:`t_{last}` is the last valid token of the row (the EOS position, not one past it:
  docs/rlhf_details.md item 6, trl#1893).

  Args:
    scores: `[B]` scalar rewards of the responses.
    kl: `[B, T]` per-token KL estimates (`kl_penalty`).
    mask: `[B, T]` bool or float mask.
    kl_coef: KL coefficient beta: a scalar (float32 array when it changes during training) or a
      `[B]` array of per-row coefficients.

  Returns:
    `[B, T]` float32 rewards, 0 where `mask` is 0. A row without valid tokens gets no score.
  """
  _checks.check_rank("scores", scores, 1, "[B]")
  _checks.check_rank("kl", kl, 2, "[B, T]")
  _checks.check_same_shape(kl=kl, mask=mask)
  if _checks.shape_of(scores)[0] != _checks.shape_of(kl)[0]:
    raise ValueError(
        f"`scores` [B] and `kl` [B, T] disagree on B: `scores` {_checks.shape_of(scores)}, "
        f"`kl` {_checks.shape_of(kl)}."
    )
  coef = jnp.asarray(kl_coef, jnp.float32)
  if coef.ndim == 1:
    coef = coef[:, None]
  elif coef.ndim != 0:
    raise ValueError(f"`kl_coef` must be a scalar or [B], got shape {coef.shape}.")
  valid = jnp.asarray(mask) != 0
  rewards = jnp.where(valid, -coef * jnp.asarray(kl, jnp.float32), 0.0)
  last = last_valid_index(mask)
  at_last = jnp.arange(valid.shape[1])[None, :] == last[:, None]
  return rewards + jnp.where(at_last, jnp.asarray(scores, jnp.float32)[:, None], 0.0)


def overlong_penalty(
    lengths: Array, *, max_length: int, cache_length: int, penalty: float | Array = 1.0
) -> Array:
  r"""DAPO's overlong reward shaping (Yu et al. 2025): a soft penalty on responses that run into
  the length limit, to add to the scores.

  With :math:`L` the response length and :math:`s = L_{max} - L_{cache}`:

  .. math::  R(L) = \begin{cases} 0 & L \le s \\
             p\,(s - L) / L_{cache} & s < L \le L_{max} \\
             -p & L > L_{max} \end{cases}

  so the penalty grows linearly from 0 to :math:`-p` over the last `cache_length` tokens.

  Args:
    lengths: `[B]` response lengths in tokens (int or float).
    max_length: :math:`L_{max}`, the length limit (e.g. `max_new_tokens`), > 0.
    cache_length: :math:`L_{cache}`, the soft-penalty window, in `(0, max_length]`.
    penalty: :math:`p \ge 0`, the penalty at and beyond the limit.

  Returns:
    `[B]` float32 rewards, 0 or negative.
  """
  _checks.check_rank("lengths", lengths, 1, "[B]")
  for name, value in (("max_length", max_length), ("cache_length", cache_length)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"`{name}` must be an int >= 1, got {value!r}.")
  if cache_length > max_length:
    raise ValueError(f"`cache_length` ({cache_length}) must not exceed `max_length` "
                     f"({max_length}): the soft-penalty window lies inside the length limit.")
  _checks.check_scalar_range("penalty", penalty, low=0.0)
  length = jnp.asarray(lengths, jnp.float32)
  start = float(max_length - cache_length)
  penalty = jnp.asarray(penalty, jnp.float32)
  soft = penalty * (start - length) / float(cache_length)
  return jnp.where(length <= start, 0.0, jnp.where(length <= max_length, soft, -penalty))
