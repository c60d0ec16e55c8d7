"""Per-role placement: the roles of a PPO run on their own sub-meshes, or sharing one.

A PPO run has four models: the policy (trained), its critic (trained with it), the reference
policy (frozen) and the reward model (frozen). By default every role lives on one mesh, the
policy's (`RunConfig.mesh`), and the experience and update steps are single SPMD programs over
it. `PlacementConfig` gives the reference, the reward model and/or a separate critic a
*sub-mesh* of their own: a slice `[start, stop)` of `jax.devices()` that the policy does not
use, with its own `MeshConfig` over those devices. Split roles may name the same slice (and
mesh sizes): they then share that sub-mesh.

With a split role, its computation is its own compiled program on its sub-mesh
(`jax_ppo.ppo.placed_steps`, `jax_ppo.ppo.placed_critic`): the reference log-probs `[B, T]`, the
reward-model scores `[B]`, the critic's values `[B, T]` and the critic's update. Inputs and
results cross between meshes only through `transfer`, an explicit `jax.device_put` to the
target mesh's `NamedSharding` (rows split over `data` x `fsdp`, parameters by the logical-axis
rules); no program ever reads arrays of two meshes. What crosses per update:

* policy mesh -> reference / reward / critic mesh: the rollout's token ids, masks and positions
  (`[B, S + T]` int32 each, a few KiB per row);
* reference mesh -> policy mesh: the reference log-probs `[B, T]` float32;
* reward mesh -> policy mesh: the scores `[B]` float32;
* critic mesh -> policy mesh: the values `[B, T]` float32 (for GAE) and the critic's update
  metrics (scalars);
* policy mesh -> critic mesh: the batch's token ids, masks, old values and returns, the
  minibatch order `[E, M, B / M]` int32 and which minibatches ran `[E, M]` (the policy's early
  stop), and the learning-rate scale.

The weights never move after they are placed. A split critic must be a model of its own
(`value_model`), not a value head on the policy trunk; it keeps its optimizer state on its
mesh and its gradient is clipped by its own global norm (shared: one norm over both models).
A LoRA policy's reference is its own base weights with the adapters switched off, so its
reference must stay on the policy mesh: a split reference would need a second copy of the base
weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jax_ppo.parallel import rules
from jax_ppo.parallel.mesh import MeshConfig, make_mesh

#: Roles that `PlacementConfig` can place on their own devices ("policy" is the trained one).
ROLES = ("policy", "reference", "reward", "critic")
#: Roles that may get a sub-mesh of their own.
SPLIT_ROLES = ("reference", "reward", "critic")


def _device_slice(value: Any) -> tuple[int, int] | None:
  """`(start, stop)` if `value` is a pair of ints with `0 <= start < stop`, else None."""
  if not isinstance(value, (tuple, list)) or len(value) != 2:
    return None
  start, stop = value
  if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, stop)):
    return None
  if not 0 <= start < stop:
    return None
  return (start, stop)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleMesh:
  """The devices and mesh of one role placed apart from the policy.

  Attributes:
    devices: `[start, stop)`: the role's devices are `jax.devices()[start:stop]`.
    mesh: axis sizes of the role's mesh over those `stop - start` devices (default: data
      parallel over all of them; `MeshConfig(fsdp=-1)` shards the model over them).
  """

  devices: tuple[int, int]
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

  def __post_init__(self):
    if _device_slice(self.devices) is None:
      raise ValueError(f"RoleMesh.devices={self.devices!r} is invalid: give [start, stop), two "
                       "ints with 0 <= start < stop (the role uses jax.devices()[start:stop]).")
    object.__setattr__(self, "devices", tuple(self.devices))
    if not isinstance(self.mesh, MeshConfig):
      raise ValueError(f"RoleMesh.mesh={self.mesh!r} is invalid: give a MeshConfig (axis sizes "
                       "data, fsdp, tensor).")

  @property
  def size(self) -> int:
    return self.devices[1] - self.devices[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementConfig:
  """Where each role of a PPO run lives (`RunConfig.placement`).

  Attributes:
    policy_devices: `[start, stop)` of `jax.devices()` for the policy's mesh (`RunConfig.mesh`
      over them; its optimizer state lives there too). None: every device that no split role
      uses.
    reference: the reference policy's own devices and mesh; None: shared with the policy's
      mesh (its log-probs are computed inside the experience program, as without placement).
    reward: the reward model's (or reward models') own devices and mesh; None: shared.
    critic: a separate critic's own devices and mesh (its parameters and optimizer state live
      there; its values and its update are programs of their own, `jax_ppo.ppo.placed_critic`);
      None: shared (trained with the policy in one program, as without placement). Only for a
      critic that is a model of its own, not a value head on the policy trunk.

  Split roles may name the same devices with the same mesh sizes (they then share that
  sub-mesh); otherwise no device may be used by two meshes.
  """

  policy_devices: tuple[int, int] | None = None
  reference: RoleMesh | None = None
  reward: RoleMesh | None = None
  critic: RoleMesh | None = None

  def __post_init__(self):
    if self.policy_devices is not None:
      if _device_slice(self.policy_devices) is None:
        raise ValueError(
            f"placement.policy_devices={self.policy_devices!r} is invalid: give [start, stop), "
            "two ints with 0 <= start < stop, or null (every device no split role uses).")
      object.__setattr__(self, "policy_devices", tuple(self.policy_devices))
    for role in SPLIT_ROLES:
      value = getattr(self, role)
      if value is not None and not isinstance(value, RoleMesh):
        raise ValueError(f"placement.{role}={value!r} is invalid: give {{devices: [start, "
                         "stop), mesh: {...}}}, or null to share the policy's mesh.")
    split = self.split_roles
    for i, a in enumerate(split):
      for b in split[i + 1:]:
        ra, rb = getattr(self, a), getattr(self, b)
        if ra.devices != rb.devices and _overlap(ra.devices, rb.devices):
          raise ValueError(
              f"placement.{a}.devices={list(ra.devices)} and placement.{b}.devices="
              f"{list(rb.devices)} overlap; give them disjoint slices, or the same slice (and "
              "mesh) to share one sub-mesh.")
        if ra.devices == rb.devices and ra.mesh != rb.mesh:
          raise ValueError(
              f"placement.{a} and placement.{b} share devices {list(ra.devices)} but give "
              f"different meshes ({ra.mesh} vs {rb.mesh}); give them the same mesh sizes.")
    if self.policy_devices is not None:
      for role in split:
        devices = getattr(self, role).devices
        if _overlap(self.policy_devices, devices):
          raise ValueError(
              f"placement.{role}.devices={list(devices)} overlap placement.policy_devices="
              f"{list(self.policy_devices)}; a split role needs devices the policy does not use "
              f"(or set placement.{role} to null to share the policy's mesh).")
    for role in split:
      rm = getattr(self, role)
      try:
        rm.mesh.shape(rm.size)
      except ValueError as e:
        raise ValueError(f"placement.{role}.mesh: {e} (placement.{role}.devices="
                         f"{list(rm.devices)} holds {rm.size} devices)") from None

  @property
  def split_roles(self) -> tuple[str, ...]:
    """The roles with devices of their own."""
    return tuple(r for r in SPLIT_ROLES if getattr(self, r) is not None)

  def role(self, name: str) -> RoleMesh | None:
    """The `RoleMesh` of a split role, None for a shared one."""
    if name not in ROLES:
      raise ValueError(f"Unknown role {name!r}; the roles are {ROLES}.")
    return None if name == "policy" else getattr(self, name)

  def policy_device_indices(self, num_devices: int) -> list[int]:
    """Indices into `jax.devices()` of the policy's devices, given `num_devices` in all."""
    used = set()
    for role in self.split_roles:
      start, stop = getattr(self, role).devices
      if stop > num_devices:
        raise ValueError(
            f"placement.{role}.devices={[start, stop]} needs {stop} devices but {num_devices} "
            f"are available; give a slice within [0, {num_devices}).")
      used.update(range(start, stop))
    if self.policy_devices is not None:
      start, stop = self.policy_devices
      if stop > num_devices:
        raise ValueError(
            f"placement.policy_devices={[start, stop]} needs {stop} devices but {num_devices} "
            f"are available; give a slice within [0, {num_devices}).")
      return list(range(start, stop))
    rest = [i for i in range(num_devices) if i not in used]
    if not rest:
      raise ValueError(
          f"placement: the split roles use all {num_devices} devices, none is left for the "
          "policy; give the roles fewer devices (or set placement.policy_devices).")
    return rest


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
  return a[0] < b[1] and b[0] < a[1]


