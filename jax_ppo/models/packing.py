"""Attention masks and position ids of packed rows: several sequences in one row of a batch.

A packed row holds sequences one after another, each with its own segment id (the padding at the
end gets any id; `attention_mask` hides it). Every token must see exactly what it would see if
its sequence were run alone: keys of the same segment, at or before it, with positions counted
from the start of its own segment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def restrict_to_segments(
    mask_bst: Array, segment_ids: Array, positions: Array | None
) -> tuple[Array, Array]:
  r"""Limits an attention mask to keys of the query's own segment; fills in default positions.

  .. math::  m'_{bst} = m_{bst} \wedge [g_{bs} = g_{bt}],\qquad
             \mathrm{pos}_{bs} = \max(\textstyle\sum_t m'_{bst} - 1,\ 0)

  With a causal, padding-aware `mask_bst`, the default position is the number of earlier valid
  tokens of the same segment: 0 at the first token of every segment.

  Args:
    mask_bst: `[B, S, S]` bool, True where query `s` may attend to key `t` (causal and padding).
    segment_ids: `[B, S]` int segment of each slot.
    positions: `[B, S]` int position ids given by the caller, or None for the default above.

  Returns:
    `(mask [B, S, S] bool, positions [B, S] int32)`.
  """
  b, s = mask_bst.shape[:2]
  if segment_ids.shape != (b, s):
    raise ValueError(f"`segment_ids` must be [B, S] = {(b, s)}, got shape {segment_ids.shape}.")
  mask_bst = mask_bst & (segment_ids[:, :, None] == segment_ids[:, None, :])
  if positions is None:
    positions = jnp.maximum(jnp.sum(mask_bst, axis=-1) - 1, 0).astype(jnp.int32)
  return mask_bst, positions


__all__ = ["restrict_to_segments"]
