"""A TPU slice's devices on a host without TPUs, for compiling ahead of time.

`tpu_devices("v5e:2x4")` asks libtpu for the devices of a slice
(`jax.experimental.topologies.get_topology_desc`); `slice_mesh` lays a run's mesh `(data, fsdp,
tensor)` over them (the logical mesh must map onto the physical axes: a `(2, 8)` mesh does not
fit v5e:4x4). A slice is at least one host's chips (v5e:2x2, not v5e:1x1); multi-host slices
(v5p:2x2x4: 4 hosts) are described from one host.

libtpu comes with the `jax_ppo[tpu]` extra; with it installed every JAX process tries to start a
TPU runtime, and one process at a time may load it on a host (its lock file `libtpu_lockfile` in
the temporary folder): the errors here say so in one line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import tempfile

from jax.sharding import Mesh

from jax_ppo.parallel.mesh import MeshConfig, make_mesh

TPU_EXTRA = "jax_ppo[tpu]"
"""The optional dependency that brings libtpu."""
LOCK_FILE_NAME = "libtpu_lockfile"


class PlanError(ValueError):
  """A plan that cannot be made: libtpu missing or in use, an unknown topology, a mesh that does
  not fit it, or a program that does not compile (naming the program and the topology)."""


def libtpu_installed() -> bool:
  """Whether the `libtpu` package is importable here (nothing is loaded)."""
  return importlib.util.find_spec("libtpu") is not None


def require_libtpu() -> None:
  """PlanError naming the `tpu` extra unless libtpu is installed."""
  if not libtpu_installed():
    raise PlanError(
        "planning for a TPU slice compiles with libtpu, which is not installed here: "
        f"pip install \"{TPU_EXTRA}\" (jax[tpu]), preferably in a virtual environment of its "
        "own, since with libtpu every JAX process tries to start a TPU runtime.")


def tpu_devices(topology: str) -> list:
  """The devices of the TPU slice `topology` (e.g. "v5e:2x4", "v5p:2x2x4"), from libtpu, on a
  host without TPUs. PlanError when libtpu is missing, in use by another process (naming its
  lock file) or does not know the topology."""
  require_libtpu()
  from jax.experimental import topologies

  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
  except Exception as e:  # jax.errors.JaxRuntimeError from libtpu
    text = str(e)
    if "lockfile" in text:
      found = re.search(r"(/\S*" + LOCK_FILE_NAME + ")", text)
      path = found.group(1) if found else os.path.join(tempfile.gettempdir(), LOCK_FILE_NAME)
      raise PlanError(
          f"libtpu is in use by another process on this host (it holds the lock file {path}); "
          "only one process at a time may load libtpu: wait for it to finish (run plans one "
          "after another), or set ALLOW_MULTIPLE_LIBTPU_LOAD=1 to let several processes compile "
          "at once.") from None
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    raise PlanError(f"TPU topology {topology!r} is not one libtpu can describe ({first}); give "
                    "a slice such as v5e:2x2, v5e:2x4, v5p:2x2x1, v6e:2x2 (at least one "
                    "host's chips).") from None


def slice_mesh(devices: list, config: MeshConfig | None, *, topology: str) -> Mesh:
  """The run's mesh over the slice's devices (`MeshConfig()`, data parallel, when None);
  PlanError when its sizes do not match or do not map onto the physical axes."""
  try:
    return make_mesh(config or MeshConfig(), devices=devices)
  except (ValueError, AssertionError, NotImplementedError) as e:
    raise PlanError(f"the mesh does not fit topology {topology!r} ({len(devices)} chips): "
                    f"{e}") from None


__all__ = ["LOCK_FILE_NAME", "TPU_EXTRA", "PlanError", "libtpu_installed", "require_libtpu",
           "slice_mesh", "tpu_devices"]
