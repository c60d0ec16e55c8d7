"""Host-side preparation of prompt batches: left padding into a bounded set of bucket shapes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_ppo.models.tokenizer import check_token_ids
from jax_ppo.rollout.config import SamplingConfig


def bucket_for(size: int, buckets: Sequence[int], *, what: str) -> int:
  """The smallest bucket >= `size`; a ValueError naming `what` when none fits."""
  for b in buckets:
    if b >= size:
      return b
  raise ValueError(
      f"{what} {size} exceeds the largest bucket {max(buckets)}; add a larger bucket to "
      f"SamplingConfig or split the batch."
  )


def left_pad_prompts(
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    *,
    max_context: int,
    vocab_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token-id prompts to one bucketed length.

  Args:
    prompts: `P` prompts, each a non-empty sequence of token ids.
    config: supplies `pad_token_id`, `prompt_buckets`, `max_new_tokens`, `truncate_prompts`.
    max_context: the model's context length (`max_position_embeddings`).
    vocab_size: when given, every prompt id must lie in `[0, vocab_size)` (checked here, on the
      host, so an out-of-range id never reaches the jitted model, where it would embed as NaN).

  Returns:
    `(input_ids [P, S], attention_mask [P, S])` int32 numpy arrays, left-padded, where `S` is
    the smallest prompt bucket holding the longest prompt, or `max_context - max_new_tokens`
    when no bucket below that does.

  Raises:
    ValueError: an empty prompt (naming its row), or a prompt longer than
      `max_context - max_new_tokens` when `truncate_prompts` is False.
    VocabularyError: (a ValueError) a prompt id outside `[0, vocab_size)`, naming the row, the
      id, its position and the vocabulary size.
  """
  budget = max_context - config.max_new_tokens
  if budget < 1:
    raise ValueError(
        f"SamplingConfig.max_new_tokens={config.max_new_tokens} leaves no room for a prompt in "
        f"the model's context of {max_context} tokens; lower max_new_tokens."
    )
  if len(prompts) == 0:
    raise ValueError("`prompts` is empty; pass at least one prompt.")
  rows = []
  for i, p in enumerate(prompts):
    ids = np.asarray(p, dtype=np.int64).reshape(-1)
    if ids.size == 0:
      raise ValueError(f"Prompt at row {i} is empty; every prompt needs at least one token.")
    if ids.size > budget and not config.truncate_prompts:
      raise ValueError(
          f"Prompt at row {i} has {ids.size} tokens, more than the context "
          f"({max_context}) minus max_new_tokens ({config.max_new_tokens}) = {budget}; "
          "shorten it or set SamplingConfig.truncate_prompts=True to keep its last tokens."
      )
    if vocab_size is not None:  # The whole prompt: a bad id means a tokenizer mismatch.
      check_token_ids(ids, vocab_size, what=f"Prompt at row {i}")
    rows.append(ids[-budget:])  # Left-truncation (a no-op unless truncate_prompts).
  # Buckets that fit the context, plus the context budget itself as the last resort: a run
  # compiles for at most len(prompt_buckets) + 1 prompt lengths.
  candidates = [b for b in config.prompt_buckets if b < budget] + [budget]
  length = bucket_for(max(r.size for r in rows), candidates, what="Prompt length")
  input_ids = np.full((len(rows), length), config.pad_token_id, np.int32)
  mask = np.zeros((len(rows), length), np.int32)
  for i, r in enumerate(rows):
    input_ids[i, length - r.size :] = r
    mask[i, length - r.size :] = 1
  return input_ids, mask
