"""Each process's own rows of a PPO prompt batch, read, padded and sampled without any process
holding more than its share (`jax_ppo.parallel.host_rows` moves the rows).

`sample_local_prompts` is the rollout of a global prompt batch of which each process read, padded
and placed only its own rows (`PromptDataset.batch(shard=)`), in the same shuffled order
everywhere, so the global batch is exactly the single-process one. On one process it is never
called (the trainer samples the whole batch).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jax_ppo.parallel.host_rows import global_max, global_rows, local_row_range, stop_together
from jax_ppo.parallel.rules import batch_spec
from jax_ppo.rollout.batching import left_pad_prompts


def prompt_shard(mesh: Mesh, num_prompts: int) -> tuple[Any, NamedSharding]:
  """Grain `ShardOptions` of this process's rows of a `[num_prompts, S]` prompt batch on `mesh`
  (rows over the batch axes), and that batch's sharding."""
  import grain

  sharding = NamedSharding(mesh, batch_spec((num_prompts, 1), mesh))
  start, stop = local_row_range(sharding, (num_prompts, 1))
  size = stop - start
  if start % size or num_prompts % size:
    raise ValueError(f"This process holds rows [{start}, {stop}) of {num_prompts} prompts, not "
                     "one of equal blocks; use a mesh whose batch axes split the prompts evenly.")
  return grain.sharding.ShardOptions(start // size, num_prompts // size), sharding


def sample_local_prompts(sampler: Any, dataset: Any, position: int, num_prompts: int,
                         key: jax.Array, *, state: Any) -> tuple[Any, list | None]:
  """The rollout of prompt batch `position` of `dataset`, each process reading only its rows.

  The prompt rows are split over the batch axes of the sampler's mesh (`sampler.mesh`).

  Every process takes its contiguous rows of the batch (`dataset.batch(position, num_prompts,
  shard=...)`, `prompt_shard`), left-pads them to the prompt bucket of the longest prompt of the
  whole batch (`global_max`: the same bucket as one process padding every row), places them as
  its rows of the global `[P, S]` prompt arrays and samples them with `fold_in(key, 0)`, the key
  of a single-process sampler's one micro-batch. The result equals the single-process rollout.

  Returns:
    `(rollout, this process's prompt texts or None)`.

  Raises:
    ValueError: the sampler would split the batch into micro-batches (`memory_budget_bytes`),
      which a multi-process rollout does not do.
  """
  if sampler.mesh is None:
    raise ValueError("A rollout of each process's own rows needs a sampler on a device mesh "
                     "(Sampler(mesh=...)); this one runs on one device.")
  shard, sharding = prompt_shard(sampler.mesh, num_prompts)
  try:  # (a lazy dataset tokenizes these rows now: a bad prompt is reported here)
    prompts, texts = dataset.batch(position, num_prompts, shard=shard)
    ids, mask = left_pad_prompts(prompts, sampler.config,
                                 max_context=sampler.model_config.max_position_embeddings,
                                 vocab_size=sampler.model_config.vocab_size)
  except ValueError:
    stop_together(True, f"Reading prompt batch {position}")
    raise
  stop_together(False, f"Reading prompt batch {position}")
  length = global_max(ids.shape[1])
  if length > ids.shape[1]:  # another process has a longer prompt: the same bucket everywhere
    extra = length - ids.shape[1]
    ids = np.pad(ids, ((0, 0), (extra, 0)), constant_values=sampler.config.pad_token_id)
    mask = np.pad(mask, ((0, 0), (extra, 0)))
  rows = sampler.micro_batch_size(num_prompts, length)
  if rows != num_prompts:
    raise ValueError(
        f"The sampler splits the {num_prompts} prompts of an update into micro-batches of {rows} "
        "(memory_budget_bytes), which a multi-process run does not do; leave "
        "memory_budget_bytes unset or make it hold the whole batch.")
  shape = (num_prompts, length)
  global_ids = global_rows(ids, sharding, shape)
  global_mask = global_rows(mask, sharding, shape)
  rollout = sampler.generate_padded(global_ids, global_mask, jax.random.fold_in(key, 0),
                                    state=state)
  return rollout, texts


__all__ = ["prompt_shard", "sample_local_prompts"]
