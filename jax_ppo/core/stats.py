"""Masked statistics over valid (non-padding) entries.

`mask` may be boolean or float. A float mask acts as per-entry weights (1 on valid tokens, 0 on
padding in the usual case). Values at positions where `mask == 0` never influence any result,
even when they are NaN or infinite: they are replaced by zero with `jnp.where` before any
arithmetic, not multiplied by zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ppo.core import _checks

Array = jax.Array


def _prepare(x: Array, mask: Array) -> tuple[Array, Array]:
  _checks.check_same_shape(x=x, mask=mask)
  w = jnp.asarray(mask).astype(jnp.float32)
  xf = jnp.where(w != 0, jnp.asarray(x).astype(jnp.float32), 0.0)
  return xf, w


def _safe_div(num: Array, den: Array) -> Array:
  return num / jnp.where(den != 0, den, 1.0)


def masked_sum(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
  r"""Sum of `x` over valid entries: :math:`\sum_i m_i x_i`.

  Args:
    x: float array of any shape.
    mask: bool or float array of the same shape (1 valid, 0 padding).
    axis: axes to reduce; `None` reduces everything.

  Returns:
    float32 array with `axis` reduced.
  """
  xf, w = _prepare(x, mask)
  return jnp.sum(xf * w, axis=axis)


def masked_mean(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
  r"""Mean of `x` over valid entries: :math:`\sum_i m_i x_i / \sum_i m_i`.

  Args:
    x: float array of any shape.
    mask: bool or float array of the same shape.
    axis: axes to reduce; `None` reduces everything.

  Returns:
    float32 array with `axis` reduced; 0 where no entry is valid (instead of NaN).
  """
  xf, w = _prepare(x, mask)
  return _safe_div(jnp.sum(xf * w, axis=axis), jnp.sum(w, axis=axis))


def masked_var(x: Array, mask: Array, *, unbiased: bool = True) -> Array:
  r"""Variance of `x` over all valid entries.

  .. math::  \sigma^2 = \frac{\sum_i m_i (x_i - \mu)^2}{\sum_i m_i - 1}

  (Bessel's correction when `unbiased`, otherwise the denominator is :math:`\sum_i m_i`).

  Args:
    x: float array of any shape.
    mask: bool or float array of the same shape.
    unbiased: apply Bessel's correction.

  Returns:
    float32 scalar; 0 when fewer than two entries are valid.
  """
  xf, w = _prepare(x, mask)
  n = jnp.sum(w)
  mean = _safe_div(jnp.sum(xf * w), n)
  sq = jnp.sum(w * jnp.where(w != 0, (xf - mean) ** 2, 0.0))
  den = n - 1.0 if unbiased else n
  return jnp.where(n > 1, sq / jnp.where(den > 0, den, 1.0), 0.0)


def masked_whiten(x: Array, mask: Array, *, shift_mean: bool = True, eps: float = 1e-8) -> Array:
  r"""Whitens `x` with the mean and (unbiased) variance of its valid entries.

  .. math::  \hat x_i = (x_i - \mu) / \sqrt{\sigma^2 + \epsilon} \; (+ \mu \text{ if not
             shift\_mean})

  Used for advantage whitening (Schulman et al. 2017 baselines; Huang et al. 2024,
  "The N+ Implementation Details of RLHF with PPO"). Under `jax.jit` with a data-parallel
  sharding the statistics are global over the whole batch, not per shard.

  Args:
    x: float array of any shape, e.g. advantages `[B, T]`.
    mask: bool or float array of the same shape.
    shift_mean: when False the mean is added back after scaling (reward whitening that
      keeps the sign of the rewards).
    eps: added to the variance before the square root.

  Returns:
    float32 array shaped like `x`; exactly 0 where `mask` is 0.
  """
  xf, w = _prepare(x, mask)
  mean = masked_mean(xf, w)
  var = masked_var(xf, w)
  out = (xf - mean) * jax.lax.rsqrt(var + eps)
  if not shift_mean:
    out = out + mean
  return jnp.where(w != 0, out, 0.0)


def explained_variance(values: Array, returns: Array, mask: Array) -> Array:
  r"""Fraction of the variance of the returns that the value predictions explain.

  .. math::  \mathrm{EV} = 1 - \mathrm{Var}[R - V] / \mathrm{Var}[R]

  over valid entries. 1 is a perfect critic, 0 a constant one, negative worse than constant.

  Args:
    values: `[B, T]` value predictions.
    returns: `[B, T]` returns (targets).
    mask: `[B, T]` bool or float mask.

  Returns:
    float32 scalar; 0 when the returns have no variance (there is nothing to explain).
  """
  _checks.check_same_shape(values=values, returns=returns, mask=mask)
  var_r = masked_var(returns, mask)
  var_res = masked_var(jnp.asarray(returns, jnp.float32) - jnp.asarray(values, jnp.float32), mask)
  return jnp.where(var_r > 0, 1.0 - var_res / jnp.where(var_r > 0, var_r, 1.0), 0.0)
