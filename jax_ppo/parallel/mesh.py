"""The device mesh of a run: axes `("data", "fsdp", "tensor")` built with `jax.make_mesh`.

* `data`: plain data parallelism: the batch is split, parameters are replicated along it;
* `fsdp`: fully sharded data parallelism (ZeRO-3): the batch is split *and* every parameter and
  optimizer moment is split along its model dimension, gathered layer by layer when used;
* `tensor`: tensor (Megatron) parallelism: attention heads, MLP hidden units and the vocabulary
  are split, the batch is not.

The axes are `Auto` (`jax.sharding.AxisType.Auto`): programs are written for one device and jit
with `NamedSharding`s lets XLA's SPMD partitioner insert the collectives, so every global
statistic (masked means, whitening, group advantages, the KL controller's KL) equals its
single-device value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

#: Mesh axis names, outermost first (the data axis spans hosts first on a multi-host mesh).
AXES = ("data", "fsdp", "tensor")
#: Mesh axes the batch dimension is split over.
BATCH_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """Sizes of the mesh axes; their product must be the number of devices used.

  Attributes:
    data: data-parallel replicas (`-1`: all devices left over by the other axes).
    fsdp: parameter/optimizer-state shards (`-1`: the rest).
    tensor: tensor-parallel shards (`-1`: the rest). At most one axis may be `-1`.

  The default (`data=-1`) is plain data parallelism over every device; `MeshConfig(fsdp=-1)`
  shards the model over every device.
  """

  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def __post_init__(self):
    for name in AXES:
      size = getattr(self, name)
      if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
        raise ValueError(f"MeshConfig.{name} must be a positive int or -1 (the rest), got "
                         f"{size!r}.")
    rest = [name for name in AXES if getattr(self, name) == -1]
    if len(rest) > 1:
      raise ValueError(f"MeshConfig: at most one axis may be -1 (the rest), got {rest}; give "
                       "the others explicit sizes.")

  def shape(self, num_devices: int) -> tuple[int, int, int]:
    """`(data, fsdp, tensor)` sizes for `num_devices` devices, `-1` resolved.

    Raises:
      ValueError: the sizes do not divide or do not multiply to `num_devices`.
    """
    sizes = [getattr(self, name) for name in AXES]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        raise ValueError(
            f"MeshConfig{self._show()}: the fixed axes ({known} devices) do not divide the "
            f"{num_devices} devices available; choose sizes whose product divides {num_devices}."
        )
      sizes = [num_devices // known if s == -1 else s for s in sizes]
    elif known != num_devices:
      raise ValueError(
          f"MeshConfig{self._show()} needs {known} devices but {num_devices} are available; make "
          "data * fsdp * tensor equal the device count, or set one axis to -1 (the rest)."
      )
    return tuple(sizes)

  def _show(self) -> str:
    return "(" + ", ".join(f"{n}={getattr(self, n)}" for n in AXES) + ")"


def make_mesh(config: MeshConfig | None = None, *, devices: Sequence | None = None) -> Mesh:
  """A `jax.sharding.Mesh` with axes `AXES` and `Auto` axis types.

  Args:
    config: axis sizes (default `MeshConfig()`: data parallel over every device).
    devices: devices to use (default `jax.devices()`: every device of every process).

  Raises:
    ValueError: the sizes do not fit the device count (see `MeshConfig.shape`).
  """
  config = MeshConfig() if config is None else config
  devices = list(jax.devices() if devices is None else devices)
  shape = config.shape(len(devices))
  auto = (jax.sharding.AxisType.Auto,) * len(AXES)
  return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


def batch_axis_size(mesh: Mesh) -> int:
  """Number of shards of a batch dimension on `mesh` (`data * fsdp`)."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.shape)


def decode_mesh(mesh: Mesh, tensor: int) -> Mesh:
  """The devices of `mesh` regrouped for a tensor-parallel rollout: axes `AXES` with sizes
  `(n / tensor, 1, tensor)`, so that under the rules (`jax_ppo.parallel.rules`) every weight
  matrix is split `tensor` ways on its heads, MLP or vocabulary dimension and whole along the
  model width, and the rows over the `n / tensor` groups.

  Each group is `tensor` devices consecutive in `mesh`'s device order (`mesh.devices` flattened),
  i.e. along its innermost axes, where `make_mesh` puts the devices nearest each other. The
  device order is `mesh`'s, so a program may take arrays placed on either mesh (the sampler
  receives the training layout's parameters).

  Raises:
    ValueError: `tensor` does not divide the mesh's device count.
  """
  n = mesh.devices.size
  if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1 or n % tensor:
    raise ValueError(
        f"decode_tensor={tensor!r} does not divide the mesh's {n} devices; use a divisor of {n} "
        "(SamplingConfig.decode_tensor, PPOConfig.sampling.decode_tensor in a trainer).")
  auto = (jax.sharding.AxisType.Auto,) * len(AXES)
  return Mesh(mesh.devices.reshape(n // tensor, 1, tensor), AXES, axis_types=auto)