@dataclasses.dataclass(frozen=True)
class Placement:
  """The meshes of a run's roles; a shared role's mesh *is* the policy's (`is`).

  Attributes:
    policy: the policy's mesh.
    reference: the reference policy's mesh.
    reward: the reward model's mesh.
    critic: the critic's mesh (None: the policy's).
  """

  policy: Mesh
  reference: Mesh
  reward: Mesh
  critic: Mesh | None = None

  def __post_init__(self):
    if self.critic is None:
      object.__setattr__(self, "critic", self.policy)

  @classmethod
  def shared(cls, mesh: Mesh) -> Placement:
    """Every role on `mesh`."""
    return cls(mesh, mesh, mesh, mesh)

  def mesh(self, role: str) -> Mesh:
    """The mesh of `role` (one of `ROLES`)."""
    if role not in ROLES:
      raise ValueError(f"Unknown role {role!r}; the roles are {ROLES}.")
    return getattr(self, role)

  def is_split(self, role: str) -> bool:
    """Whether `role` has a mesh of its own (not the policy's)."""
    return self.mesh(role) is not self.policy

  @property
  def any_split(self) -> bool:
    return any(self.is_split(r) for r in SPLIT_ROLES)


def make_placement(config: PlacementConfig | None, mesh_config: MeshConfig | None, *,
                   devices: Sequence | None = None) -> Placement:
  """The meshes of every role: the policy's (`mesh_config` over its devices) and one per split
  role (`RoleMesh.mesh` over its slice); roles naming the same slice share one `Mesh`.

  Args:
    config: the placement (None: every role on the policy's mesh).
    mesh_config: the policy's mesh sizes (None: `MeshConfig()`).
    devices: all devices (default `jax.devices()`); slices index into them.

  Raises:
    ValueError: a slice past the last device, no device left for the policy, or mesh sizes
      that do not fit their devices (naming the `placement` field).
  """
  devices = list(jax.devices() if devices is None else devices)
  config = PlacementConfig() if config is None else config
  policy_idx = config.policy_device_indices(len(devices))
  try:
    policy = make_mesh(mesh_config, devices=[devices[i] for i in policy_idx])
  except ValueError as e:
    raise ValueError(f"mesh (the policy's, over {len(policy_idx)} devices of placement): "
                     f"{e}") from None
  meshes: dict[str, Mesh] = {}
  by_slice: dict[tuple[int, int], Mesh] = {}
  for role in SPLIT_ROLES:
    rm = config.role(role)
    if rm is None:
      meshes[role] = policy
      continue
    if rm.devices not in by_slice:
      start, stop = rm.devices
      by_slice[rm.devices] = make_mesh(rm.mesh, devices=devices[start:stop])
    meshes[role] = by_slice[rm.devices]
  return Placement(policy, meshes["reference"], meshes["reward"], meshes["critic"])


def transfer(tree: Any, mesh: Mesh, *, kind: str) -> Any:
  """An explicit `jax.device_put` of `tree` onto `mesh` (the only way arrays cross meshes).

  Args:
    tree: arrays (on any devices, or host arrays).
    mesh: the target mesh.
    kind: "batch" (rows split over `data` x `fsdp`: rollouts, scores, log-probs), "params"
      (the logical-axis rules: weights) or "replicated" (a copy on every device: metrics, the
      minibatch plan, scalars).
  """
  if kind == "batch":
    return jax.device_put(tree, rules.batch_shardings(tree, mesh))
  if kind == "params":
    return jax.device_put(tree, rules.param_shardings(tree, mesh))
  if kind == "replicated":
    return jax.device_put(tree, jax.tree.map(lambda _: rules.replicated(mesh), tree))
  raise ValueError(f"transfer: unknown kind {kind!r}; use 'batch', 'params' or 'replicated'.")


__all__ = ["Placement", "PlacementConfig", "ROLES", "RoleMesh", "SPLIT_ROLES", "make_placement",
           "transfer"]
