"""The PPO programs with the reference and the reward model on sub-meshes of their own.

`jax_ppo.parallel.placement` describes where each role lives (`Placement`); this module runs a
run's computations there. With every role shared (the default) nothing here changes the
programs: `placed_steps` returns the `PPOSteps` itself and `score` calls the scorer as before.

With a split role (`Placement.is_split`):

* **reference**: `PlacedSteps.reference` is its own compiled program on the reference mesh,
  `(ref params, policy rest, rollout) -> ref_logprobs [B, T]` (`PPOSteps.reference_logprobs`);
  the rollout is `transfer`red there and the log-probs back to the policy mesh (rows split over
  its batch axes), and the experience programs take them as their `ref_logprobs` argument
  instead of running the reference forward pass themselves;
* **reward**: `score` transfers the rollout to the reward mesh, calls the scorer there (its
  jitted reward-model forward runs where its committed inputs are) and transfers the scores
  `[B]` back.

Every crossing is an explicit `jax.device_put` to the target `NamedSharding`
(`placement.transfer`); the programs on the policy mesh are handed `FrozenParams` without the
split roles' weights (`ref`/`reward` None), so no weight ever moves between meshes. The update
itself (policy and critic, one optimizer) runs on the policy mesh. The numbers are those of the
shared programs up to float summation order: the same reference forward pass, compiled apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from jax_ppo.parallel.jit import MeshJit
from jax_ppo.parallel.placement import Placement, transfer
from jax_ppo.parallel.rules import shard_params
from jax_ppo.rollout.sampler import Rollout
from jax_ppo.trainer.rewards import CombinedScorer
from jax_ppo.trainer.state import FrozenParams
from jax_ppo.trainer.step import PPOSteps

Array = jax.Array

_STEP_IN = ("params", "params", "batch")


def resolve_placement(mesh: Mesh | None, placement: Placement | None) -> Placement | None:
  """The trainer's `Placement`: `placement` (whose policy mesh must be `mesh` when both are
  given), else every role on `mesh` (None without a mesh)."""
  if placement is None:
    return None if mesh is None else Placement.shared(mesh)
  if not isinstance(placement, Placement):
    raise ValueError(f"placement must be a jax_ppo.parallel.placement.Placement (from "
                     f"make_placement), got {type(placement).__name__}.")
  if mesh is not None and mesh is not placement.policy:
    raise ValueError("PPOTrainer got both `mesh` and `placement` with another policy mesh; pass "
                     "only `placement` (its `policy` mesh is the trainer's mesh).")
  return placement


def place_frozen(frozen: FrozenParams, placement: Placement, scorer: Any = None) -> FrozenParams:
  """`frozen` with each role's weights placed on its mesh by the logical-axis rules: the policy's
  rest and the critic's on the policy mesh, `ref` on the reference mesh, `reward` on the reward
  mesh (with every role shared: `shard_params(frozen, mesh)`). The scorer (and each source of a
  `CombinedScorer`) is given the placed reward state, so no other copy stays referenced.

  Raises:
    ValueError: a split reference without a reference to place (a LoRA policy, whose reference
      is its own base weights), or a split reward without a reward model.
  """
  if placement.is_split("reference") and frozen.ref is None:
    raise ValueError(
        "placement.reference gives the reference its own devices, but this policy has LoRA "
        "adapters: its reference is its own base weights with the adapters off (one copy, on the "
        "policy's mesh). Set placement.reference to null.")
  if placement.is_split("reward") and frozen.reward is None:
    raise ValueError(
        "placement.reward gives the reward model its own devices, but the reward is not a reward "
        "model (a function has no weights to place). Set placement.reward to null.")
  if not placement.any_split:
    placed = shard_params(frozen, placement.policy)
    if placed.reward is not None and scorer is not None:
      scorer.state = placed.reward
    return placed
  policy_side = frozen.replace(ref=None, reward=None)
  placed = transfer(policy_side, placement.policy, kind="params").replace(
      ref=None if frozen.ref is None else transfer(frozen.ref, placement.reference,
                                                   kind="params"),
      reward=None if frozen.reward is None else transfer(frozen.reward, placement.reward,
                                                         kind="params"),
  )
  if placed.reward is not None and scorer is not None:
    scorer.state = placed.reward
    if isinstance(scorer, CombinedScorer):
      for name, sub, _ in scorer.sources:
        if name in placed.reward:
          sub.state = placed.reward[name]
  return placed


def score(placement: Placement | None, scorer: Callable, rollout: Rollout,
          reward_state: Any) -> Array:
  """`scorer(rollout, reward_state)`, on the reward mesh when the reward is split.

  Split: the rollout is `transfer`red to the reward mesh (rows split over its batch axes), the
  scorer runs there, and the scores `[B]` are `transfer`red back to the policy mesh. Otherwise
  exactly `scorer(rollout, reward_state)`.
  """
  if placement is None or not placement.is_split("reward"):
    return scorer(rollout, reward_state)
  scores = scorer(transfer(rollout, placement.reward, kind="batch"), reward_state)
  return transfer(scores, placement.policy, kind="batch")


class PlacedSteps:
  """`PPOSteps`' four programs for a run whose reference lives on its own sub-mesh.

  The same call signatures as `PPOSteps` (`experience`, `update`, `replay_update`,
  `experience_update`, `fuses_first_epoch`), so the trainer calls either. `frozen` is the
  placed `FrozenParams` (`place_frozen`): `ref` on the reference mesh, `reward` on the reward
  mesh; the programs on the policy mesh get it without those two.

  Args:
    steps: the run's `PPOSteps`, compiled for `placement.policy`.
    placement: where the roles live.

  Attributes:
    reference: the reference program on `placement.reference`,
      `(ref params, policy rest, rollout) -> ref_logprobs [B, T]`, its output rows split over
      the reference mesh's batch axes (None when the reference is shared).
  """

  def __init__(self, steps: PPOSteps, placement: Placement):
    if steps.mesh is not placement.policy:
      raise ValueError("PlacedSteps: the steps must be compiled for placement.policy "
                       "(PPOSteps(..., mesh=placement.policy)).")
    self.steps = steps
    self.placement = placement
    self.config = steps.config
    mesh = placement.policy
    self.reference = None
    self._rest = None
    self._experience = steps.experience
    self._experience_update = steps.experience_update
    if placement.is_split("reference"):
      if steps.lora:
        raise ValueError("placement.reference must be null for a LoRA policy: its reference is "
                         "its own base weights with the adapters off (one copy).")
      self.reference = MeshJit(self._reference_impl, placement.reference,
                               in_roles=("params", "params", "batch"), out_roles="batch")
      self._experience = MeshJit(steps._experience, mesh, in_roles=(*_STEP_IN, "batch", "batch"),
                                 out_roles=("batch", "replicated"))
      self._experience_update = MeshJit(
          steps._experience_update, mesh, in_roles=(*_STEP_IN, "batch", "batch"),
          out_roles=("params", "batch", "replicated", "replicated"), donate_argnums=(0,))

  @property
  def fuses_first_epoch(self) -> bool:
    return self.steps.fuses_first_epoch

  def _reference_impl(self, ref, policy_rest, rollout: Rollout) -> Array:
    frozen = FrozenParams(policy_rest=policy_rest, ref=ref, value_rest=None, reward=None)
    return self.steps.reference_logprobs(None, frozen, rollout)

  def _policy_side(self, frozen: FrozenParams) -> FrozenParams:
    """`frozen` without the weights of split roles (they never enter a policy-mesh program)."""
    p = self.placement
    return frozen.replace(ref=None if p.is_split("reference") else frozen.ref,
                          reward=None if p.is_split("reward") else frozen.reward)

  def reference_logprobs(self, frozen: FrozenParams, rollout: Rollout) -> Array:
    """Reference log-probs `[B, T]` computed on the reference mesh and `transfer`red to the
    policy mesh (rows split over its batch axes)."""
    if self._rest is None or self._rest[0] is not frozen.policy_rest:
      # The policy's non-trained variables (empty for a full fine-tune), placed once.
      self._rest = (frozen.policy_rest,
                    transfer(frozen.policy_rest, self.placement.reference, kind="params"))
    ref = self.reference(frozen.ref, self._rest[1],
                         transfer(rollout, self.placement.reference, kind="batch"))
    return transfer(ref, self.placement.policy, kind="batch")

  def _extra(self, frozen: FrozenParams, rollout: Rollout) -> tuple:
    return () if self.reference is None else (self.reference_logprobs(frozen, rollout),)

  def experience(self, state, frozen: FrozenParams, rollout: Rollout, raw_scores):
    """`PPOSteps.experience`; the reference log-probs from `reference` when split."""
    return self._experience(state, self._policy_side(frozen), rollout, raw_scores,
                            *self._extra(frozen, rollout))

  def experience_update(self, state, frozen: FrozenParams, rollout: Rollout, raw_scores):
    """`PPOSteps.experience_update`; the reference log-probs from `reference` when split."""
    return self._experience_update(state, self._policy_side(frozen), rollout, raw_scores,
                                   *self._extra(frozen, rollout))

  def update(self, state, frozen: FrozenParams, batch, seq_kl_mean):
    """`PPOSteps.update` (the batch holds the reference log-probs already)."""
    return self.steps.update(state, self._policy_side(frozen), batch, seq_kl_mean)

  def replay_update(self, state, frozen: FrozenParams, batch, seq_kl_mean):
    """`PPOSteps.replay_update`."""
    return self.steps.replay_update(state, self._policy_side(frozen), batch, seq_kl_mean)


def placed_steps(steps: PPOSteps, placement: Placement | None) -> PPOSteps | PlacedSteps:
  """`steps` itself when every role is shared (the default programs, unchanged), else the
  `PlacedSteps` that runs the split roles on their meshes."""
  if placement is None or not placement.any_split:
    return steps
  return PlacedSteps(steps, placement)


__all__ = ["PlacedSteps", "place_frozen", "placed_steps", "resolve_placement", "score"]
