"""The PPO programs with the reference, the reward model and the critic on sub-meshes of their own.

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
  `[B]` back;
* **critic** (a separate critic model only): its values and its update are programs on the
  critic mesh (`jax_ppo.ppo.placed_critic`): the values `[B, T]` come to the experience programs
  as their `values` argument, the policy programs train the policy alone and hand their
  minibatch plan to the critic's update;
* **evaluation**: `eval_logprobs_program` computes the reference's log-probs of an evaluation
  rollout on the reference mesh, the policy's on the policy mesh.

Every crossing is an explicit `jax.device_put` to the target `NamedSharding`
(`placement.transfer`); the programs on the policy mesh are handed `FrozenParams` and a
`TrainState` without the split roles' weights (`ref`/`reward`/`value_rest`, the critic's
parameters and optimizer state), so no weight ever moves between meshes. The numbers are those
of the shared programs up to float summation order (the same forward passes, compiled apart),
except that a split critic's gradient is clipped by its own global norm
(`jax_ppo.ppo.placed_critic`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jax_ppo.parallel.jit import MeshJit
from jax_ppo.parallel.placement import Placement, transfer
from jax_ppo.parallel.rules import shard_params
from jax_ppo.ppo import placed_critic as critic_lib
from jax_ppo.ppo.batch import batch_view
from jax_ppo.ppo.forward import masked_logprobs
from jax_ppo.ppo.state import FrozenParams, TrainState
from jax_ppo.ppo.steps import PPOSteps
from jax_ppo.rewards.scorers import CombinedScorer
from jax_ppo.rollout.sampler import Rollout

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


def critic_split(placement: Placement | None) -> bool:
  """Whether the critic has a mesh of its own (`PPOSteps(critic_apart=...)`)."""
  return placement is not None and placement.is_split("critic")


def place_frozen(frozen: FrozenParams, placement: Placement, scorer: Any = None) -> FrozenParams:
  """`frozen` with each role's weights placed on its mesh by the logical-axis rules: the policy's
  rest on the policy mesh, `ref` on the reference mesh, `reward` on the reward mesh,
  `value_rest` on the critic mesh (with every role shared: `shard_params(frozen, mesh)`). The
  scorer (and each source of a `CombinedScorer`) is given the placed reward state, so no other
  copy stays referenced.

  Raises:
    ValueError: a split reference without a reference to place (a LoRA policy, whose reference
      is its own base weights), a split reward without a reward model, or a split critic
      without a separate critic model (a value head on the policy trunk, or no critic).
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
  if placement.is_split("critic") and frozen.value_rest is None:
    raise ValueError(
        "placement.critic gives the critic its own devices, but this run has no separate critic "
        "model: a value head on the policy trunk trains inside the policy (one model), and "
        "advantage modes other than 'gae' have no critic. Pass a value_model (RunConfig."
        "value_model_path, or a reward model to start it from), or set placement.critic to "
        "null.")
  if not placement.any_split:
    placed = shard_params(frozen, placement.policy)
    if placed.reward is not None and scorer is not None:
      scorer.state = placed.reward
    return placed
  policy_side = frozen.replace(ref=None, reward=None, value_rest=None)
  placed = transfer(policy_side, placement.policy, kind="params").replace(
      ref=None if frozen.ref is None else transfer(frozen.ref, placement.reference,
                                                   kind="params"),
      reward=None if frozen.reward is None else transfer(frozen.reward, placement.reward,
                                                         kind="params"),
      value_rest=None if frozen.value_rest is None else transfer(
          frozen.value_rest, placement.critic, kind="params"),
  )
  if placed.reward is not None and scorer is not None:
    scorer.state = placed.reward
    if isinstance(scorer, CombinedScorer):
      for name, sub, _ in scorer.sources:
        if name in placed.reward:
          sub.state = placed.reward[name]
  return placed


