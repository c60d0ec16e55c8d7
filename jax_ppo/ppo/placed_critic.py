"""The critic on a sub-mesh of its own: its values and its update as programs of their own.

With `PlacementConfig.critic` (`jax_ppo.parallel.placement`) a separate critic (`value_model`,
a `ScalarModel`) lives on its own devices: its parameters, its non-trained variables and its
optimizer state stay there, and the PPO update becomes two programs, one per mesh:

1. **values** (critic mesh): `(value, value_rest, rollout) -> values [B, T]`, the critic's
   predictions at the positions that predict each response token (the rollout is `transfer`red
   there, the values back to the policy mesh, where the experience program computes GAE);
2. **policy update** (policy mesh): `PPOSteps` with `critic_apart=True`: the policy loss only,
   the policy's own optimizer state; it also returns its *plan*, the rows of every minibatch
   `order [E, M, B / M]` int32, which minibatches ran `ran [E, M]` bool (False after the
   early stop decided by the policy's approximate KL, docs/rlhf_details.md item 19) and
   `stepped [E, M]` bool (the policy's optimizer step was applied, not skipped as non-finite);
3. **critic update** (critic mesh): the same minibatches in the same order (the plan and the
   batch's ids, masks, old values and returns are `transfer`red there), each microbatch's loss
   `vf_coef * ppo_value_loss` with the same share of the minibatch as in the shared loss
   (docs/rlhf_details.md items 12 and 18), one optimizer step per minibatch that ran.

The gradient of the shared loss `policy loss + vf_coef * value loss` with respect to a separate
critic's parameters is the gradient of `vf_coef * value loss` alone, and AdamW works per
parameter, so the split update equals the shared one **except for gradient clipping**: shared,
one global norm over both models' gradients is clipped to `max_grad_norm`; split, each model's
gradient is clipped by its own global norm (`policy/grad_norm`, `critic/grad_norm`). A
non-finite policy step skips the critic's step on that minibatch too (as shared), but a
non-finite critic loss or gradient skips only the critic's step (shared: both). With norms
under the clip (or `max_grad_norm=None`) and finite steps, both give the same parameters up to
float summation order.

`TrainState` is the same tree as with a shared critic (one optimizer state over
`{"policy", "value"}`), so checkpoints save, restore and resume unchanged, across placements
too: only where its arrays live differs. `state.value` and the critic's half of every
optimizer moment (`opt_state`'s `{"policy": ..., "value": ...}` dicts) live on the critic mesh,
the rest on the policy mesh. Each program gets its part (`split_state`): the policy programs
the state with `value=None` and the moments' `"value"` halves None (the optimizer state of
`{"policy": policy, "value": None}`), the critic's program the optimizer state of its own
parameters; the optimizer's step counters (Adam's bias correction, the schedule) are the
policy's, copied to the critic each update and kept from the policy after it (they agree
unless the critic alone skipped a non-finite step).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh

from jax_ppo.parallel.jit import MeshJit
from jax_ppo.parallel.rules import constrain_rows
from jax_ppo.ppo.batch import Batch, batch_view
from jax_ppo.ppo.loss import loss_shares, value_loss
from jax_ppo.ppo.state import TrainState
from jax_ppo.ppo.steps import PPOSteps
from jax_ppo.rollout.sampler import Rollout
from jax_ppo.training.state import accumulate_gradients, microbatches

Array = jax.Array

#: Metrics of the critic's update, each the mean over the minibatches that ran (the sum for
#: `skipped_updates`).
CRITIC_METRICS = ("loss/value_avg", "val/clipfrac_avg", "critic/grad_norm")


class CriticBatch(struct.PyTreeNode):
  """What the critic's update reads of a `Batch` (`B` rows; what crosses to the critic mesh).

  Attributes:
    input_ids: `[B, S + T]` prompt then response ids.
    attention_mask: `[B, S + T]` int32.
    positions: `[B, S + T]` int32 position ids.
    response_ids: `[B, T]` (only its shape is read).
    response_mask: `[B, T]` bool.
    old_values: `[B, T]` the critic's values at rollout time.
    returns: `[B, T]` value targets (from GAE).
  """

  input_ids: Array
  attention_mask: Array
  positions: Array
  response_ids: Array
  response_mask: Array
  old_values: Array
  returns: Array

  @classmethod
  def of(cls, batch: Batch) -> CriticBatch:
    return cls(**{f: getattr(batch, f) for f in cls.__dataclass_fields__})


def _is_pair(node) -> bool:
  """A `{"policy": ..., "value": ...}` dict: where the optimizer state mirrors the parameters."""
  return isinstance(node, dict) and set(node) == {"policy", "value"}


def split_state(state: TrainState) -> tuple[TrainState, Any, Any]:
  """`state` as the policy programs' part and the critic's optimizer state.

  Returns:
    `(policy_state, value_opt_state, layout)`: `state` with `value=None` and every
    `{"policy", "value"}` dict of `opt_state` with its `"value"` None (the optimizer state of
    `{"policy": policy, "value": None}`); the critic's optimizer state (the `"value"` halves,
    and the step counters, which both parts share); `layout`, for `join`.
  """
  nodes, layout = jax.tree.flatten(state.opt_state, is_leaf=_is_pair)
  policy_opt = layout.unflatten(
      [{"policy": n["policy"], "value": None} if _is_pair(n) else n for n in nodes])
  value_opt = layout.unflatten([n["value"] if _is_pair(n) else n for n in nodes])
  return state.replace(value=None, opt_state=policy_opt), value_opt, layout


def join(policy_state: TrainState, value, value_opt_state, layout) -> TrainState:
  """The `TrainState` of `split_state`'s parts (the step counters from the policy's part)."""
  policy_nodes = layout.flatten_up_to(policy_state.opt_state)
  value_nodes = layout.flatten_up_to(value_opt_state)
  opt_state = layout.unflatten(
      [{"policy": p["policy"], "value": v} if _is_pair(p) else p
       for p, v in zip(policy_nodes, value_nodes, strict=True)])
  return policy_state.replace(value=value, opt_state=opt_state)


class CriticPrograms:
  """The critic's two programs on its mesh (see the module docstring).

  Args:
    steps: the run's `PPOSteps` (built with `critic_apart=True`: its `value_graphdef`,
      optimizer and config are read here).
    mesh: the critic's mesh.

  Attributes:
    values: `(value, value_rest, rollout) -> values [B, T]` float32 (rows split over the
      mesh's batch axes).
    update: `(value, value_opt_state, value_rest, critic_batch, plan, lr_scale) -> (value,
      value_opt_state, metrics)`; `plan` is `{"order": [E, M, B / M] int32, "ran": [E, M]
      bool, "stepped": [E, M] bool}`; the first two arguments are donated.
  """

  def __init__(self, steps: PPOSteps, mesh: Mesh):
    if not steps.critic_apart:
      raise ValueError("CriticPrograms needs PPOSteps(..., critic_apart=True): the policy "
                       "programs must not train the critic too.")
    if steps.value_graphdef is None or steps.shared_value_head:
      raise ValueError("A critic on a mesh of its own needs a separate critic model "
                       "(value_graphdef), not a value head on the policy trunk.")
    self.steps = steps
    self.config = steps.config
    self.mesh = mesh
    self.values = MeshJit(self._values, mesh, in_roles=("params", "params", "batch"),
                          out_roles="batch")
    self.update = MeshJit(
        self._update, mesh,
        in_roles=("params", "params", "params", "batch", "replicated", "replicated"),
        out_roles=("params", "params", "replicated"), donate_argnums=(0, 1))

  def _values(self, value, value_rest, rollout: Rollout) -> Array:
    view = batch_view(rollout)
    return jnp.where(view.response_mask,
                     self.steps.forward.critic_values(value, value_rest, view), 0.0)

  def _micro_loss(self, value, value_rest, mb: CriticBatch, weight):
    """`vf_coef * value loss` of one microbatch, pre-scaled by its share `weight` of the
    minibatch (as the value term of `PPOSteps`' loss); returns `(loss, metrics)`."""
    c = self.config
    vf_loss, vf = value_loss(c, self.steps.forward.critic_values(value, value_rest, mb), mb)
    metrics = {"loss/value_avg": vf_loss * weight, "val/clipfrac_avg": vf["clipfrac"] * weight}
    return c.vf_coef * vf_loss * weight, metrics

  def _minibatch_step(self, value, opt_state, value_rest, mb: CriticBatch, lr_scale, stepped):
    """One optimizer step on the gradients accumulated over the minibatch's microbatches,
    skipped (parameters and optimizer state unchanged) when the policy's was (`stepped`
    False) or the critic's loss or gradient is non-finite (counted in `skipped`)."""
    c = self.config
    micro = constrain_rows(microbatches(mb, c.gradient_accumulation_steps), self.mesh, axis=1)
    weights = loss_shares(c, micro.response_mask)
    value_and_grad = jax.value_and_grad(self._micro_loss, has_aux=True)

    def grad_fn(value, xs):
      micro_batch, weight = xs
      (micro_loss, m), g = value_and_grad(value, value_rest, micro_batch, weight)
      return (micro_loss, m), g

    (loss, metrics), grads = accumulate_gradients(grad_fn, value, (micro, weights))
    # The global norm is NaN or inf exactly when some entry is (or it overflows float32): one
    # reduction, also the `critic/grad_norm` metric.
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def step(operands):
      value, opt_state, grads = operands
      updates, opt_state = self.steps.optimizer.update(grads, opt_state, value)
      # (A bare critic tree: its own learning rate is a factor on every update.)
      ratio = c.optimizer.critic_lr_ratio
      scale = lr_scale if ratio is None else lr_scale * ratio
      updates = jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)
      return optax.apply_updates(value, updates), opt_state

    value, opt_state = jax.lax.cond(finite & stepped, step, lambda ops: ops[:2],
                                    (value, opt_state, grads))
    metrics = {**metrics, "critic/grad_norm": grad_norm,
               "skipped": (~finite & stepped).astype(jnp.float32)}
    return value, opt_state, metrics

  def _update(self, value, opt_state, value_rest, batch: CriticBatch, plan, lr_scale):
    """The policy's minibatches (`plan`), in its order, each one optimizer step of the critic;
    the minibatches after the policy's early stop are skipped."""
    order, ran, stepped = (plan[k].reshape(-1, *plan[k].shape[2:])
                           for k in ("order", "ran", "stepped"))
    zeros = {k: jnp.zeros((), jnp.float32) for k in (*CRITIC_METRICS, "skipped")}

    def run_minibatch(carry, xs):
      value, opt_state = carry
      idx, runs, policy_stepped = xs
      mb = constrain_rows(jax.tree.map(lambda x: x[idx], batch), self.mesh)
      value, opt_state, metrics = jax.lax.cond(
          runs,
          lambda v, o: self._minibatch_step(v, o, value_rest, mb, lr_scale, policy_stepped),
          lambda v, o: (v, o, zeros),
          value, opt_state,
      )
      return (value, opt_state), metrics

    (value, opt_state), metrics = jax.lax.scan(run_minibatch, (value, opt_state),
                                               (order, ran, stepped))
    n_ran = jnp.maximum(jnp.sum(ran), 1).astype(jnp.float32)
    out = {k: jnp.sum(metrics[k]) / n_ran for k in CRITIC_METRICS}
    out["skipped_updates"] = jnp.sum(metrics["skipped"])
    return value, opt_state, out


def merge_metrics(config, policy_metrics: dict[str, Array],
                  critic_metrics: dict[str, Array]) -> dict[str, Array]:
  """The policy update's metrics with the critic's (both on the policy mesh): `loss/total_avg`
  gains `vf_coef * loss/value_avg` (the shared loss's value term, averaged over the same
  minibatches) and `skipped_updates` counts both models' skipped steps."""
  out = dict(policy_metrics)
  for k in CRITIC_METRICS:
    out[k] = critic_metrics[k]
  out["loss/total_avg"] = out["loss/total_avg"] + config.vf_coef * critic_metrics["loss/value_avg"]
  out["skipped_updates"] = out["skipped_updates"] + critic_metrics["skipped_updates"]
  return out


def update_programs(steps: PPOSteps, mesh: Mesh) -> tuple[MeshJit, MeshJit]:
  """The policy's `update` and `replay_update` on `mesh`, returning their plan too:
  `(state, frozen, batch, seq_kl_mean) -> (state, metrics, plan)` (the state donated)."""
  return tuple(
      MeshJit(functools.partial(steps.run_update, fresh=fresh, plan=True), mesh,
              in_roles=("params", "params", "batch", "replicated"),
              out_roles=("params", "replicated", "replicated"), donate_argnums=(0,))
      for fresh in (True, False))


__all__ = ["CRITIC_METRICS", "CriticBatch", "CriticPrograms", "join", "merge_metrics",
           "split_state", "update_programs"]
