"""Prompt datasets with a deterministic, resumable order.

The order of prompts depends only on the seed and the position (batches consumed so far), so
every host of a multi-host run draws the same prompts (docs/rlhf_details.md item 19) and a resumed
run continues exactly where the checkpoint left off.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np


class PromptDataset:
  """Token-id prompts, reshuffled every epoch with `seed + epoch`.

  Args:
    prompts: token-id lists (one per prompt), each non-empty, ids ints >= 0 (a ValueError names
      the prompt and position otherwise).
    texts: optional prompt texts, for logging samples.
    seed: shuffling seed.
    shuffle: shuffle within each epoch (False keeps the given order).
  """

  def __init__(
      self,
      prompts: Sequence[Sequence[int]],
      *,
      texts: Sequence[str] | None = None,
      seed: int = 0,
      shuffle: bool = True,
  ):
    if len(prompts) == 0:
      raise ValueError("The prompt dataset is empty; pass at least one prompt.")
    for i, p in enumerate(prompts):
      if isinstance(p, str | bytes):
        raise ValueError(f"Prompt {i} of the dataset is text ({p[:40]!r}); pass token ids "
                         "(tokenize it, e.g. with jax_ppo.trainer.run.load_prompts).")
      if len(p) == 0:
        raise ValueError(f"Prompt {i} of the dataset is empty; every prompt needs a token.")
      if isinstance(p, np.ndarray):
        if p.ndim == 1 and p.dtype.kind in "iu" and p.min() >= 0:
          continue
      elif all(type(t) is int and t >= 0 for t in p):
        continue  # the common case (tokenizer output); the loop below finds what to report
      for j, token in enumerate(p):
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
          shown = repr(token) if isinstance(token, str | bytes) else str(token)
          raise ValueError(f"Prompt {i} of the dataset has {shown} at position {j}; token ids "
                           "are ints >= 0.")
    if texts is not None and len(texts) != len(prompts):
      raise ValueError(f"`texts` has {len(texts)} entries for {len(prompts)} prompts.")
    self.prompts = [list(map(int, p)) for p in prompts]
    self.texts = list(texts) if texts is not None else None
    self.seed = seed
    self.shuffle = shuffle

  def __len__(self) -> int:
    return len(self.prompts)

  def _order(self, epoch: int) -> np.ndarray:
    if not self.shuffle:
      return np.arange(len(self))
    return np.random.default_rng([self.seed, epoch]).permutation(len(self))

  def indices(self, position: int, batch_size: int) -> list[int]:
    """Dataset indices of batch number `position` (batches of `batch_size` prompts)."""
    start = position * batch_size
    orders: dict[int, np.ndarray] = {}
    out = []
    for k in range(start, start + batch_size):
      epoch, i = divmod(k, len(self))
      if epoch not in orders:
        orders[epoch] = self._order(epoch)
      out.append(int(orders[epoch][i]))
    return out

  def batch(self, position: int, batch_size: int) -> tuple[list[list[int]], list[str] | None]:
    """`(prompt ids, prompt texts or None)` of batch number `position`."""
    idx = self.indices(position, batch_size)
    texts = [self.texts[i] for i in idx] if self.texts is not None else None
    return [self.prompts[i] for i in idx], texts