def place_state(state: TrainState, placement: Placement) -> TrainState:
  """`state` placed by the logical-axis rules: on the policy mesh (`shard_params`), except, with
  a split critic, its parameters and its half of the optimizer moments on the critic mesh
  (`critic.split_state`; the step counters stay on the policy mesh)."""
  if not placement.is_split("critic"):
    return shard_params(state, placement.policy)
  policy, value_opt, layout = critic_lib.split_state(state)
  policy = transfer(policy, placement.policy, kind="params")
  value, value_opt = transfer((state.value, value_opt), placement.critic, kind="params")
  return critic_lib.join(policy, value, value_opt, layout)


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
  """`PPOSteps`' four programs for a run whose reference and/or critic live on sub-meshes.

  The same call signatures as `PPOSteps` (`experience`, `update`, `replay_update`,
  `experience_update`, `fuses_first_epoch`), so the trainer calls either. `frozen` is the
  placed `FrozenParams` (`place_frozen`): `ref` on the reference mesh, `reward` on the reward
  mesh, `value_rest` on the critic mesh; the programs on the policy mesh get it without the
  split roles' parts, and with a split critic the `TrainState` without the critic's parameters
  and optimizer moments (`critic.split_state`).

  Args:
    steps: the run's `PPOSteps`, compiled for `placement.policy` (with `critic_apart=True`
      when the critic is split).
    placement: where the roles live.

  Attributes:
    reference: the reference program on `placement.reference`,
      `(ref params, policy rest, rollout) -> ref_logprobs [B, T]`, its output rows split over
      the reference mesh's batch axes (None when the reference is shared).
    critic: the critic's programs on `placement.critic` (`critic.CriticPrograms`; None when the
      critic is shared).
  """

  def __init__(self, steps: PPOSteps, placement: Placement):
    if steps.mesh is not placement.policy:
      raise ValueError("PlacedSteps: the steps must be compiled for placement.policy "
                       "(PPOSteps(..., mesh=placement.policy)).")
    if steps.critic_apart != placement.is_split("critic"):
      raise ValueError("PlacedSteps: build the steps with PPOSteps(..., critic_apart=True) "
                       "exactly when placement.critic gives the critic its own mesh.")
    self.steps = steps
    self.placement = placement
    self.config = steps.config
    mesh = placement.policy
    self.reference = self.critic = None
    self._rest = None
    self._experience = steps.experience
    self._experience_update = steps.experience_update
    self._update, self._replay_update = steps.update, steps.replay_update
    if placement.is_split("reference"):
      if steps.lora:
        raise ValueError("placement.reference must be null for a LoRA policy: its reference is "
                         "its own base weights with the adapters off (one copy).")
      self.reference = MeshJit(self._reference_impl, placement.reference,
                               in_roles=("params", "params", "batch"), out_roles="batch")
    if placement.is_split("critic"):
      self.critic = critic_lib.CriticPrograms(steps, placement.critic)
      self._update, self._replay_update = critic_lib.update_programs(steps, mesh)
    if self.reference is not None or self.critic is not None:
      plan = ("replicated",) if self.critic is not None else ()
      self._experience = MeshJit(self._experience_impl, mesh, in_roles=(*_STEP_IN, "batch",
                                                                         "batch"),
                                 out_roles=("batch", "replicated"))
      self._experience_update = MeshJit(
          self._experience_update_impl, mesh, in_roles=(*_STEP_IN, "batch", "batch"),
          out_roles=("params", "batch", "replicated", "replicated", *plan), donate_argnums=(0,))

  @property
  def fuses_first_epoch(self) -> bool:
    return self.steps.fuses_first_epoch

  def _reference_impl(self, ref, policy_rest, rollout: Rollout) -> Array:
    frozen = FrozenParams(policy_rest=policy_rest, ref=ref, value_rest=None, reward=None)
    return self.steps.reference_logprobs(None, frozen, rollout)

  def _experience_impl(self, state, frozen, rollout, raw_scores, extra: dict[str, Array]):
    return self.steps.compute_experience(state, frozen, rollout, raw_scores, **extra)

  def _experience_update_impl(self, state, frozen, rollout, raw_scores, extra: dict[str, Array]):
    return self.steps.experience_and_update(state, frozen, rollout, raw_scores, **extra,
                                            plan=self.critic is not None)

  def _policy_side(self, frozen: FrozenParams) -> FrozenParams:
    """`frozen` without the weights of split roles (they never enter a policy-mesh program)."""
    return policy_side(frozen, self.placement)

  def _policy_state(self, state: TrainState) -> TrainState:
    return state if self.critic is None else critic_lib.split_state(state)[0]

  def rest_on_reference(self, frozen: FrozenParams):
    """The policy's non-trained variables (empty for a full fine-tune) on the reference mesh,
    placed once."""
    if self._rest is None or self._rest[0] is not frozen.policy_rest:
      self._rest = (frozen.policy_rest,
                    transfer(frozen.policy_rest, self.placement.reference, kind="params"))
    return self._rest[1]

  def reference_logprobs(self, frozen: FrozenParams, rollout: Rollout) -> Array:
    """Reference log-probs `[B, T]` computed on the reference mesh and `transfer`red to the
    policy mesh (rows split over its batch axes)."""
    ref = self.reference(frozen.ref, self.rest_on_reference(frozen),
                         transfer(rollout, self.placement.reference, kind="batch"))
    return transfer(ref, self.placement.policy, kind="batch")

  def critic_values(self, state: TrainState, frozen: FrozenParams, rollout: Rollout) -> Array:
    """The critic's values `[B, T]` (0 on padding) computed on the critic mesh and
    `transfer`red to the policy mesh (rows split over its batch axes)."""
    values = self.critic.values(state.value, frozen.value_rest,
                                transfer(rollout, self.placement.critic, kind="batch"))
    return transfer(values, self.placement.policy, kind="batch")

  def _extra(self, state: TrainState, frozen: FrozenParams, rollout: Rollout) -> tuple:
    """The experience programs' extra argument: `{"ref_logprobs", "values"}` computed on the
    split roles' meshes (none without a split reference or critic: the `PPOSteps` programs)."""
    if self.reference is None and self.critic is None:
      return ()
    extra = {}
    if self.reference is not None:
      extra["ref_logprobs"] = self.reference_logprobs(frozen, rollout)
    if self.critic is not None:
      extra["values"] = self.critic_values(state, frozen, rollout)
    return (extra,)

  def _split(self, state: TrainState) -> tuple[TrainState, tuple]:
    """The policy programs' state and the critic's part: its parameters, its optimizer state
    and the learning-rate scale, on the critic mesh (the step counters and the scale copied
    there before the policy program donates them), and the optimizer state's layout."""
    policy_state, value_opt, layout = critic_lib.split_state(state)
    value_opt, lr_scale = transfer((value_opt, state.lr_scale), self.placement.critic,
                                   kind="params")
    return policy_state, (state.value, value_opt, lr_scale, layout)

  def _critic_update(self, policy_state: TrainState, parts: tuple, frozen: FrozenParams, batch,
                     plan, policy_metrics: dict[str, Array]) -> tuple[TrainState, dict]:
    """The critic's update on the policy's minibatches (`plan`), joined with the updated
    `policy_state`; returns the state and the merged metrics (on the policy mesh)."""
    mesh = self.placement.critic
    value, value_opt, lr_scale, layout = parts
    value, value_opt, metrics = self.critic.update(
        value, value_opt, frozen.value_rest,
        transfer(critic_lib.CriticBatch.of(batch), mesh, kind="batch"),
        transfer(plan, mesh, kind="replicated"), lr_scale)
    metrics = transfer(metrics, self.placement.policy, kind="replicated")
    return (critic_lib.join(policy_state, value, value_opt, layout),
            critic_lib.merge_metrics(self.config, policy_metrics, metrics))

  def experience(self, state, frozen: FrozenParams, rollout: Rollout, raw_scores):
    """`PPOSteps.experience`; the reference log-probs and the critic's values from their own
    programs when split."""
    return self._experience(self._policy_state(state), self._policy_side(frozen), rollout,
                            raw_scores, *self._extra(state, frozen, rollout))

  def experience_update(self, state, frozen: FrozenParams, rollout: Rollout, raw_scores):
    """`PPOSteps.experience_update`; with a split critic, then the critic's update."""
    extra = self._extra(state, frozen, rollout)
    if self.critic is None:
      return self._experience_update(state, self._policy_side(frozen), rollout, raw_scores,
                                     *extra)
    policy_state, parts = self._split(state)
    policy_state, batch, exp, upd, plan = self._experience_update(
        policy_state, self._policy_side(frozen), rollout, raw_scores, *extra)
    state, upd = self._critic_update(policy_state, parts, frozen, batch, plan, upd)
    return state, batch, exp, upd

  def _updates(self, program, state, frozen: FrozenParams, batch, seq_kl_mean):
    if self.critic is None:
      return program(state, self._policy_side(frozen), batch, seq_kl_mean)
    policy_state, parts = self._split(state)
    policy_state, upd, plan = program(policy_state, self._policy_side(frozen), batch,
                                      seq_kl_mean)
    return self._critic_update(policy_state, parts, frozen, batch, plan, upd)

  def update(self, state, frozen: FrozenParams, batch, seq_kl_mean):
    """`PPOSteps.update` (the batch holds the reference log-probs and values already); with a
    split critic, then the critic's update on the same minibatches."""
    return self._updates(self._update, state, frozen, batch, seq_kl_mean)

  def replay_update(self, state, frozen: FrozenParams, batch, seq_kl_mean):
    """`PPOSteps.replay_update`; with a split critic, then the critic's update."""
    return self._updates(self._replay_update, state, frozen, batch, seq_kl_mean)


