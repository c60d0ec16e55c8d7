"""Reading a safetensors checkpoint straight into sharded parameters.

`from_pretrained(path, mesh=mesh)` (and `load_scalar_model`) call `read_sharded`: every
parameter is created with `jax.make_array_from_callback` and its `NamedSharding`
(`rules.param_shardings`); the callback of one device reads only that device's slice of the
checkpoint tensor(s) with `safe_open(...).get_slice(name)[...]` (memory-mapped, so the rest of
the tensor is never copied), transposes it from torch's `[out, in]` layout when needed and casts
it to the parameter dtype. A stacked `[L, ...]` parameter reads one slice per layer of its
shard. Host memory therefore peaks near one device's shard of one parameter, whatever the model
size, and on a multi-host mesh each process reads only the shards of its own devices.

Saving needs no special path: `save_pretrained` already copies one tensor (one layer of a
stacked parameter) to the host at a time, so a sharded model is gathered tensor by tensor.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open

from jax_ppo.parallel.rules import partition_spec

Path = tuple[str, ...]


def _bounds(index: Sequence[slice], shape: Sequence[int]) -> list[tuple[int, int]]:
  out = []
  for sl, n in zip(index, shape, strict=True):
    start, stop, step = sl.indices(n)
    if step != 1:
      raise ValueError(f"Unexpected strided shard index {index}.")
    out.append((start, stop))
  return out


def _read_slice(file: str, name: str, bounds: Sequence[tuple[int, int]], *, transpose: bool,
                offset: int, dtype) -> np.ndarray:
  """`ours[bounds]` of the parameter slot that starts at column `offset` of tensor `name`."""
  from jax_ppo.models.checkpoint import _REWRITE
  from jax_ppo.models.errors import ModelFileError

  bounds = list(bounds)
  lo, hi = bounds[-1]
  bounds[-1] = (lo + offset, hi + offset)  # fused tensors (GPT-2 c_attn): our slot's columns
  hf = list(reversed(bounds)) if transpose else bounds
  try:
    with safe_open(file, framework="numpy") as f:
      part = f.get_slice(name)[tuple(slice(a, b) for a, b in hf)]
  except (SafetensorError, OSError) as e:
    raise ModelFileError(
        f"Cannot read tensor {name!r} from {file} ({e}); the file is corrupt; {_REWRITE}."
    ) from e
  part = np.asarray(part)
  if transpose:
    part = part.T
  return np.ascontiguousarray(part, dtype=np.dtype(dtype))


def read_sharded(flat: dict[Path, object], path: str, index: dict[str, str], specs: list,
                 mesh: Mesh, *, model_type: str) -> dict[Path, jax.Array]:
  """Fills the abstract leaves of `flat` (parameter path -> `ShapeDtypeStruct` or array) from
  the checkpoint folder `path` as arrays sharded on `mesh`; concrete leaves are placed with
  their sharding too.

  Args:
    flat: flattened pure-dict state of the abstract model.
    path: checkpoint folder; `index` maps tensor names to its files.
    specs: the `TensorSpec`s (`jax_ppo.models.checkpoint.tensor_specs`) that fill `flat`.
    mesh: the device mesh.
    model_type: for error messages.

  Raises:
    ModelFileError: a tensor whose shape differs from the model's (naming both shapes), or an
      unreadable file.
  """
  from jax_ppo.models.checkpoint import _hf_shape, _tensor_shape
  from jax_ppo.models.errors import ModelFileError

  # (parameter path, layer or None) -> (file, tensor name, transpose, column offset)
  sources: dict[tuple[Path, int | None], tuple[str, str, bool, int]] = {}
  for spec in specs:
    slot_shapes = [flat[p].shape if spec.layer is None else flat[p].shape[1:] for p in spec.paths]
    want = _hf_shape(spec, slot_shapes)
    have = _tensor_shape(path, index, spec.name)
    if have != want:
      raise ModelFileError(
          f"Shape mismatch for tensor {spec.name!r} of {path!r}: the checkpoint has {have}, the "
          f"{model_type} model expects {want}."
      )
    file = os.path.join(path, index[spec.name])
    offset = 0
    for p, shape in zip(spec.paths, slot_shapes, strict=True):
      sources[(p, spec.layer)] = (file, spec.name, spec.transpose, offset if len(spec.paths) > 1
                                  else 0)
      offset += shape[-1]

  out = {}
  for p, leaf in flat.items():
    sharding = jax.sharding.NamedSharding(mesh, partition_spec(p, leaf.shape, mesh))
    if not isinstance(leaf, jax.ShapeDtypeStruct):
      out[p] = jax.device_put(leaf, sharding)
      continue
    stacked = (p, None) not in sources

    def callback(idx, p=p, leaf=leaf, stacked=stacked):
      bounds = _bounds(idx, leaf.shape)
      if not stacked:
        file, name, transpose, offset = sources[(p, None)]
        return _read_slice(file, name, bounds, transpose=transpose, offset=offset,
                           dtype=leaf.dtype)
      layers = []
      for layer in range(*bounds[0]):
        file, name, transpose, offset = sources[(p, layer)]
        layers.append(_read_slice(file, name, bounds[1:], transpose=transpose, offset=offset,
                                  dtype=leaf.dtype))
      return np.stack(layers)

    out[p] = jax.make_array_from_callback(leaf.shape, sharding, callback)
  return out
