"""Per-token log-probabilities and entropies from logits.

Both functions work on `logits / temperature` in float32, whatever the logits' dtype, so that
sampling, old, reference and new log-probabilities share one set of numerics
(docs/rlhf_details.md items 3 and 4). They never call `jax.nn.log_softmax` on the whole tensor: the
log-partition `logsumexp(z)` is a reduction that XLA fuses with the float32 upcast, so at most one
float32 `[B, T, V]` copy exists even for bfloat16 logits (V is ~150k for Qwen).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ppo.core import _checks

Array = jax.Array


def _scaled_logits(logits_btv: Array, temperature) -> Array:
  _checks.check_rank("logits", logits_btv, 3, "[B, T, V]")
  _checks.check_scalar_range("temperature", temperature, low=0.0, low_inclusive=False)
  return logits_btv.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)


def gather_logprobs(logits: Array, tokens: Array, temperature: float | Array = 1.0) -> Array:
  r"""Log-probabilities of `tokens` under `softmax(logits / temperature)`.

  .. math::  \log \pi(y_t) = z_{t, y_t} - \log \sum_v \exp z_{t, v},
             \quad z = \text{logits} / \tau

  Args:
    logits: `[B, T, V]` float logits of any dtype; position `t` scores token `tokens[:, t]`
      (i.e. the caller has already shifted logits by one relative to the input ids).
    tokens: `[B, T]` integer token ids in `[0, V)`.
    temperature: positive scalar (Python float or float32 array) dividing the logits; must be
      the sampling temperature (docs/rlhf_details.md item 3).

  Returns:
    `[B, T]` float32 log-probabilities.
  """
  _checks.check_rank("tokens", tokens, 2, "[B, T]")
  if _checks.shape_of(logits)[:2] != _checks.shape_of(tokens):
    raise ValueError(
        f"`logits` [B, T, V] and `tokens` [B, T] disagree: `logits` {_checks.shape_of(logits)}, "
        f"`tokens` {_checks.shape_of(tokens)}."
    )
  z = _scaled_logits(logits, temperature)
  picked = jnp.take_along_axis(z, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(z, axis=-1)


def entropy_from_logits(logits: Array, temperature: float | Array = 1.0) -> Array:
  r"""Entropy of the categorical distribution `softmax(logits / temperature)` per position.

  .. math::  H_t = \log \sum_v e^{z_{t,v}} - \sum_v p_{t,v} z_{t,v}

  Args:
    logits: `[B, T, V]` float logits of any dtype.
    temperature: positive scalar dividing the logits.

  Returns:
    `[B, T]` float32 entropies in nats.
  """
  z = _scaled_logits(logits, temperature)
  # Shifting by the row maximum leaves the distribution unchanged but keeps `lse` and `p . z`
  # small, so their difference does not cancel catastrophically for peaked distributions with
  # large logits (which otherwise gives entropies that are slightly negative).
  z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
  p = jnp.exp(z - lse)
  # Masked vocabulary entries (z = -inf) have p = 0 and contribute nothing, not 0 * inf = nan.
  # `z` itself is replaced before the product (not only the product afterwards): otherwise the
  # backward pass of `p * z` computes 0 * (-inf) = nan and the gradient is nan everywhere.
  z_finite = jnp.where(p > 0, z, 0.0)
  return lse[..., 0] - jnp.sum(p * z_finite, axis=-1)
