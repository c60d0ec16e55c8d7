"""Sampling filters: temperature, top-k and top-p (nucleus) as pure functions of logits.

All functions take `[..., V]` logits and return float32 logits of the same shape in which the
filtered-out entries are `-inf`, so that `jax.random.categorical` never draws them. The defaults
used during RLHF training (`top_k=0`, `top_p=1.0`, docs/rlhf_details.md item 3) return the logits
untouched, and the behaviour log-probabilities are always taken from `logits / temperature`
*before* filtering, the distribution the training forward pass reproduces.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ppo.core import gather_logprobs

Array = jax.Array

NEG_INF = -jnp.inf


def _check_top_k(top_k) -> None:
  if not isinstance(top_k, int) or top_k < 0:
    raise ValueError(f"`top_k` must be an int >= 0 (0 disables it), got {top_k!r}.")


def _check_top_p(top_p) -> None:
  if isinstance(top_p, (int, float)) and not 0.0 < top_p <= 1.0:
    raise ValueError(f"`top_p` must lie in (0, 1] (1 disables it), got {top_p!r}.")


def _check_temperature(temperature) -> None:
  if isinstance(temperature, (int, float)) and not temperature > 0.0:
    raise ValueError(
        f"`temperature` must be > 0, got {temperature!r}; use `greedy=True` for argmax decoding."
    )


def apply_temperature(logits: Array, temperature: float | Array) -> Array:
  """`logits / temperature` in float32. `temperature` > 0, scalar or broadcastable."""
  _check_temperature(temperature)
  return jnp.asarray(logits, jnp.float32) / jnp.asarray(temperature, jnp.float32)


def top_k_filter(logits: Array, top_k: int) -> Array:
  """Keeps the `top_k` largest logits per row (ties with the k-th value kept too).

  Args:
    logits: `[..., V]` logits.
    top_k: static int; 0 (or >= V) leaves the logits unchanged.

  Returns:
    `[..., V]` float32 logits with the rest set to -inf.
  """
  _check_top_k(top_k)
  logits = jnp.asarray(logits, jnp.float32)
  if top_k == 0 or top_k >= logits.shape[-1]:
    return logits
  kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
  return jnp.where(logits >= kth, logits, NEG_INF)


def top_p_filter(logits: Array, top_p: float | Array) -> Array:
  r"""Nucleus filtering (Holtzman et al. 2020): keeps the smallest set of most likely tokens
  whose probability mass reaches `top_p`.

  Token :math:`v` (in descending order of probability) is kept when the mass of the tokens
  strictly more likely than it is below `top_p`; the most likely token is always kept.

  Args:
    logits: `[..., V]` logits (already divided by the temperature).
    top_p: probability mass in (0, 1]; a Python 1.0 returns the logits unchanged without a
      sort. May be a traced scalar.

  Returns:
    `[..., V]` float32 logits with the tokens outside the nucleus set to -inf.
  """
  _check_top_p(top_p)
  logits = jnp.asarray(logits, jnp.float32)
  if isinstance(top_p, (int, float)) and top_p >= 1.0:
    return logits
  sorted_desc = -jnp.sort(-logits, axis=-1)
  probs = jax.nn.softmax(sorted_desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = mass_before < jnp.asarray(top_p, jnp.float32)
  # The smallest kept logit is the threshold; every logit at or above it is in the nucleus.
  threshold = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits >= threshold, logits, NEG_INF)


def filter_logits(
    logits: Array, *, temperature: float | Array = 1.0, top_k: int = 0, top_p: float | Array = 1.0
) -> Array:
  """Temperature, then top-k, then top-p: the distribution tokens are drawn from."""
  return top_p_filter(top_k_filter(apply_temperature(logits, temperature), top_k), top_p)


@functools.partial(jax.jit, static_argnames=("block",))
def categorical(rng: Array, logits: Array, *, block: int = 128) -> Array:
  r"""Draws one index per row of `[B, V]` logits from :math:`\mathrm{softmax}(\mathrm{logits})`
  by inverting the CDF with one uniform per row.

  .. math::  w = e^{\ell - \max \ell},\quad c_j = \textstyle\sum_{i \le j} w_i,\quad
             u \sim U[0, c_{V-1}),\quad \text{token} = \#\{j : c_j \le u\}

  the smallest `j` with :math:`c_j > u`, so an index of zero weight (a `-inf` logit) is never
  drawn. Same distribution as `jax.random.categorical` (Gumbel-max) but one exponential per
  entry and `B` random numbers instead of two logarithms and `B x V` random numbers.

  The CDF is inverted in two levels, so no prefix sum runs over the whole vocabulary (XLA's
  `cumsum` of `[64, 50257]` costs more than the rest of the sampling on CPU): the entries are
  grouped in blocks of `block`, `u` picks a block by the prefix sums of the block totals, and
  then an entry by the prefix sums inside that block. A picked block always has non-zero weight
  (its prefix sum exceeds the previous one), and the remainder of `u` is clamped below the
  block's own total, so rounding can never pick an entry of zero weight.

  Args:
    rng: PRNG key.
    logits: `[B, V]` float logits; `-inf` entries are never drawn (each row needs one finite).
    block: static entries per block (the last block is zero-padded). The function is jitted
      (one program per shape and block, also when called eagerly).

  Returns:
    `[B]` int32 indices.
  """
  logits = jnp.asarray(logits, jnp.float32)
  b, v = logits.shape
  weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
  n_blocks = -(-v // block)
  w = jnp.pad(weights, ((0, 0), (0, n_blocks * block - v))).reshape(b, n_blocks, block)
  block_cdf = jnp.cumsum(jnp.sum(w, axis=-1), axis=-1)  # [B, n_blocks]
  total = block_cdf[:, -1:]
  below = lambda c: jnp.nextafter(c, jnp.zeros_like(c))  # the largest float under `c`
  # The product can round up to `total`; clamping below it keeps `u` inside the last block of
  # non-zero weight.
  u = jnp.minimum(jax.random.uniform(rng, total.shape, jnp.float32) * total, below(total))
  j = jnp.minimum(jnp.sum(block_cdf <= u, axis=-1), n_blocks - 1)  # [B] the block
  before = jnp.take_along_axis(block_cdf, jnp.maximum(j - 1, 0)[:, None], axis=1)
  before = jnp.where(j[:, None] > 0, before, 0.0)
  cdf = jnp.cumsum(jnp.take_along_axis(w, j[:, None, None], axis=1)[:, 0], axis=-1)
  rest = jnp.minimum(u - before, below(cdf[:, -1:]))
  return (j * block + jnp.sum(cdf <= rest, axis=-1)).astype(jnp.int32)


def sample_tokens(
    rng: Array,
    logits: Array,
    *,
    temperature: float | Array = 1.0,
    top_k: int = 0,
    top_p: float | Array = 1.0,
    greedy: bool = False,
) -> tuple[Array, Array]:
  r"""Draws one token per row and returns it with its behaviour log-probability.

  Args:
    rng: PRNG key.
    logits: `[B, V]` next-token logits.
    temperature: sampling temperature > 0 (also used for the log-probability).
    top_k: static int, 0 disables.
    top_p: nucleus mass in (0, 1], 1 disables.
    greedy: static bool; argmax decoding (filters and `rng` are ignored).

  Returns:
    `(tokens [B] int32, logprobs [B] float32)` where
    :math:`\mathrm{logprobs} = \log\mathrm{softmax}(\mathrm{logits}/T)[\mathrm{token}]`,
    the unfiltered tempered distribution that training recomputes (docs/rlhf_details.md item 3).
  """
  if logits.ndim != 2:
    raise ValueError(f"`logits` must have layout [B, V], got shape {tuple(logits.shape)}.")
  if greedy:
    tokens = jnp.argmax(logits, axis=-1)
  else:
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = categorical(rng, filtered)
  tokens = tokens.astype(jnp.int32)
  logprobs = gather_logprobs(logits[:, None, :], tokens[:, None], temperature)[:, 0]
  return tokens, logprobs
