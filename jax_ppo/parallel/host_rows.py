"""Host rows of a multi-process run: each process's own rows of the global batch.

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

On one process every function is the plain host round trip (`np.asarray`), so single-process
runs are unchanged. Collectives (`gathered`, `global_max`, `stop_together`) must be called by every
process in the same order, as every SPMD step is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_ppo.parallel.distributed import host_array, multi_process


def is_global(x: Any) -> bool:
  """Whether `x` is a `jax.Array` with rows on other processes' devices."""
  return isinstance(x, jax.Array) and not x.is_fully_addressable



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


def place_rows(tree: Any, mesh: Mesh) -> Any:
  """Host arrays whose rows (dimension 0) form one global batch -> global arrays on `mesh`,
  rows split over the batch axes (`rules.batch_spec`), into which this process puts only the
  rows its own devices hold (`global_rows`; on one process, all of them). Every process passes
  the same batch; None leaves stay None."""
  from jax_ppo.parallel.rules import batch_spec

  def one(x):
    x = np.asarray(x)
    sharding = NamedSharding(mesh, batch_spec(x.shape, mesh))
    start, stop = local_row_range(sharding, x.shape)
    return global_rows(x[start:stop], sharding, x.shape)

  return jax.tree.map(one, tree)


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


__all__ = [
    "gathered",
    "global_max",
    "global_rows",
    "is_global",
    "local_row_range",
    "local_rows",
    "place_rows",
    "row_sharding",
    "stop_together",
]
