"""PPO's update: epochs x minibatches x microbatches (PureJaxRL's `_update_epoch` /
`_update_minibatch`), the KL early stop and the fused first epoch.

One update of a batch of `B` rows:

    for epoch e < ppo_epochs (skipped once an epoch's mean approx KL > target_kl, item 19):
      order_e = permutation(key_e, B) split into num_minibatches minibatches   (item 18)
      for each minibatch: gradients summed over gradient_accumulation_steps microbatches
        (`jax_ppo.training.state.microbatches` + `accumulate_gradients`), each microbatch's loss
        scaled by its share of the minibatch (`loss.loss_shares`), then one guarded AdamW step
        (`jax_ppo.training.state.guarded_update`: skipped when the loss or gradient is not
        finite, counted in `skipped_updates`)

then, for a fresh batch (not a replayed one), the KL controller's update with the batch's mean
sequence KL and the step and episode counters. Everything is `lax.scan` / `lax.cond` inside one
program; the metrics are the means over the minibatches that ran.

`Updater.fused_update` is the same update when the first epoch is one optimizer step on the
whole batch (`num_minibatches == 1`, no accumulation): its gradient is pulled back from the
behaviour pass of the experience program (`jax.vjp`), so that pass is not run a second time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jax_ppo import core
from jax_ppo.parallel.rules import constrain_rows
from jax_ppo.ppo.batch import Batch
from jax_ppo.ppo.loss import coefficients, loss_shares, micro_loss
from jax_ppo.ppo.state import TrainState
from jax_ppo.training.optim import scale_updates
from jax_ppo.training.state import (
  CRITIC_LR_METRIC,
  LR_METRIC,
  accumulate_gradients,
  guarded_update,
  microbatches,
)

Array = jax.Array

MicroLoss = Callable[..., tuple[Array, dict[str, Array]]]
"""`loss(params, frozen, mb, weight, coefs) -> (loss, metrics)` of one microbatch, pre-scaled by
its share `weight` of the minibatch."""


def update_plan(order: Array, ran: Array, metrics: dict[str, Array]) -> dict[str, Array]:
  """The minibatch rows `order [E, M, B / M]` int32, which minibatches `ran [E, M]` bool, and
  which had their optimizer step applied (`stepped [E, M]` bool): what a critic on a mesh of its
  own replays (`jax_ppo.ppo.placed_critic`)."""
  return {"order": order, "ran": ran, "stepped": ran & (metrics["skipped"] == 0)}


def _key_name(key: Any) -> Any:
  return getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))


def is_critic_leaf(path: tuple) -> bool:
  """Whether the leaf at `path` of `{"policy": ..., "value": ...}` (`TrainState.params`) is the
  critic's: under `"value"` (a separate critic) or under a `value_head` (the value head on the
  policy trunk)."""
  names = [_key_name(k) for k in path]
  return (bool(names) and names[0] == "value") or "value_head" in names


def with_critic_learning_rate(optimizer: optax.GradientTransformation,
                              ratio: float | None) -> optax.GradientTransformation:
  """`optimizer` over `{"policy", "value"}` with the critic's updates (`is_critic_leaf`) scaled
  by `ratio` (`PPOOptimizer.critic_lr_ratio`: the critic's peak learning rate over the
  policy's, on the same schedule); `optimizer` itself when `ratio` is None. Adam's update is
  linear in the learning rate (weight decay included), so this is AdamW at the critic's rate;
  the state is `optimizer`'s."""
  if ratio is None:
    return optimizer
  return scale_updates(optimizer, lambda path: ratio if is_critic_leaf(path) else 1.0)


@dataclasses.dataclass(frozen=True)
class Updater:
  """The update's static parts and its pure, jittable functions.

  Attributes:
    config: the run's `PPOConfig`.
    optimizer: the optax transformation over `{"policy", "value"}`.
    schedule: its learning-rate schedule (for the `lr` metric).
    kl_controller: the run's `core.KLController`.
    loss: `MicroLoss`, the microbatch loss from the parameters (`PPOSteps.micro_loss`).
    mesh: the device mesh the rows are constrained on, or None.
  """

  config: Any
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  kl_controller: core.KLController
  loss: MicroLoss
  mesh: Mesh | None = None

  def check_batch_size(self, batch: Batch) -> None:
    b = batch.response_ids.shape[0]
    if b != self.config.batch_size:
      raise ValueError(f"Batch has {b} rows but PPOConfig.batch_size is {self.config.batch_size}.")

  def apply_gradients(self, state: TrainState, grads, metrics) -> tuple[TrainState, dict]:
    """One AdamW step (scaled by `state.lr_scale`) with the minibatch's summed gradients.

    A step whose loss (`metrics["loss/total_avg"]`) or gradient has a NaN or inf is skipped:
    parameters, optimizer state and `opt_steps` keep their values bit for bit, and
    `metrics["skipped"]` is 1 (`guarded_update`).
    """
    params, opt_state, finite, grad_norm = guarded_update(
        self.optimizer, state.params, state.opt_state, grads,
        loss=metrics["loss/total_avg"], lr_scale=state.lr_scale)
    metrics = {**metrics, "policy/grad_norm": grad_norm,
               "skipped": (~finite).astype(jnp.float32)}
    new_state = state.replace(
        policy=params["policy"], value=params["value"], opt_state=opt_state,
        opt_steps=state.opt_steps + finite.astype(state.opt_steps.dtype),
    )
    return new_state, metrics

  def minibatch_step(self, state: TrainState, frozen, mb: Batch, coefs):
    """Gradients of the minibatch `mb` summed over its microbatches, then `apply_gradients`."""
    micro = constrain_rows(microbatches(mb, self.config.gradient_accumulation_steps), self.mesh,
                           axis=1)
    weights = loss_shares(self.config, micro.response_mask)
    value_and_grad = jax.value_and_grad(self.loss, has_aux=True)

    def grad_fn(params, xs):
      micro_batch, weight = xs
      (_, metrics), grads = value_and_grad(params, frozen, micro_batch, weight, coefs)
      return metrics, grads

    metrics, grads = accumulate_gradients(grad_fn, state.params, (micro, weights))
    return self.apply_gradients(state, grads, metrics)

  def epoch_keys(self, state: TrainState) -> tuple[TrainState, Array]:
    """Advances the state's key; returns the `ppo_epochs` keys that shuffle each epoch."""
    rng, shuffle_rng = jax.random.split(state.rng)
    return state.replace(rng=rng), jax.random.split(shuffle_rng, self.config.ppo_epochs)

  def early_stop(self, stopped: Array, epoch_kl: Array) -> Array:
    """Item 19: later epochs are skipped once an epoch's approx KL passes `target_kl`."""
    if self.config.target_kl is None:
      return stopped
    return stopped | (epoch_kl > self.config.target_kl)

  def epochs(self, state: TrainState, frozen, batch: Batch, coefs, keys: Array, stopped: Array):
    """Reshuffled passes over `batch`, one per key of `keys [E]`.

    Returns `(state, stopped, metrics, ran, order)`; metrics `[E, num_minibatches]` per name,
    `ran` `[E, num_minibatches]` bool (False for minibatches skipped after the early stop),
    `order` `[E, num_minibatches, minibatch_size]` int32, the rows of each minibatch.
    """
    c = self.config
    b = batch.response_ids.shape[0]
    micro = jax.tree.map(lambda x: x[: c.microbatch_size], batch)
    shapes = jax.eval_shape(self.loss, state.params, frozen, micro, 1.0, coefs)[1]
    skipped_metrics = {**jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                       "policy/grad_norm": jnp.zeros((), jnp.float32),
                       "skipped": jnp.zeros((), jnp.float32)}

    def run_minibatch(carry, idx):
      state, stopped = carry
      mb = constrain_rows(jax.tree.map(lambda x: x[idx], batch), self.mesh)
      state, metrics = jax.lax.cond(
          stopped,
          lambda s: (s, skipped_metrics),
          lambda s: self.minibatch_step(s, frozen, mb, coefs),
          state,
      )
      return (state, stopped), (metrics, ~stopped)

    def run_epoch(carry, key):
      state, stopped = carry
      order = jax.random.permutation(key, b).reshape(c.num_minibatches, c.minibatch_size)
      (state, _), (metrics, ran) = jax.lax.scan(run_minibatch, (state, stopped), order)
      epoch_kl = jnp.sum(metrics["policy/approxkl_avg"]) / jnp.maximum(jnp.sum(ran), 1)
      return (state, self.early_stop(stopped, epoch_kl)), (metrics, ran, order.astype(jnp.int32))

    (state, stopped), (metrics, ran, order) = jax.lax.scan(run_epoch, (state, stopped), keys)
    return state, stopped, metrics, ran, order

  def summary(self, state: TrainState, coefs, metrics, ran, stopped, seq_kl_mean, *, fresh):
    """Averages the per-minibatch metrics over the minibatches that ran (`skipped_updates`:
    the number of optimizer steps skipped for a non-finite loss or gradient); for a fresh batch
    (not a replayed one) also updates the KL controller with the batch's mean sequence KL and
    advances the step and episode counters."""
    c = self.config
    metrics = dict(metrics)
    skipped = metrics.pop("skipped")
    n_ran = jnp.sum(ran)
    out = {k: jnp.sum(v) / jnp.maximum(n_ran, 1).astype(jnp.float32) for k, v in metrics.items()}
    out["skipped_updates"] = jnp.sum(skipped)
    out["val/ratio_first_minibatch"] = metrics["val/ratio"][0, 0]
    out[LR_METRIC] = self.schedule(jnp.maximum(state.opt_steps - 1, 0)) * state.lr_scale
    if c.uses_critic:
      ratio = c.optimizer.critic_lr_ratio
      out[CRITIC_LR_METRIC] = out[LR_METRIC] * (1.0 if ratio is None else ratio)
    out["policy/epochs_run"] = n_ran.astype(jnp.float32) / c.num_minibatches
    out["policy/early_stopped"] = stopped.astype(jnp.float32)
    out["entropy_coef"] = coefs["entropy"]
    if fresh:
      kl = self.kl_controller.update(state.kl, seq_kl_mean, jnp.asarray(c.batch_size))
      kl = jax.tree.map(lambda new, old: jnp.where(jnp.isfinite(seq_kl_mean), new, old), kl,
                        state.kl)  # a non-finite KL leaves the controller as it was
      state = state.replace(kl=kl, step=state.step + 1, episode=state.episode + c.batch_size)
    return state, out

  def update(self, state: TrainState, frozen, batch: Batch, seq_kl_mean: Array, *, fresh: bool,
             plan: bool = False):
    """`ppo_epochs` passes over `batch`, then `summary`; returns `(state, metrics)`, and with
    `plan` also `update_plan(...)`."""
    self.check_batch_size(batch)
    coefs = coefficients(self.config, state)
    state, keys = self.epoch_keys(state)
    state, stopped, metrics, ran, order = self.epochs(state, frozen, batch, coefs, keys,
                                                      jnp.zeros((), bool))
    out = self.summary(state, coefs, metrics, ran, stopped, seq_kl_mean, fresh=fresh)
    return (*out, update_plan(order, ran, metrics)) if plan else out

  def fused_update(self, state: TrainState, frozen, batch: Batch, behaviour: dict[str, Array],
                   pullback: Callable, seq_kl_mean: Array, *, plan: bool = False):
    """The update of a fresh batch whose first epoch is one optimizer step on all of it.

    `behaviour` are the outputs of the behaviour parameters on `batch` (`PolicyForward.outputs`,
    computed by `jax.vjp` in the experience program) and `pullback` their vjp: the first step's
    gradient is the loss's gradient with respect to those outputs, pulled back to the
    parameters. The shuffle keys match `update`'s; epoch 0's permutation is the identity (a
    single minibatch sums over all rows in any order). Same results as `update` up to float
    summation order.
    """
    self.check_batch_size(batch)
    coefs = coefficients(self.config, state)
    state, keys = self.epoch_keys(state)
    weight = loss_shares(self.config, batch.response_mask[None])[0]
    loss_of_outputs = lambda out: micro_loss(self.config, out, batch, weight, coefs)  # noqa: E731
    (_, metrics), d_outputs = jax.value_and_grad(loss_of_outputs, has_aux=True)(behaviour)
    (grads,) = pullback(d_outputs)
    state, metrics = self.apply_gradients(state, grads, metrics)
    metrics = jax.tree.map(lambda m: m[None, None], metrics)  # [epoch 0, minibatch 0]
    ran = jnp.ones((1, 1), bool)
    order = jnp.arange(batch.response_ids.shape[0], dtype=jnp.int32)[None, None]
    stopped = self.early_stop(jnp.zeros((), bool), metrics["policy/approxkl_avg"][0, 0])
    if self.config.ppo_epochs > 1:
      state, stopped, rest, rest_ran, rest_order = self.epochs(state, frozen, batch, coefs,
                                                               keys[1:], stopped)
      metrics = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), metrics, rest)
      ran = jnp.concatenate([ran, rest_ran])
      order = jnp.concatenate([order, rest_order])
    state, out = self.summary(state, coefs, metrics, ran, stopped, seq_kl_mean, fresh=True)
    return (state, out, update_plan(order, ran, metrics)) if plan else (state, out)


__all__ = ["MicroLoss", "Updater", "is_critic_leaf", "update_plan", "with_critic_learning_rate"]
