"""Importance weights that correct for the gap between the sampler's and the trainer's
log-probs (rollout correction).

The tokens of a rollout were drawn by the sampler, whose log-probs differ from the ones the
trainer recomputes for the same policy as soon as the two run in another precision, kernel or
engine (a bfloat16 sampler against a float32 trainer, say). Weighting the policy loss by the
ratio of the two corrects the gradient for that mismatch; the ratio is truncated (TIS, Yao et
al. 2025, "Your efficient RL framework secretly brings you off-policy RL training") or turned
into a mask that drops the tokens (or whole sequences) where it is too large.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ppo.core import _checks

Array = jax.Array

CORRECTION_LEVELS = ("token", "sequence")
"""The `level`s of `rollout_correction_weights`."""
CORRECTION_MODES = ("truncate", "mask")
"""The `mode`s of `rollout_correction_weights`."""


def rollout_correction_weights(
    logprobs: Array,
    sampler_logprobs: Array,
    mask: Array,
    *,
    cap: float | Array = 2.0,
    level: str = "token",
    mode: str = "truncate",
) -> Array:
  r"""Importance weights `[B, T]` float32 of the trainer over the sampler, without gradient.

  .. math::  w_{bt} = \exp(\log\pi_{bt} - \log\pi^{sampler}_{bt})  \quad\text{(level "token")},
             \qquad w_{bt} = \exp\Big(\sum_{t'} m_{bt'}(\log\pi_{bt'} -
             \log\pi^{sampler}_{bt'})\Big)  \quad\text{(level "sequence")}

  then `mode="truncate"` (TIS) gives :math:`\min(w, c)` and `mode="mask"` gives
  :math:`[w \le c]` (1 to keep the token or sequence, 0 to drop it). 0 where `mask` is 0.

  Args:
    logprobs: `[B, T]` the trainer's log-probs of the sampled tokens (e.g. the old log-probs it
      recomputed for the behaviour policy).
    sampler_logprobs: `[B, T]` the log-probs the sampler reported for the same tokens.
    mask: `[B, T]` bool or float mask.
    cap: the truncation or masking threshold `c`, > 0.
    level: "token" (one weight per token) or "sequence" (one per row, the product of its token
      ratios, broadcast to its tokens).
    mode: "truncate" or "mask".

  Returns:
    `[B, T]` float32 weights to multiply the per-token policy loss by (under `stop_gradient`).
  """
  _checks.check_rank("logprobs", logprobs, 2, "[B, T]")
  _checks.check_same_shape(logprobs=logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
  _checks.check_choice("level", level, CORRECTION_LEVELS)
  _checks.check_choice("mode", mode, CORRECTION_MODES)
  _checks.check_scalar_range("cap", cap, low=0.0, low_inclusive=False)
  valid = jnp.asarray(mask) != 0
  log_w = jnp.where(valid, jnp.asarray(logprobs, jnp.float32)
                    - jnp.asarray(sampler_logprobs, jnp.float32), 0.0)
  if level == "sequence":
    log_w = jnp.broadcast_to(jnp.sum(log_w, axis=1, keepdims=True), log_w.shape)
  cap = jnp.asarray(cap, jnp.float32)
  if mode == "truncate":
    # min in log space: no overflow to inf for a sequence whose log-ratio sum is large.
    weights = jnp.exp(jnp.minimum(log_w, jnp.log(cap)))
  else:
    weights = (log_w <= jnp.log(cap)).astype(jnp.float32)
  return jax.lax.stop_gradient(jnp.where(valid, weights, 0.0))
