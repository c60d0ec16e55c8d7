"""Prompt datasets with a deterministic, resumable, shardable order (on Grain).

The order is a Grain `MapDataset`: `range(len)` repeated without end, element `k` mapped to the
`k % len`-th entry of epoch `k // len`'s permutation, `default_rng([seed, epoch]).permutation`
(a new permutation every epoch; `shuffle=False` keeps the given order). A `MapDataset` is a pure
function from an element index to an element, so the order depends only on the seed and the
position (batches consumed so far): every process of a multi-host run computes the same global
order (docs/rlhf_details.md item 19), and a resumed run continues exactly where its checkpoint
left off from the data position alone (the `data_position` the trainer stores with each
checkpoint is the whole iterator state; nothing else needs saving).

Multi-host: batch `p` of `B` prompts is the elements `[p * B, (p + 1) * B)` of that order; the
process with shard index `i` of `n` (`shard=`, e.g. `grain.sharding.ShardByJaxProcess()`, see
`jax_process_shard`) reads only its contiguous `B / n` of them, `[p * B + i * B / n, ...)`, so
the processes' rows, concatenated in process order, are exactly the single-process batch. A
lazy dataset (`PromptDataset.lazy`) tokenizes a prompt only when a batch first reads it, so such
a process tokenizes only its own rows.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class PromptDataset:
  """Token-id prompts, reshuffled every epoch with `seed + epoch`.

  Args:
    prompts: token-id lists (one per prompt), each non-empty, ids ints >= 0 (a ValueError names
      the prompt and position otherwise).
    texts: optional prompt texts, for logging samples.
    seed: shuffling seed, an int in [0, 2**32).
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
      _check_prompt(i, p)
    _check_seed(seed)
    if texts is not None and len(texts) != len(prompts):
      raise ValueError(f"`texts` has {len(texts)} entries for {len(prompts)} prompts.")
    self.prompts = [list(map(int, p)) for p in prompts]
    self.texts = list(texts) if texts is not None else None
    self.seed = int(seed)
    self.shuffle = shuffle
    self._encode: Callable[[int], tuple[Sequence[int], str | None]] | None = None

  @classmethod
  def lazy(cls, size: int, encode: Callable[[int], tuple[Sequence[int], str | None]], *,
           seed: int = 0, shuffle: bool = True) -> PromptDataset:
    """A dataset of `size` prompts tokenized when a batch first needs them.

    `encode(i) -> (token ids, text or None)` tokenizes prompt `i` (and raises a ValueError
    naming its file and line when it cannot); the ids are checked as in the constructor. The
    order, `indices` and `batch` are those of the eager dataset with the same prompts, so a
    process of a multi-host run that reads only its shard of each batch tokenizes only those
    prompts (`jax_ppo.data.files.read_prompts(lazy=True)`). `prompts` and `texts` hold None
    for the prompts not tokenized yet.
    """
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
      raise ValueError(f"PromptDataset.lazy size={size!r} is invalid: give the number of "
                       "prompts (>= 1).")
    _check_seed(seed)
    self = cls.__new__(cls)
    self.prompts = [None] * int(size)
    self.texts = [None] * int(size)
    self.seed = int(seed)
    self.shuffle = shuffle
    self._encode = encode
    return self

  def _tokenized(self, idx: Sequence[int]) -> None:
    """Tokenizes the prompts `idx` of a lazy dataset that are not yet."""
    for i in idx:
      if self.prompts[i] is None:
        ids, text = self._encode(i)
        _check_prompt(i, ids)
        self.prompts[i] = list(map(int, ids))
        self.texts[i] = text

  def __len__(self) -> int:
    return len(self.prompts)

  @functools.cached_property
  def order(self) -> Any:
    """The endless prompt order: a `grain.MapDataset` of dataset indices (element `k` is the
    `k`-th prompt drawn)."""
    import grain

    n = len(self)
    ds = grain.MapDataset.range(n).repeat(None)
    if not self.shuffle:
      return ds
    permutation = functools.lru_cache(maxsize=2)(self._permutation)
    return ds.map_with_index(lambda k, _: int(permutation(k // n)[k % n]))

  def _permutation(self, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s order of the dataset indices."""
    return np.random.default_rng([self.seed, epoch]).permutation(len(self))

  def indices(self, position: int, batch_size: int, *, shard: Any = None) -> list[int]:
    """Dataset indices of batch number `position` (batches of `batch_size` prompts).

    Args:
      position: batches consumed so far (the trainer's data position).
      batch_size: the global batch size `B`.
      shard: None: the whole batch. Otherwise Grain `ShardOptions` (`shard_index`,
        `shard_count`; e.g. `jax_process_shard()`): this shard's contiguous `B / shard_count`
        rows of the batch (`B` must be a multiple of `shard_count`).
    """
    if isinstance(position, bool) or not isinstance(position, numbers.Integral) or position < 0:
      raise ValueError(f"position={position!r} is invalid: use an int >= 0.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or (
        batch_size < 1):
      raise ValueError(f"batch_size={batch_size!r} is invalid: use an int >= 1.")
    start, size = position * batch_size, batch_size
    if shard is not None:
      count, index = int(shard.shard_count), int(shard.shard_index)
      if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard index {index} of {count} is invalid: use 0 <= index < count.")
      if batch_size % count:
        raise ValueError(f"batch_size={batch_size} is not a multiple of the {count} shards "
                         "(processes); choose a batch size they divide.")
      size = batch_size // count
      start += index * size
    order = self.order
    return [int(order[k]) for k in range(start, start + size)]

  def batch(self, position: int, batch_size: int, *,
            shard: Any = None) -> tuple[list[list[int]], list[str] | None]:
    """`(prompt ids, prompt texts or None)` of batch number `position` (this shard's rows with
    `shard`, see `indices`)."""
    idx = self.indices(position, batch_size, shard=shard)
    if self._encode is not None:
      self._tokenized(idx)
    texts = [self.texts[i] for i in idx] if self.texts is not None else None
    return [self.prompts[i] for i in idx], texts


def _check_prompt(i: int, p: Any) -> None:
  """One ValueError naming prompt `i` unless `p` is a non-empty sequence of token ids >= 0."""
  if isinstance(p, str | bytes):
    raise ValueError(f"Prompt {i} of the dataset is text ({p[:40]!r}); pass token ids "
                     "(tokenize it, e.g. with jax_ppo.runs.ppo.load_prompts).")
  if len(p) == 0:
    raise ValueError(f"Prompt {i} of the dataset is empty; every prompt needs a token.")
  if isinstance(p, np.ndarray):
    if p.ndim == 1 and p.dtype.kind in "iu" and p.min() >= 0:
      return
  elif all(type(t) is int and t >= 0 for t in p):
    return  # the common case (tokenizer output); the loop below finds what to report
  for j, token in enumerate(p):
    if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
      shown = repr(token) if isinstance(token, str | bytes) else str(token)
      raise ValueError(f"Prompt {i} of the dataset has {shown} at position {j}; token ids "
                       "are ints >= 0.")


def _check_seed(seed: Any) -> None:
  if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:
    raise ValueError(f"PromptDataset seed={seed!r} is invalid: use an int in [0, 2**32).")


def jax_process_shard() -> Any:
  """This process's shard of every batch: Grain's `ShardByJaxProcess` (shard index
  `jax.process_index()`, count `jax.process_count()`)."""
  import grain

  return grain.sharding.ShardByJaxProcess(drop_remainder=True)
