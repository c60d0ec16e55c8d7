"""Host data of a multi-process run: each process's own rows of the global batch.

In a multi-process (multi-host) job the rollout, the scores and every batch are *global* arrays
whose rows are split over the mesh's batch axes (`data` x `fsdp`, `jax_ppo.parallel.rules.
batch_shardings`); a process holds only the rows of its own devices. This module moves rows
between the host and such arrays without any process holding more than its share:

* `local_row_range(sharding, shape)`: the contiguous rows `[start, stop)` this process's devices
  hold (all rows when the rows are replicated);
* `local_rows(x)`: a host copy of those rows of a global array (`addressable_shards`);
* `global_rows(local, sharding, shape)`: the global array whose rows `[start, stop)` are
  `local` on every process (`jax.make_array_from_process_local_data`);
* `gathered(x)`: the whole array on every host (`multihost_utils.process_allgather`), for the
  few things a process needs in full: the `[B]` scores and masks behind logged metrics, the
  `samples_per_log` rows written to `samples.jsonl`, one tensor of an exported model at a time;
* `sample_local_prompts`: the rollout of a global prompt batch of which each process read,
  padded and placed only its own rows (`PromptDataset.batch(shard=)`), in the same shuffled
  order everywhere, so the global batch is exactly the single-process one.

On one process every function is the plain host round trip (`np.asarray`), so single-process
runs are unchanged. Collectives (`gathered`, the prompt-length agreement) must be called by every
process in the same order, as every SPMD step is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_ppo.parallel.distributed import host_array


def is_global(x: Any) -> bool:
  """Whether `x` is a `jax.Array` with rows on other processes' devices."""
  return isinstance(x, jax.Array) and not x.is_fully_addressable


def multi_process() -> bool:
  """True when more than one process takes part in the computation."""
  return jax.process_count() > 1


def local_row_range(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> tuple[int, int]:
  """`[start, stop)`: the rows (dimension 0) of an array of `shape` placed with `sharding` that
  this process's devices hold.

  Raises:
    ValueError: the rows this process holds are not contiguous (a mesh whose batch axes
      interleave the processes' devices), or it holds none (no device in the mesh).
  """
  indices = sharding.addressable_devices_indices_map(tuple(shape)).values()
  rows = sorted({(s.start or 0, shape[0] if s.stop is None else s.stop)
                 for s in (index[0] for index in indices)})
  if not rows:
    raise ValueError(
        f"This process (index {jax.process_index()}) has no device in the mesh of a batch of "
        f"{shape[0]} rows; every process of a multi-process run needs devices in the mesh "
        "(jax_ppo.parallel.make_mesh over jax.devices()).")
  start, stop = rows[0][0], rows[0][1]
  for a, b in rows[1:]:
    if a > stop:
      raise ValueError(
          f"This process (index {jax.process_index()}) holds the non-contiguous rows {rows} of "
          f"a batch of {shape[0]}; order the mesh so that each process's devices hold one block "
          "of rows (jax_ppo.parallel.make_mesh over jax.devices(), data axis outermost).")
    stop = max(stop, b)
  return start, stop


def local_rows(x: Any) -> np.ndarray:
  """A host copy of this process's rows (`local_row_range`) of `x`; `np.asarray(x)` when `x`
  is fully addressable (one process)."""
  if not is_global(x):
    return np.asarray(x)
  start, stop = local_row_range(x.sharding, x.shape)
  out = np.empty((stop - start, *x.shape[1:]), x.dtype)
  for shard in x.addressable_shards:
    index = (slice((shard.index[0].start or 0) - start,
                   (x.shape[0] if shard.index[0].stop is None else shard.index[0].stop) - start),
             *shard.index[1:])
    out[index] = np.asarray(shard.data)
  return out


def row_sharding(x: jax.Array) -> NamedSharding:
  """The sharding of a `[B]` array split on rows like `x` (a `NamedSharding`)."""
  sharding = x.sharding
  if not isinstance(sharding, NamedSharding):
    raise ValueError(f"Expected rows placed with a NamedSharding, got {sharding}.")
  spec = tuple(sharding.spec)
  return NamedSharding(sharding.mesh, PartitionSpec(spec[0] if spec else None))


def global_rows(local: np.ndarray, sharding: jax.sharding.Sharding,
                shape: Sequence[int]) -> jax.Array:
  """The global array of `shape` placed with `sharding` whose rows `local_row_range(sharding,
  shape)` are `local` (on every process; `jax.make_array_from_process_local_data`)."""
  start, stop = local_row_range(sharding, shape)
  if local.shape != (stop - start, *shape[1:]):
    raise ValueError(f"This process holds rows [{start}, {stop}) of a {tuple(shape)} array but "
                     f"was given {local.shape}.")
  return jax.make_array_from_process_local_data(sharding, local, tuple(shape))


def gathered(x: Any) -> np.ndarray:
  """The whole of `x` on this host: `np.asarray(x)`, or for a global array an all-gather that
  every process must call (`jax_ppo.parallel.distributed.host_array`)."""
  return host_array(x)


def global_max(value: int) -> int:
  """The largest of every process's `value` (one small all-gather; `value` on one process)."""
  if not multi_process():
    return int(value)
  from jax.experimental import multihost_utils

  return int(np.max(multihost_utils.process_allgather(np.asarray([value], np.int32))))


def stop_together(failed: bool, what: str) -> None:
  """Several processes: each says whether `what` failed on its side (one small all-gather), and a
  process where it did not raises too (a `RuntimeError` pointing at the other's error), so that
  no process waits for ever in the next collective. Nothing on one process."""
  if multi_process() and global_max(int(failed)) and not failed:
    raise RuntimeError(f"{what} failed on another process (its error, in that process's output, "
                       f"names the cause and the fix); process {jax.process_index()} stops too.")


def prompt_shard(mesh: Mesh, num_prompts: int) -> tuple[Any, NamedSharding]:
  """Grain `ShardOptions` of this process's rows of a `[num_prompts, S]` prompt batch on `mesh`
  (rows over the batch axes), and that batch's sharding."""
  import grain

  from jax_ppo.parallel.rules import batch_spec

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
  from jax_ppo.rollout.batching import left_pad_prompts

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


__all__ = [
    "gathered",
    "global_max",
    "global_rows",
    "is_global",
    "local_row_range",
    "local_rows",
    "multi_process",
    "prompt_shard",
    "row_sharding",
    "sample_local_prompts",
    "stop_together",
]
