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
  _checks.check_per_token("logits", logits, "[B, T, V]", "tokens", tokens)
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


def chunked_logprobs(
    hidden: Array,
    head,
    tokens: Array,
    temperature: float | Array = 1.0,
    *,
    chunk_size: int,
    entropy: str | None = "grad",
) -> tuple[Array, Array | None]:
  r"""`gather_logprobs` and `entropy_from_logits` of `head(hidden)`, `chunk_size` positions at a
  time, without ever holding the `[B, T, V]` logits.

  The sequence axis is cut into `ceil(T / chunk_size)` chunks (the last one padded); a
  `lax.map` projects each chunk to its `[B, chunk_size, V]` logits, reduces them to log-probs
  (and entropies) and drops them. Each chunk is under `jax.checkpoint`, so the backward pass
  keeps only the `[B, chunk_size, D]` hidden states and recomputes the chunk's logits: peak
  memory of the logits goes from `B * T * V` floats (forward and backward) to
  `B * chunk_size * V`. The numbers are those of the unchunked functions on `head(hidden)`
  (per position the same float32 reductions; gradients of `head`'s parameters are summed over
  chunks, so they agree up to float summation order).

  Args:
    hidden: `[B, T, D]` hidden states; position `t` scores `tokens[:, t]`.
    head: a function `[B, C, D] -> [B, C, V]` logits (any float dtype), e.g. the model's
      `logits_from_hidden`; it may close over traced parameters (their gradients flow).
    tokens: `[B, T]` integer token ids in `[0, V)`.
    temperature: positive scalar dividing the logits (the sampling temperature).
    chunk_size: static positive int, positions per chunk (`>= T` means one chunk).
    entropy: `"grad"` (entropy with its gradient), `"no_grad"` (entropy under
      `stop_gradient`: no backward pass through it) or None (not computed).

  Returns:
    `(logprobs, entropy)`: `[B, T]` float32 each; `entropy` is None when not computed.
  """
  _checks.check_rank("hidden", hidden, 3, "[B, T, D]")
  _checks.check_rank("tokens", tokens, 2, "[B, T]")
  _checks.check_per_token("hidden", hidden, "[B, T, D]", "tokens", tokens)
  if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
    raise ValueError(f"`chunk_size` must be a positive int, got {chunk_size!r}.")
  if entropy not in ("grad", "no_grad", None):
    raise ValueError(f"`entropy` must be 'grad', 'no_grad' or None, got {entropy!r}.")
  b, t, d = hidden.shape
  c = min(chunk_size, t)
  n = -(-t // c)
  pad = n * c - t
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
  tok = jnp.pad(tokens, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)

  @jax.checkpoint
  def one_chunk(h_c: Array, tok_c: Array) -> tuple[Array, Array]:
    logits = head(h_c)
    lp = gather_logprobs(logits, tok_c, temperature)
    if entropy is None:
      return lp, jnp.zeros_like(lp)
    src = logits if entropy == "grad" else jax.lax.stop_gradient(logits)
    return lp, entropy_from_logits(src, temperature)

  lp, ent = jax.lax.map(lambda xs: one_chunk(*xs), (h, tok))
  unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  return unchunk(lp), (None if entropy is None else unchunk(ent))
