"""`MeshJit`: `jax.jit` with explicit input and output shardings derived from the rules.

A jitted step of the trainer or the sampler takes pytrees whose structure is known only when it
is first called (the model's state, the optimizer state, a rollout). `MeshJit` therefore builds
the `jax.jit` on the first call for each argument structure, with

* `in_shardings`: each positional argument placed by its *role*: `"params"`
  (`rules.param_shardings`: parameters, optimizer state, anything else replicated), `"batch"`
  (`rules.batch_shardings`: rows split over `data` x `fsdp`) or `"replicated"`;
* `out_shardings`: one role per output (a tuple of roles for a tuple output);

and places the arguments with `jax.device_put` before the call (a no-op for arrays that already
have their sharding; `place`), so host arrays and arrays of another layout are accepted. Donated
arguments keep their layout across calls (the output role of a donated state is `"params"`),
which is what lets XLA reuse their buffers. Programs are traced under `rules.gather_layers`,
so the decoder gathers each layer's FSDP-split weights inside its layer loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jax_ppo.parallel import rules

ROLES = ("params", "batch", "replicated")


def shardings_for(role: str, tree: Any, mesh: Mesh) -> Any:
  """`NamedSharding`s of `tree` (arrays or `ShapeDtypeStruct`s) for a `role` in `ROLES`."""
  if role == "params":
    return rules.param_shardings(tree, mesh)
  if role == "batch":
    return rules.batch_shardings(tree, mesh)
  if role == "replicated":
    return jax.tree.map(lambda _: rules.replicated(mesh), tree)
  raise ValueError(f"Unknown sharding role {role!r}; use one of {ROLES}.")


def place(args: Any, shardings: Any) -> Any:
  """`jax.device_put(args, shardings)` (`shardings` a tree of `args`' structure), except that in a
  job of several processes a typed PRNG key (`jax.random.key`) that this process alone holds is
  placed through its raw data: JAX's `device_put` (0.10) refuses such a key for a sharding over
  other processes' devices, where it takes a host array of the same value on every process (and
  checks that it is the same)."""
  if jax.process_count() == 1:
    return jax.device_put(args, shardings)
  leaves, treedef = jax.tree.flatten(args)
  targets = treedef.flatten_up_to(shardings)

  def local_key(x, sharding) -> bool:
    return (isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            and x.is_fully_addressable and not sharding.is_fully_addressable)

  keys = [local_key(x, s) for x, s in zip(leaves, targets, strict=True)]
  if not any(keys):
    return jax.device_put(args, shardings)
  placed = [jax.random.wrap_key_data(jax.device_put(np.asarray(jax.random.key_data(x)), s),
                                     impl=jax.random.key_impl(x))
            if key else jax.device_put(x, s)
            for x, s, key in zip(leaves, targets, keys, strict=True)]
  return jax.tree.unflatten(treedef, placed)


class MeshJit:
  """`fn` compiled for `mesh` with the shardings of its arguments' and outputs' roles.

  Args:
    fn: the function to jit (positional arguments only).
    mesh: the device mesh.
    in_roles: one role per positional argument.
    out_roles: the role of the output, or a tuple of roles for a tuple output.
    donate_argnums: as in `jax.jit`.
    keep_unused: as in `jax.jit`: True keeps arguments the program never reads among its
      parameters (so `memory_analysis()` counts every array the caller holds on the devices).
  """

  def __init__(
      self,
      fn: Callable,
      mesh: Mesh,
      *,
      in_roles: Sequence[str],
      out_roles: str | Sequence[str],
      donate_argnums: tuple[int, ...] = (),
      keep_unused: bool = False,
  ):
    for role in (*in_roles, *((out_roles,) if isinstance(out_roles, str) else out_roles)):
      if role not in ROLES:
        raise ValueError(f"Unknown sharding role {role!r}; use one of {ROLES}.")
    self.fn = fn
    self.mesh = mesh
    self.in_roles = tuple(in_roles)
    self.out_roles = out_roles
    self.donate_argnums = donate_argnums
    self.keep_unused = keep_unused
    self._jitted: dict[Any, tuple[Any, Any]] = {}

  def _build(self, args):
    in_sh = tuple(shardings_for(r, a, self.mesh) for r, a in zip(self.in_roles, args, strict=True))
    with rules.gather_layers(self.mesh):
      out = jax.eval_shape(self.fn, *args)
    if isinstance(self.out_roles, str):
      out_sh = shardings_for(self.out_roles, out, self.mesh)
    else:
      out_sh = tuple(shardings_for(r, o, self.mesh)
                     for r, o in zip(self.out_roles, out, strict=True))
    jitted = jax.jit(self.fn, in_shardings=in_sh, out_shardings=out_sh,
                     donate_argnums=self.donate_argnums, keep_unused=self.keep_unused)
    return jitted, in_sh

  def _entry(self, args):
    if len(args) != len(self.in_roles):
      raise TypeError(f"{getattr(self.fn, '__name__', 'fn')} takes {len(self.in_roles)} "
                      f"arguments, got {len(args)}.")
    key = tuple(
        (jax.tree.structure(a),
         tuple((getattr(x, "shape", ()), str(getattr(x, "dtype", ""))) for x in jax.tree.leaves(a)))
        for a in args
    )
    entry = self._jitted.get(key)
    if entry is None:
      entry = self._jitted[key] = self._build(args)
    return entry

  def __call__(self, *args):
    jitted, in_sh = self._entry(args)
    with rules.gather_layers(self.mesh):  # traced on the first call of each shape
      return jitted(*place(args, in_sh))

  def lower(self, *args):
    """`jax.jit(...).lower` for these arguments (arrays or `ShapeDtypeStruct`s), e.g. to read
    `.compile().memory_analysis()` without running anything."""
    jitted, _ = self._entry(args)
    with rules.gather_layers(self.mesh):
      return jitted.lower(*args)

  def _cache_size(self) -> int:
    """Number of compiled programs (as `jax.jit`'s `_cache_size`)."""
    return sum(j._cache_size() for j, _ in self._jitted.values())


def compiled_programs(fn: Any) -> int:
  """Number of programs `fn` (a `jax.jit` function or a `MeshJit`) has compiled so far: one per
  distinct set of argument shapes, dtypes and shardings."""
  return fn._cache_size()
