"""Clipped PPO policy and value losses and the entropy bonus.

Every loss returns `(loss, metrics)`: a float32 scalar and a dict of float32 scalars. Per-token
losses are aggregated over valid tokens by one of three reductions:

- `"token-mean"` (default): :math:`\\sum_{b,t} m_{bt} \\ell_{bt} / \\sum_{b,t} m_{bt}`;
- `"seq-mean-token-mean"`: the mean over rows of each row's token mean;
- `"seq-mean-token-sum"`: the mean over rows of each row's token sum;
- `"token-sum-norm"` (Dr. GRPO, Liu et al. 2025): :math:`\\sum_{b,t} m_{bt} \\ell_{bt} / (B T)`,
  the masked sum over the batch divided by the padded size, whatever the valid counts, so that
  no response is weighted by its own length.

Rows without any valid token are left out of the sequence-level means. Metrics are always token
means over valid tokens.

Besides PPO's clipped surrogate, two policy-gradient variants of the GRPO family:
`gspo_policy_loss` (one length-normalised importance ratio per sequence, clipped per sequence)
and `cispo_policy_loss` (a clipped, stop-gradient importance weight on the log-prob's gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ppo.core import _checks
from jax_ppo.core.logprobs import entropy_from_logits
from jax_ppo.core.stats import masked_mean

Array = jax.Array


def aggregate_loss(loss: Array, mask: Array, reduction: str = "token-mean") -> Array:
  """Reduces a `[B, T]` per-token loss over valid tokens (see the module docstring).

  Args:
    loss: `[B, T]` per-token loss.
    mask: `[B, T]` bool or float mask.
    reduction: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum" or "token-sum-norm".

  Returns:
    float32 scalar.
  """
  _checks.check_choice("reduction", reduction, _checks.REDUCTIONS)
  _checks.check_rank("loss", loss, 2, "[B, T]")
  _checks.check_same_shape(loss=loss, mask=mask)
  if reduction == "token-mean":
    return masked_mean(loss, mask)
  w = jnp.asarray(mask).astype(jnp.float32)
  per_row = jnp.sum(jnp.where(w != 0, jnp.asarray(loss, jnp.float32), 0.0) * w, axis=1)
  if reduction == "token-sum-norm":
    return jnp.sum(per_row) / float(w.shape[0] * w.shape[1])
  count = jnp.sum(w, axis=1)
  if reduction == "seq-mean-token-mean":
    per_row = per_row / jnp.where(count != 0, count, 1.0)
  return masked_mean(per_row, count != 0)


def ppo_policy_loss(
    logprobs: Array,
    old_logprobs: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    reduction: str = "token-mean",
) -> tuple[Array, dict[str, Array]]:
  r"""PPO's clipped surrogate objective, as a loss to minimise.

  Schulman et al. (2017), "Proximal Policy Optimization Algorithms", eq. (7); asymmetric
  "clip-higher" bounds from Yu et al. (2025), "DAPO"; dual clip from Ye et al. (2020),
  "Mastering Complex Control in MOBA Games with Deep RL". With
  :math:`\rho = \exp(\log\pi - \log\pi_{old})`:

  .. math::  \ell = \max(-A\rho,\; -A\,\mathrm{clip}(\rho, 1 - \epsilon, 1 + \epsilon_{high})),
             \qquad \ell \leftarrow \min(\ell, -cA) \text{ where } A < 0 \text{ (dual clip } c)

  Args:
    logprobs: `[B, T]` log-probabilities under the policy being optimised (differentiable).
    old_logprobs: `[B, T]` log-probabilities under the behaviour policy (no gradient is taken).
    advantages: `[B, T]` advantages (or `[B]` sequence advantages broadcast by the caller).
    mask: `[B, T]` bool or float mask.
    clip_eps: lower (and default upper) clip range, > 0.
    clip_eps_high: upper clip range, > 0; `None` uses `clip_eps`.
    dual_clip: the constant `c > 1` capping the loss of negative-advantage tokens, or `None`.
    reduction: a name of `REDUCTIONS` (see the module docstring).

  Returns:
    `(loss, metrics)` with metrics `clipfrac` (share of valid tokens where the clipped term is
    the larger), `dual_clipfrac` (share capped by the dual clip), `approx_kl` (masked mean of
    :math:`\frac12(\log\pi - \log\pi_{old})^2`), `ratio_mean` and `ratio_var`.
  """
  _checks.check_rank("logprobs", logprobs, 2, "[B, T]")
  _checks.check_same_shape(
      logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask
  )
  _checks.check_choice("reduction", reduction, _checks.REDUCTIONS)
  _checks.check_scalar_range("clip_eps", clip_eps, low=0.0, low_inclusive=False)
  _checks.check_scalar_range("clip_eps_high", clip_eps_high, low=0.0, low_inclusive=False)
  _checks.check_scalar_range("dual_clip", dual_clip, low=1.0, low_inclusive=False)
  valid = jnp.asarray(mask) != 0
  # Padding gets log-ratio 0 (ratio 1, KL 0) and advantage 0, so even NaN there cannot leak
  # into gradients through the `where` (docs/rlhf_details.md item 9).
  old = jax.lax.stop_gradient(jnp.asarray(old_logprobs, jnp.float32))
  log_ratio = jnp.where(valid, jnp.asarray(logprobs, jnp.float32) - old, 0.0)
  adv = jnp.where(valid, jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32)), 0.0)
  ratio = jnp.exp(log_ratio)
  high = clip_eps if clip_eps_high is None else clip_eps_high
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + high)
  per_token = jnp.maximum(unclipped, clipped)
  metrics = {"clipfrac": masked_mean(clipped > unclipped, mask)}
  if dual_clip is not None:
    cap = -dual_clip * adv
    capped = (adv < 0) & (per_token > cap)
    per_token = jnp.where(adv < 0, jnp.minimum(per_token, cap), per_token)
    metrics["dual_clipfrac"] = masked_mean(capped, mask)
  else:
    metrics["dual_clipfrac"] = jnp.zeros((), jnp.float32)
  loss = aggregate_loss(per_token, mask, reduction)
  ratio_mean = masked_mean(ratio, mask)
  metrics.update(
      approx_kl=masked_mean(0.5 * jnp.square(log_ratio), mask),
      ratio_mean=ratio_mean,
      ratio_var=masked_mean(jnp.square(ratio - ratio_mean), mask),
      policy_loss=loss,
  )
  return loss, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), metrics)


def ppo_value_loss(
    values: Array,
    old_values: Array,
    returns: Array,
    mask: Array,
    *,
    clip_eps: float | None = 0.2,
    reduction: str = "token-mean",
) -> tuple[Array, dict[str, Array]]:
  r"""Clipped value loss around the values of the rollout (`cliprange_value`).

  .. math::  \ell = \tfrac12 \max\big((V - R)^2,\;
             (\mathrm{clip}(V, V_{old} - \epsilon, V_{old} + \epsilon) - R)^2\big)

  as in OpenAI baselines' PPO2 and lm-human-preferences (docs/rlhf_details.md item 12).

  Args:
    values: `[B, T]` predictions of the critic being optimised (differentiable).
    old_values: `[B, T]` critic predictions at rollout time.
    returns: `[B, T]` targets (from `gae`).
    mask: `[B, T]` bool or float mask.
    clip_eps: clip range > 0, or `None` for the plain squared error.
    reduction: a name of `REDUCTIONS` (see the module docstring).

  Returns:
    `(loss, metrics)` with metrics `clipfrac` (share of valid tokens where the clipped term is
    the larger), `value_mean` and `value_loss`.
  """
  _checks.check_rank("values", values, 2, "[B, T]")
  _checks.check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
  _checks.check_choice("reduction", reduction, _checks.REDUCTIONS)
  _checks.check_scalar_range("clip_eps", clip_eps, low=0.0, low_inclusive=False)
  valid = jnp.asarray(mask) != 0
  v = jnp.where(valid, jnp.asarray(values, jnp.float32), 0.0)
  v_old = jnp.where(valid, jax.lax.stop_gradient(jnp.asarray(old_values, jnp.float32)), 0.0)
  r = jnp.where(valid, jax.lax.stop_gradient(jnp.asarray(returns, jnp.float32)), 0.0)
  unclipped = jnp.square(v - r)
  if clip_eps is None:
    per_token = 0.5 * unclipped
    clipfrac = jnp.zeros((), jnp.float32)
  else:
    clipped = jnp.square(jnp.clip(v, v_old - clip_eps, v_old + clip_eps) - r)
    per_token = 0.5 * jnp.maximum(unclipped, clipped)
    clipfrac = masked_mean(clipped > unclipped, mask)
  loss = aggregate_loss(per_token, mask, reduction)
  metrics = {"clipfrac": clipfrac, "value_mean": masked_mean(v, mask), "value_loss": loss}
  return loss, metrics


def entropy_bonus(
    logits: Array, mask: Array, *, temperature: float | Array = 1.0, reduction: str = "token-mean"
) -> tuple[Array, dict[str, Array]]:
  r"""Masked mean entropy of the policy, to be added to the objective (subtracted from the loss
  with a coefficient, e.g. 0.01).

  .. math::  \bar H = \mathrm{reduce}_{m}\, H\big(\mathrm{softmax}(\text{logits}_t / \tau)\big)

  Args:
    logits: `[B, T, V]` logits at the response positions.
    mask: `[B, T]` bool or float mask.
    temperature: the sampling temperature.
    reduction: a name of `REDUCTIONS` (see the module docstring).

  Returns:
    `(entropy, metrics)`: the aggregated entropy (float32 scalar, positive) and
    `{"entropy": entropy}`.
  """
  _checks.check_rank("logits", logits, 3, "[B, T, V]")
  _checks.check_rank("mask", mask, 2, "[B, T]")
  _checks.check_per_token("logits", logits, "[B, T, V]", "mask", mask)
  entropy = aggregate_loss(entropy_from_logits(logits, temperature), mask, reduction)
  return entropy, {"entropy": entropy}


def gspo_policy_loss(
    logprobs: Array,
    old_logprobs: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_eps: float = 3e-4,
    clip_eps_high: float = 4e-4,
) -> tuple[Array, dict[str, Array]]:
  r"""GSPO's sequence-level clipped objective (Zheng et al. 2025, "Group Sequence Policy
  Optimization"), as a loss to minimise.

  One importance ratio per sequence, the geometric mean of its token ratios (length-normalised,
  so that long and short responses have ratios of one scale), clipped per sequence:

  .. math::  s_b = \exp\Big(\frac{1}{|y_b|}\sum_t m_{bt}(\log\pi_{bt} - \log\pi^{old}_{bt})\Big),
             \qquad \ell_b = \max\big(-A_b s_b,\; -A_b\,\mathrm{clip}(s_b, 1 - \epsilon,
             1 + \epsilon_{high})\big)

  and the loss is the mean of :math:`\ell_b` over the sequences with at least one valid token.
  The clip ranges are those of the paper (3e-4 and 4e-4): a sequence ratio moves far less than
  a token's.

  Args:
    logprobs: `[B, T]` log-probabilities under the policy being optimised (differentiable).
    old_logprobs: `[B, T]` log-probabilities under the behaviour policy (no gradient is taken).
    advantages: `[B]` one advantage per sequence (e.g. `grpo_advantages`).
    mask: `[B, T]` bool or float mask (a float mask weights the tokens of the mean).
    clip_eps: lower clip range, > 0.
    clip_eps_high: upper clip range, > 0.

  Returns:
    `(loss, metrics)` with metrics `clipfrac` (share of those sequences where the clipped term
    is the larger), `approx_kl` (token mean of :math:`\frac12(\log\pi - \log\pi_{old})^2`),
    `ratio_mean` and `ratio_var` (of :math:`s_b` over those sequences) and `policy_loss`.
  """
  _checks.check_rank("logprobs", logprobs, 2, "[B, T]")
  _checks.check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
  _checks.check_per_row("advantages", advantages, "logprobs", logprobs)
  _checks.check_scalar_range("clip_eps", clip_eps, low=0.0, low_inclusive=False)
  _checks.check_scalar_range("clip_eps_high", clip_eps_high, low=0.0, low_inclusive=False)
  valid = jnp.asarray(mask) != 0
  old = jax.lax.stop_gradient(jnp.asarray(old_logprobs, jnp.float32))
  log_ratio = jnp.where(valid, jnp.asarray(logprobs, jnp.float32) - old, 0.0)
  seq_log_ratio = masked_mean(log_ratio, mask, axis=1)  # [B]; 0 for a row without tokens
  has_tokens = jnp.any(valid, axis=1)
  adv = jnp.where(has_tokens, jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32)), 0.0)
  ratio = jnp.exp(seq_log_ratio)
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
  loss = masked_mean(jnp.maximum(unclipped, clipped), has_tokens)
  ratio_mean = masked_mean(ratio, has_tokens)
  metrics = {
      "clipfrac": masked_mean(clipped > unclipped, has_tokens),
      "approx_kl": masked_mean(0.5 * jnp.square(log_ratio), mask),
      "ratio_mean": ratio_mean,
      "ratio_var": masked_mean(jnp.square(ratio - ratio_mean), has_tokens),
      "policy_loss": loss,
  }
  return loss, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), metrics)


def cispo_policy_loss(
    logprobs: Array,
    old_logprobs: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_eps_low: float | None = None,
    clip_eps_high: float = 0.2,
    reduction: str = "token-mean",
) -> tuple[Array, dict[str, Array]]:
  r"""CISPO (MiniMax 2025, "MiniMax-M1"): REINFORCE with a clipped importance-sampling weight.

  Unlike PPO, no token is dropped from the gradient when its ratio leaves the trust region: the
  weight is clipped instead, and held constant:

  .. math::  \ell_t = -\,\mathrm{sg}\big(\mathrm{clip}(\rho_t, 1 - \epsilon_{low},
             1 + \epsilon_{high})\big)\, A_t \log\pi_t, \qquad \rho_t = \exp(\log\pi_t -
             \log\pi^{old}_t)

  so :math:`\nabla\ell_t = -\hat\rho_t A_t \nabla\log\pi_t`. The loss's value is not an
  objective to read, its gradient is what counts.

  Args:
    logprobs: `[B, T]` log-probabilities under the policy being optimised (differentiable).
    old_logprobs: `[B, T]` log-probabilities under the behaviour policy (no gradient is taken).
    advantages: `[B, T]` advantages (broadcast sequence advantages over the tokens first).
    mask: `[B, T]` bool or float mask.
    clip_eps_low: lower clip range, > 0; `None` (MiniMax-M1's setting) leaves the weight
      unbounded below.
    clip_eps_high: upper clip range, > 0.
    reduction: a name of `REDUCTIONS` (see the module docstring).

  Returns:
    `(loss, metrics)` with metrics `clipfrac` (share of valid tokens whose ratio was clipped),
    `approx_kl` (masked mean of :math:`\frac12(\log\pi - \log\pi_{old})^2`), `ratio_mean`,
    `ratio_var` and `policy_loss`.
  """
  _checks.check_rank("logprobs", logprobs, 2, "[B, T]")
  _checks.check_same_shape(
      logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask
  )
  _checks.check_choice("reduction", reduction, _checks.REDUCTIONS)
  _checks.check_scalar_range("clip_eps_low", clip_eps_low, low=0.0, low_inclusive=False)
  _checks.check_scalar_range("clip_eps_high", clip_eps_high, low=0.0, low_inclusive=False)
  valid = jnp.asarray(mask) != 0
  lp = jnp.where(valid, jnp.asarray(logprobs, jnp.float32), 0.0)
  old = jax.lax.stop_gradient(jnp.asarray(old_logprobs, jnp.float32))
  log_ratio = jnp.where(valid, lp - old, 0.0)
  adv = jnp.where(valid, jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32)), 0.0)
  ratio = jnp.exp(jax.lax.stop_gradient(log_ratio))
  low = None if clip_eps_low is None else 1.0 - clip_eps_low
  weight = jnp.clip(ratio, low, 1.0 + clip_eps_high)
  loss = aggregate_loss(-weight * adv * lp, mask, reduction)
  ratio_mean = masked_mean(ratio, mask)
  metrics = {
      "clipfrac": masked_mean(weight != ratio, mask),
      "approx_kl": masked_mean(0.5 * jnp.square(log_ratio), mask),
      "ratio_mean": ratio_mean,
      "ratio_var": masked_mean(jnp.square(ratio - ratio_mean), mask),
      "policy_loss": loss,
  }
  return loss, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), metrics)
