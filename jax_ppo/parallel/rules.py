"""Logical-axis rules: which mesh axis splits which dimension of every parameter and batch.

Each parameter dimension has a *logical* name (`LOGICAL_AXES` below), given by the parameter's
kind (`PARAM_AXES`: embedding, attention query/key/value/output, MLP, vocabulary head, norms,
LoRA adapters, scalar heads) and read from its path in the model state, so the same rules hold
for every family of the unified decoder (`jax_ppo.models.transformer`) and for any pytree whose
paths contain the parameter paths: an `nnx.State`, a `TrainState`, `FrozenParams` and the
optimizer state (Adam's `mu` and `nu` mirror the parameters). `MESH_RULES` maps logical names
onto mesh axes (`jax_ppo.parallel.mesh.AXES`):

=========== ============ ==========================================================
logical     mesh axis    dimensions
=========== ============ ==========================================================
layers      (none)       the leading `[L]` axis of the stacked blocks
embed       fsdp         the model width `D` of every matrix (ZeRO-3 sharding)
heads       tensor       `H * Dh` of the query and output projections
kv_heads    tensor       `K * Dh` of the key and value projections
mlp         tensor       the MLP hidden width `F`
vocab       tensor       `V` of the embedding and the LM head
batch       data, fsdp   rows of batches, rollouts and the KV cache
=========== ============ ==========================================================

Norm gains and biases, LoRA ranks, positions and the scalar heads' `[D, 1]` kernels are
replicated. A dimension that the mesh axis does not divide is replicated rather than split
(`partition_spec`), so any mesh runs any model; only memory is lost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_ppo.parallel.mesh import BATCH_AXES

#: Logical axis -> mesh axis (or tuple of axes, or None: replicated).
MESH_RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "batch": BATCH_AXES,
    "norm": None,
    "rank": None,
    "positions": None,
    "scalar": None,
}
LOGICAL_AXES = tuple(MESH_RULES)

#: Logical axes of the trailing dimensions of each `(module, variable)` kind; leading dimensions
#: beyond them are stack axes (`layers`). LoRA adapters take the axes of the kernel they adapt
#: (`A`: `[in, rank]`, `B`: `[rank, out]`).
PARAM_AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("pos_embed", "embedding"): ("positions", "embed"),
    ("q", "kernel"): ("embed", "heads"),
    ("k", "kernel"): ("embed", "kv_heads"),
    ("v", "kernel"): ("embed", "kv_heads"),
    ("o", "kernel"): ("heads", "embed"),
    ("gate", "kernel"): ("embed", "mlp"),
    ("up", "kernel"): ("embed", "mlp"),
    ("down", "kernel"): ("mlp", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("q", "bias"): ("heads",),
    ("k", "bias"): ("kv_heads",),
    ("v", "bias"): ("kv_heads",),
    ("gate", "bias"): ("mlp",),
    ("up", "bias"): ("mlp",),
    ("o", "bias"): ("norm",),
    ("down", "bias"): ("norm",),
    ("value_head", "kernel"): ("scalar", "scalar"),
    ("value_head", "bias"): ("scalar",),
    ("score_head", "kernel"): ("scalar", "scalar"),
    ("score_head", "bias"): ("scalar",),
}
_VARIABLES = ("kernel", "bias", "scale", "embedding", "lora_a", "lora_b")


def _names(path: Sequence[Any]) -> list[str]:
  out = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        out.append(str(getattr(key, attr)))
        break
    else:
      out.append(str(key))
  return out


def logical_axes(path: Sequence[Any], shape: Sequence[int]) -> tuple[str | None, ...]:
  """Logical names of the dimensions of the array at `path` (a `jax.tree_util` key path or a
  sequence of names) with `shape`; `None` for dimensions no rule names (replicated).

  The parameter kind is the last `(module, variable)` pair of the path, e.g.
  `("decoder", "layers", "q", "kernel")` -> `("layers", "embed", "heads")` for `[L, D, H*Dh]`.
  """
  names = _names(path)
  rank = len(shape)
  found = [i for i, n in enumerate(names) if n in _VARIABLES and i > 0]
  if not found or rank == 0:
    return (None,) * rank
  i = found[-1]
  module, variable = names[i - 1], names[i]
  if variable in ("lora_a", "lora_b"):
    kernel = PARAM_AXES.get((module, "kernel"))
    if kernel is None:
      return (None,) * rank
    trailing = (kernel[0], "rank") if variable == "lora_a" else ("rank", kernel[1])
  elif variable == "scale":  # norm gains, whatever the norm
    trailing = ("norm",)
  else:
    trailing = PARAM_AXES.get((module, variable))
    if trailing is None:
      return (None,) * rank
  if len(trailing) > rank:
    return (None,) * rank
  return ("layers",) * (rank - len(trailing)) + tuple(trailing)


def _mesh_axes(logical: str | None) -> tuple[str, ...]:
  axes = MESH_RULES.get(logical) if logical is not None else None
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def spec_from_logical(
    logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh
) -> PartitionSpec:
  """`PartitionSpec` for an array of `shape` whose dimensions have the `logical` names.

  A dimension is split over its mesh axes only if their total size divides it, and a mesh axis
  is used at most once per array (the first dimension that asks for it gets it); the other
  dimensions are replicated.
  """
  used: set[str] = set()
  spec = []
  for name, size in zip(logical, shape, strict=True):
    axes = tuple(a for a in _mesh_axes(name) if a in mesh.shape and mesh.shape[a] > 1
                 and a not in used)
    total = 1
    for a in axes:
      total *= mesh.shape[a]
    if not axes or size % total:
      spec.append(None)
      continue
    used.update(axes)
    spec.append(axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec)


def partition_spec(path: Sequence[Any], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """`PartitionSpec` of the array at `path` with `shape` (`logical_axes` + `MESH_RULES`)."""
  return spec_from_logical(logical_axes(path, shape), shape, mesh)


def _leaf_sharding(mesh: Mesh, path, x) -> NamedSharding:
  shape = getattr(x, "shape", ())
  return NamedSharding(mesh, partition_spec(path, shape, mesh))


def param_shardings(tree: Any, mesh: Mesh) -> Any:
  """A pytree of `NamedSharding`s like `tree` (arrays or `jax.ShapeDtypeStruct`s) placing every
  parameter (and optimizer moment) by the rules; other leaves (scalars, keys, counters) are
  replicated."""
  return jax.tree_util.tree_map_with_path(lambda p, x: _leaf_sharding(mesh, p, x), tree)


def shard_params(tree: Any, mesh: Mesh) -> Any:
  """`tree` placed on `mesh` by `param_shardings` (`jax.device_put`; no host copy of a leaf
  that already lives on the devices)."""
  return jax.device_put(tree, param_shardings(tree, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
  """The sharding of an array copied on every device of `mesh`."""
  return NamedSharding(mesh, PartitionSpec())


def batch_spec(shape: Sequence[int], mesh: Mesh, *, axis: int = 0) -> PartitionSpec:
  """Rows (dimension `axis`) split over `data` x `fsdp` when they divide, else replicated."""
  logical = [None] * len(shape)
  if len(shape) > axis:
    logical[axis] = "batch"
  return spec_from_logical(logical, shape, mesh)


def batch_shardings(tree: Any, mesh: Mesh) -> Any:
  """`NamedSharding`s splitting the leading (row) dimension of every leaf of `tree` (a `Batch`,
  a `Rollout`, prompt arrays); scalars are replicated."""
  return jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(getattr(x, "shape", ()), mesh)),
                      tree)


def shard_batch(tree: Any, mesh: Mesh) -> Any:
  """`tree` with its rows split over the batch axes (`batch_shardings`)."""
  return jax.device_put(tree, batch_shardings(tree, mesh))


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
  """Shardings of a `KVCache`: `k`, `v` `[L, B, K, T, Dh]` split on rows (batch axes) and
  heads (`tensor`); the `[B, T]` masks and `[B]` positions on rows; the index replicated."""
  def one(path, x):
    shape = getattr(x, "shape", ())
    name = _names(path)[-1] if path else ""
    if name in ("k", "v") and len(shape) == 5:
      logical = (None, "batch", "kv_heads", None, None)
    else:
      logical = ("batch",) + (None,) * (len(shape) - 1) if shape else ()
    return NamedSharding(mesh, spec_from_logical(logical, shape, mesh))

  return jax.tree_util.tree_map_with_path(one, cache)


def constrain(tree: Any, shardings: Any) -> Any:
  """`jax.lax.with_sharding_constraint` of every leaf (inside jit)."""
  return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def constrain_rows(tree: Any, mesh: Mesh | None, *, axis: int = 0) -> Any:
  """Inside jit: keeps dimension `axis` (rows) of every leaf split over the batch axes (no-op
  without a mesh). A gather of rows by a replicated index (the minibatch shuffle) or a reshape
  into microbatches would otherwise leave the partitioner free to replicate the rows, and every
  device would then run the whole minibatch."""
  if mesh is None:
    return tree
  return jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(
          x, NamedSharding(mesh, batch_spec(x.shape, mesh, axis=axis))), tree)


# -- FSDP: one layer's weights gathered inside the layer loop ---------------------------------

_GATHER_MESH: list[Mesh] = []


@contextlib.contextmanager
def gather_layers(mesh: Mesh | None):
  """While jit traces inside this block, the decoder's layer loop gathers each layer's weights
  over `fsdp` before using them (`gather_layer_weights`); `MeshJit` traces under it.

  Without the gather XLA may instead all-gather the *activations* of the whole batch to meet
  an FSDP-split contraction dimension (every device then computes every row of the MLP), which
  costs data parallelism and `L x B x S x F` activation memory. The decode step, one token per
  row, is the exception: it leaves the weights in place (`stationary_layer_weights`,
  `stationary_activations`).
  """
  if mesh is None:
    yield
    return
  _GATHER_MESH.append(mesh)
  try:
    yield
  finally:
    _GATHER_MESH.pop()


def _fsdp_gather_mesh() -> Mesh | None:
  """The innermost `gather_layers` mesh when it splits over `fsdp`, else None."""
  if not _GATHER_MESH or _GATHER_MESH[-1].shape.get("fsdp", 1) == 1:
    return None
  return _GATHER_MESH[-1]


def gather_layer_weights(layer_state: Any) -> Any:
  """Inside jit: one layer's parameters (no `[L]` axis) constrained to their rule sharding with
  the `fsdp` axis removed (ZeRO-3's per-layer all-gather; `tensor` splits stay). Identity
  outside `gather_layers` (no mesh), so single-device programs are unchanged."""
  mesh = _fsdp_gather_mesh()
  if mesh is None:
    return layer_state

  def one(path, x):
    spec = partition_spec(path, x.shape, mesh)
    kept = [None if a == "fsdp" else (tuple(b for b in a if b != "fsdp") or None)
            if isinstance(a, tuple) else a for a in spec]
    return _gather(x, NamedSharding(mesh, PartitionSpec(*kept)), NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(one, layer_state)


def stationary_layer_weights(layer_state: Any) -> Any:
  """Inside jit under `gather_layers`: one layer's parameters (no `[L]` axis) constrained to their
  rule sharding, `fsdp` split included (the decode step's: the weights stay where FSDP put
  them, `stationary_activations`); identity otherwise. Pins the decode step's own reads of the
  weights, so that the layout XLA gives the same slices elsewhere in the program (a prefill
  that gathers them) does not carry over."""
  mesh = _fsdp_gather_mesh()
  if mesh is None:
    return layer_state

  def one(path, x):
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, partition_spec(path, x.shape, mesh)))

  return jax.tree_util.tree_map_with_path(one, layer_state)


#: `checkpoint_name` of the gathered layer weights: never saved for the backward pass.
GATHERED = "fsdp_gathered_weights"


def remat_gathered(step: Callable, *, prevent_cse: bool) -> Callable:
  """The layer-loop body `step` under `jax.checkpoint` that saves every residual except the
  gathered weights (`GATHERED`), which the backward pass gathers again: otherwise the forward
  loop would stack every layer's gathered copy, the whole model on each device. Identity
  outside `gather_layers` or without an `fsdp` axis (for bodies without other remat)."""
  if _fsdp_gather_mesh() is None:
    return step
  return jax.checkpoint(step, policy=_not_gathered, prevent_cse=prevent_cse)


def _not_gathered(prim, *_, **params) -> bool:
  """Remat policy: save every residual but sharding constraints and the gathered weights."""
  if prim.name in ("sharding_constraint", "custom_vjp_call", "custom_vjp_call_jaxpr"):
    return False
  return params.get("name") != GATHERED


def _gather(x: jax.Array, gathered: NamedSharding, sharded: NamedSharding) -> jax.Array:
  """`x` constrained to `gathered`; its cotangent constrained back to `sharded`, so that each
  layer's weight gradient is reduce-scattered inside the backward layer loop instead of
  accumulating unsplit `[L, ...]` gradients."""

  @jax.custom_vjp
  def gather(x):
    return checkpoint_name(jax.lax.with_sharding_constraint(x, gathered), GATHERED)

  def fwd(x):
    return gather(x), None

  def bwd(_, g):
    return (jax.lax.with_sharding_constraint(g, sharded),)

  gather.defvjp(fwd, bwd)
  return gather(x)


def constrain_activations(h: Any) -> Any:
  """Inside jit under `gather_layers`: the residual stream `h` `[B, ...]` with its rows split
  over the batch axes; identity otherwise. Keeps XLA from trading the FSDP weight gather for
  a gather of the whole batch's activations (which the gradients' FSDP layout would favour)."""
  if not _GATHER_MESH:
    return h
  mesh = _GATHER_MESH[-1]
  return jax.lax.with_sharding_constraint(h, NamedSharding(mesh, batch_spec(h.shape, mesh)))


def stationary_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """The split of the decode step's activations `[B, ..., D]`: the width `D` over `fsdp`, as the
  layers' weights are split (when `fsdp` divides it), the rows `B` over the other batch axes
  that divide them (`data`)."""
  # Width first, so that `fsdp` goes to `D` (`spec_from_logical` gives an axis to the first
  # dimension that asks for it) and the rows keep what is left of the batch axes.
  logical = ("embed",) + (None,) * (len(shape) - 2) + ("batch",)
  return PartitionSpec(*spec_from_logical(logical, tuple(shape)[::-1], mesh)[::-1])


def stationary_activations(h: Any) -> Any:
  """Inside jit under `gather_layers`: the decode step's residual stream `h` `[B, 1, D]` split as
  `stationary_spec` says; identity otherwise (no mesh, or no `fsdp` axis). With the activations
  split like the weights, each projection multiplies the device's own `D / fsdp` slice of its
  matrix and all-reduces `[B, F]` partial sums, instead of gathering every layer's `D x F`
  matrices to every device at every step (what the forward over many tokens does,
  `gather_layer_weights`)."""
  mesh = _fsdp_gather_mesh()
  if mesh is None:
    return h
  return jax.lax.with_sharding_constraint(h, NamedSharding(mesh, stationary_spec(h.shape, mesh)))


def rows_per_device(rows: int) -> int:
  """Inside jit under `gather_layers`: how many of a batch's `rows` each device holds, split over
  the batch axes as `batch_spec` splits them (when their sizes divide `rows`); `rows` otherwise
  (no mesh, or rows that stay replicated). Sizes per-device work such as the LM head's chunks
  (`jax_ppo.models.logprobs.head_logprobs`)."""
  if not _GATHER_MESH:
    return rows
  mesh = _GATHER_MESH[-1]
  (split,) = batch_spec((rows,), mesh)  # the split the batch gets: the rule in one place
  axes = () if split is None else (split,) if isinstance(split, str) else split
  total = 1
  for a in axes:
    total *= mesh.shape[a]
  return rows // total
