"""Per-token KL estimators and KL-coefficient controllers.

The estimators follow Schulman (2020), "Approximating KL Divergence"
(http://joschu.net/blog/kl-approx.html): with samples drawn from the current policy and
:math:`d = \\log \\pi(y) - \\log \\pi_{ref}(y)`, `k1 = d` is unbiased with high variance,
`k2 = d^2 / 2` is biased with low variance and `k3 = e^{-d} - 1 + d` is unbiased, non-negative
and low-variance.

The controllers are optax-style `(init, update)` pairs of pure functions. Their state holds the
coefficient as a float32 array so that a jitted rollout or loss reads the current value as an
argument; a Python float would be baked into the compiled program and never change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ppo.core import _checks

Array = jax.Array

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")


def kl_penalty(logprobs: Array, ref_logprobs: Array, *, estimator: str = "k1") -> Array:
  r"""Per-token KL estimate between the policy and the reference policy.

  With :math:`d = \log\pi - \log\pi_{ref}`:
  `"k1"`: :math:`d`; `"k2"`: :math:`d^2/2`; `"k3"`: :math:`e^{-d} - 1 + d`; `"abs"`: :math:`|d|`.

  Args:
    logprobs: `[B, T]` log-probabilities of the sampled tokens under the policy.
    ref_logprobs: `[B, T]` log-probabilities of the same tokens under the reference model.
    estimator: one of "k1", "k2", "k3", "abs".

  Returns:
    `[B, T]` float32 per-token KL estimates. The caller masks padding (or passes log-probs
    that are equal at padding, which gives 0 for every estimator).
  """
  _checks.check_choice("estimator", estimator, KL_ESTIMATORS)
  _checks.check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
  d = jnp.asarray(logprobs, jnp.float32) - jnp.asarray(ref_logprobs, jnp.float32)
  if estimator == "k1":
    return d
  if estimator == "k2":
    return 0.5 * jnp.square(d)
  if estimator == "k3":
    return jnp.expm1(-d) + d
  return jnp.abs(d)


class KLControllerState(NamedTuple):
  """State of a KL controller.

  Attributes:
    coef: float32 scalar array, the KL coefficient (beta) to use for the next rollout.
  """

  coef: Array


class KLController(NamedTuple):
  """An optax-style pair of pure functions.

  Attributes:
    init: `() -> KLControllerState`.
    update: `(state, kl, n_steps) -> KLControllerState`, where `kl` is the observed mean KL
      (per sequence, summed over tokens, as in Ziegler et al.) of the last batch and `n_steps`
      the number of samples (episodes) it covered. Both arguments may be traced arrays.
  """

  init: Callable[[], KLControllerState]
  update: Callable[[KLControllerState, Array, Array], KLControllerState]


def _f32(x) -> Array:
  return jnp.asarray(x, jnp.float32)


def fixed_kl_controller(coef: float) -> KLController:
  """A constant KL coefficient (0.05 in Huang et al. 2024, "The N+ Implementation Details").

  Args:
    coef: the coefficient, >= 0.

  Returns:
    A `KLController` whose `update` returns the state unchanged.
  """
  _checks.check_scalar_range("coef", coef, low=0.0)

  def init() -> KLControllerState:
    return KLControllerState(coef=_f32(coef))

  def update(state: KLControllerState, kl: Array, n_steps: Array) -> KLControllerState:
    del kl, n_steps
    return state

  return KLController(init, update)


def adaptive_kl_controller(init_coef: float, target: float, horizon: float) -> KLController:
  r"""Ziegler et al. (2019), "Fine-Tuning Language Models from Human Preferences", eq. (2).

  .. math::  e = \mathrm{clip}(\mathrm{KL} / \mathrm{target} - 1, -0.2, 0.2), \qquad
             \beta \leftarrow \beta \, (1 + e \, n_{steps} / \mathrm{horizon})

  Defaults used in the paper: `init_coef=0.2, target=6, horizon=10000`.

  Args:
    init_coef: initial coefficient, >= 0.
    target: target KL (nats per sequence), > 0.
    horizon: adaptation horizon in samples, > 0.

  Returns:
    A `KLController`.
  """
  _checks.check_scalar_range("init_coef", init_coef, low=0.0)
  _checks.check_scalar_range("target", target, low=0.0, low_inclusive=False)
  _checks.check_scalar_range("horizon", horizon, low=0.0, low_inclusive=False)

  def init() -> KLControllerState:
    return KLControllerState(coef=_f32(init_coef))

  def update(state: KLControllerState, kl: Array, n_steps: Array) -> KLControllerState:
    err = jnp.clip(_f32(kl) / _f32(target) - 1.0, -0.2, 0.2)
    return KLControllerState(coef=state.coef * (1.0 + err * _f32(n_steps) / _f32(horizon)))

  return KLController(init, update)


def multiplicative_kl_controller(
    init_coef: float,
    target: float,
    *,
    factor: float = 2.0,
    tolerance: float = 1.5,
    min_coef: float = 0.001,
    max_coef: float = 1.0,
) -> KLController:
  r"""The practitioners' adaptive KL rule: halve or double the coefficient.

  .. math::  \beta \leftarrow \mathrm{clip}\big(\beta \cdot \begin{cases}
             1/\mathrm{factor} & \mathrm{KL} < \mathrm{target} / \mathrm{tolerance} \\
             \mathrm{factor} & \mathrm{KL} > \mathrm{target} \cdot \mathrm{tolerance} \\
             1 & \text{otherwise}\end{cases}, \; \beta_{min}, \beta_{max}\big)

  With the defaults: x0.5 when KL < target / 1.5, x2 when KL > 1.5 * target, kept within
  [0.001, 1.0] (the rule of Schulman et al. 2017, section 4, applied to the reward penalty).

  Args:
    init_coef: initial coefficient, inside [min_coef, max_coef].
    target: target KL, > 0.
    factor: multiplicative step, > 1.
    tolerance: width of the dead band, > 1.
    min_coef: lower bound of the coefficient, >= 0.
    max_coef: upper bound of the coefficient, >= min_coef.

  Returns:
    A `KLController`; `n_steps` is ignored by this rule.
  """
  _checks.check_scalar_range("target", target, low=0.0, low_inclusive=False)
  _checks.check_scalar_range("factor", factor, low=1.0, low_inclusive=False)
  _checks.check_scalar_range("tolerance", tolerance, low=1.0, low_inclusive=False)
  _checks.check_scalar_range("min_coef", min_coef, low=0.0)
  _checks.check_scalar_range("max_coef", max_coef, low=min_coef)
  _checks.check_scalar_range("init_coef", init_coef, low=min_coef, high=max_coef)

  def init() -> KLControllerState:
    return KLControllerState(coef=_f32(init_coef))

  def update(state: KLControllerState, kl: Array, n_steps: Array) -> KLControllerState:
    del n_steps
    kl = _f32(kl)
    scale = jnp.where(
        kl < target / tolerance, 1.0 / factor, jnp.where(kl > target * tolerance, factor, 1.0)
    )
    return KLControllerState(coef=jnp.clip(state.coef * scale, min_coef, max_coef))

  return KLController(init, update)
