"""Masks and positions derived from token ids and attention masks."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_ppo.core import _checks

Array = jax.Array


def _stop_hits(tokens_bt: Array, stop_token_ids: Sequence[int] | Array) -> Array:
  stop = jnp.asarray(stop_token_ids, jnp.int32).reshape(-1)
  if stop.size == 0:
    raise ValueError("`stop_token_ids` is empty; pass at least one id (usually the EOS id).")
  return jnp.any(tokens_bt[..., None] == stop, axis=-1)


def response_mask_from_stop_tokens(
    tokens: Array, stop_token_ids: Sequence[int] | Array
) -> Array:
  r"""Mask of the valid response tokens: everything up to and including the first stop token.

  .. math::  m_t = [\, \#\{s < t : y_s \in \mathcal{S}\} = 0 \,]

  The stop token itself stays valid so that the policy learns to stop (docs/rlhf_details.md items 1
  and 5); everything after it is padding. Rows without a stop token are valid throughout.

  Args:
    tokens: `[B, T]` int response ids.
    stop_token_ids: sequence or array of stop ids (EOS and any configured stop ids).

  Returns:
    `[B, T]` bool mask.
  """
  _checks.check_rank("tokens", tokens, 2, "[B, T]")
  hits = _stop_hits(jnp.asarray(tokens), stop_token_ids).astype(jnp.int32)
  stops_before = jnp.cumsum(hits, axis=1) - hits
  return stops_before == 0


def truncate_after_stop(
    tokens: Array, stop_token_ids: Sequence[int] | Array, *, pad_token_id: int
) -> tuple[Array, Array, Array]:
  """Replaces everything after the first stop token by PAD (docs/rlhf_details.md item 5).

  Args:
    tokens: `[B, T]` int response ids.
    stop_token_ids: stop ids.
    pad_token_id: id written after the stop token (must differ from EOS, item 1).

  Returns:
    `(tokens, mask, has_stop)`: truncated `[B, T]` ids, the `[B, T]` bool mask of
    `response_mask_from_stop_tokens`, and a `[B]` bool flag that is False for rows that hit the
    length limit without a stop token (for the missing-EOS penalty, item 7).
  """
  mask = response_mask_from_stop_tokens(tokens, stop_token_ids)
  has_stop = jnp.any(_stop_hits(jnp.asarray(tokens), stop_token_ids), axis=1)
  return jnp.where(mask, tokens, pad_token_id), mask, has_stop


def position_ids_from_mask(attention_mask: Array) -> Array:
  r"""Positions of a left- (or right-) padded batch: :math:`p_t = \max(\sum_{s \le t} m_s - 1, 0)`.

  The first real token of every row gets position 0, whatever its left padding
  (docs/rlhf_details.md item 2). Padding slots get position 0; they are never attended to.

  Args:
    attention_mask: `[B, S]` bool or int, 1 on real tokens.

  Returns:
    `[B, S]` int32 positions.
  """
  _checks.check_rank("attention_mask", attention_mask, 2, "[B, S]")
  m = (jnp.asarray(attention_mask) != 0).astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(m, axis=1) - 1, 0)