def policy_side(frozen: FrozenParams, placement: Placement) -> FrozenParams:
  """`frozen` without the weights of `placement`'s split roles (for policy-mesh programs)."""
  p = placement
  return frozen.replace(ref=None if p.is_split("reference") else frozen.ref,
                        reward=None if p.is_split("reward") else frozen.reward,
                        value_rest=None if p.is_split("critic") else frozen.value_rest)


class PlacedEvalLogprobs:
  """`PPOTrainer`'s evaluation log-probs with split roles: `(trainable, frozen, rollout) ->
  (logprobs [B, T], ref_logprobs [B, T])` (`jax_ppo.ppo.forward.masked_logprobs` at
  `temperature`, the one log-prob path of training and evaluation).

  The policy's on the policy mesh with the policy-side `frozen` (`policy_side`: no weight of a
  split role is copied there); with a split reference, the reference's on the reference mesh
  (the rollout `transfer`red there, the result left there: the caller reads it to the host).
  With a shared reference, `impl` (the trainer's own program) computes both on the policy mesh.
  """

  def __init__(self, impl: Callable, steps: PlacedSteps, *, temperature: float):
    self.steps = steps
    self.placement = p = steps.placement
    self.graphdef = steps.steps.policy_graphdef
    self.temperature = temperature
    roles = dict(in_roles=("params", "params", "batch"))
    self.shared = MeshJit(impl, p.policy, **roles, out_roles=("batch", "batch"))
    self.policy = self.reference = None
    if p.is_split("reference"):
      # One function object per program: jit's trace cache is keyed on the function, and a
      # trace made under one mesh (its activation constraints) must not serve the other.
      self.policy = MeshJit(functools.partial(self._logprobs), p.policy, **roles,
                            out_roles="batch")
      self.reference = MeshJit(functools.partial(self._logprobs), p.reference, **roles,
                               out_roles="batch")

  def _logprobs(self, params, rest, rollout: Rollout) -> Array:
    model = nnx.merge(self.graphdef, params, rest)
    return masked_logprobs(model, batch_view(rollout), temperature=self.temperature)

  def __call__(self, trainable, frozen: FrozenParams, rollout: Rollout) -> tuple[Array, Array]:
    side = policy_side(frozen, self.placement)
    if self.reference is None:
      return self.shared(trainable, side, rollout)
    logprobs = self.policy(trainable, side.policy_rest, rollout)
    ref = self.reference(frozen.ref, self.steps.rest_on_reference(frozen),
                         transfer(rollout, self.placement.reference, kind="batch"))
    return logprobs, ref


def eval_logprobs_program(impl: Callable, steps: PPOSteps | PlacedSteps,
                          placement: Placement | None, *, temperature: float) -> Callable:
  """The trainer's evaluation log-probs program: `jax.jit(impl)` without a mesh, a `MeshJit` of
  `impl` on the shared mesh, else a `PlacedEvalLogprobs` (split roles on their meshes)."""
  if placement is None:
    return jax.jit(impl)
  if not isinstance(steps, PlacedSteps):
    return MeshJit(impl, placement.policy, in_roles=("params", "params", "batch"),
                   out_roles=("batch", "batch"))
  return PlacedEvalLogprobs(impl, steps, temperature=temperature)


def placed_steps(steps: PPOSteps, placement: Placement | None) -> PPOSteps | PlacedSteps:
  """`steps` itself when every role is shared (the default programs, unchanged), else the
  `PlacedSteps` that runs the split roles on their meshes."""
  if placement is None or not placement.any_split:
    return steps
  return PlacedSteps(steps, placement)


__all__ = ["PlacedEvalLogprobs", "PlacedSteps", "critic_split", "eval_logprobs_program",
           "place_frozen", "place_state", "placed_steps", "policy_side", "resolve_placement",
           "score"]
