"""The jitted pieces of one RLHF update: experience, then epochs x minibatches x microbatches.

`PPOSteps` binds the static parts of a run (model graph definitions and the config) and exposes
two compiled functions:

- `experience(state, frozen, rollout, raw_scores) -> (batch, metrics)`: score post-processing
  (normalisation, clipping, length and missing-EOS penalties), teacher-forced old log-probs,
  reference log-probs, values, per-token KL, shaped rewards and advantages for the configured
  mode ("gae", "grpo", "rloo", "reinforce++"), all in one program;
- `update(state, frozen, batch) -> (state, metrics)`: `ppo_epochs` reshuffled passes, each a
  `lax.scan` over minibatches, each an optimizer step on gradients accumulated over
  microbatches (a `lax.scan`) and normalised by the minibatch's token count; epochs after the
  approximate KL passed `target_kl` are skipped with `lax.cond`. Finally the KL controller is
  updated. The state is donated.
- `experience_update(state, frozen, rollout, raw_scores) -> (state, batch, exp_metrics,
  update_metrics)`: both in one program, for runs whose first optimizer step sees the whole
  batch (`num_minibatches == 1`, no gradient accumulation). The old log-probs and values then
  come from the first epoch's own forward pass (`jax.vjp`): its outputs are the behaviour
  quantities, and their pullback gives the first step's gradient, so the policy and critic
  forward passes of `experience` are not run a second time. Same results as `experience`
  followed by `update`, up to float summation order.

With the reference on a sub-mesh of its own (`jax_ppo.ppo.placed_steps`), `reference_logprobs` is
compiled apart on that mesh and `experience` / `experience_update` take its result as a fifth
argument `ref_logprobs [B, T]` instead of running the reference forward pass; with four
arguments they are the programs above, unchanged. With the critic on a sub-mesh of its own
(`critic_apart`, `jax_ppo.ppo.placed_critic`) these programs train the policy only: the values
come in as `values [B, T]`, the loss has no value term, and with `plan=True` the updates also
return the minibatch order and which minibatches ran, for the critic's own update program.

Non-finite updates: an optimizer step whose loss or gradient holds a NaN or an inf is skipped
inside the compiled step (parameters and optimizer state unchanged, bit for bit) and counted in
the `skipped_updates` metric; the run loop stops after `PPOConfig.max_consecutive_skips`
consecutive updates with skips (`jax_ppo.training.loop`).

Every number that changes during training (the KL coefficient, the entropy coefficient, the
learning-rate scale) is read from the state, so nothing recompiles between updates.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jax_ppo import core
from jax_ppo.models.logprobs import LOGITS_CHUNK_BYTES, head_logprobs
from jax_ppo.parallel.rules import constrain_rows
from jax_ppo.ppo.batch import Batch, process_scores
from jax_ppo.ppo.config import PPOConfig
from jax_ppo.ppo.programs import ppo_step_jits
from jax_ppo.ppo.state import FrozenParams, TrainState, kl_controller
from jax_ppo.rollout.sampler import Rollout
from jax_ppo.training.state import guarded_update

Array = jax.Array


class PPOSteps:
  """The compiled experience and update functions of one run.

  Args:
    config: the run's `PPOConfig`.
    policy_graphdef: graph definition of the policy (`CausalLM`), from
      `nnx.split(policy, trainable_filter, ...)`.
    value_graphdef: graph definition of a separate critic (`ScalarModel`), or None.
    shared_value_head: the critic is a value head on the policy trunk.
    lora: the policy trains LoRA adapters; the reference is the base with adapters off.
    schedule: the learning-rate schedule (for the `lr` metric).
    optimizer: the optax transformation over `{"policy", "value"}`.
    mesh: a device mesh: the steps are compiled with explicit shardings
      (`jax_ppo.parallel.jit.ppo_step_jits`); None: plain `jax.jit`.
    critic_apart: the separate critic (`value_graphdef`) lives on a mesh of its own: the
      programs here read and train the policy only (`jax_ppo.ppo.placed_critic`).

  Attributes:
    logits_chunk_bytes: the most bytes of float32 logits per log-prob/entropy pass (default
      256 MiB, `models.logprobs`); larger ones are chunked over `T`, None never chunks.
      Read when the functions are traced: set it before the first call.
  """

  logits_chunk_bytes: int | None = LOGITS_CHUNK_BYTES

  def __init__(
      self,
      config: PPOConfig,
      *,
      policy_graphdef: nnx.GraphDef,
      value_graphdef: nnx.GraphDef | None,
      shared_value_head: bool,
      lora: bool,
      optimizer: optax.GradientTransformation,
      schedule: optax.Schedule,
      mesh: Mesh | None = None,
      critic_apart: bool = False,
  ):
    if config.uses_critic and value_graphdef is None and not shared_value_head:
      raise ValueError(
          "advantage_mode='gae' needs a critic: pass a value model or use a value head on the "
          "policy trunk (or choose advantage_mode 'grpo', 'rloo' or 'reinforce++')."
      )
    self.config = config
    self.policy_graphdef = policy_graphdef
    self.value_graphdef = value_graphdef
    self.shared_value_head = shared_value_head
    self.lora = lora
    self.optimizer = optimizer
    self.schedule = schedule
    self.kl_controller = kl_controller(config)
    self.mesh = mesh
    self.critic_apart = critic_apart
    self.experience, self.update, self.replay_update, self.experience_update = ppo_step_jits(
        self._experience, functools.partial(self._update, fresh=True),
        functools.partial(self._update, fresh=False), self._experience_update, mesh=mesh,
    )

  @property
  def fuses_first_epoch(self) -> bool:
    """Whether the trainer runs `experience_update` (one minibatch, one microbatch) instead of
    `experience` then `update`."""
    return self.config.num_minibatches == 1 and self.config.gradient_accumulation_steps == 1

  # -- models -------------------------------------------------------------------------------

  def _policy(self, trainable, frozen: FrozenParams):
    return nnx.merge(self.policy_graphdef, trainable, frozen.policy_rest)

  def _forward(self, model, batch, *, use_lora: bool = True, values: bool = False):
    """Response-position hidden states `[B, T, D]` (and values `[B, T]` from a shared value
    head)."""
    t = batch.response_ids.shape[1]
    s = batch.input_ids.shape[1] - t
    h = model.hidden_states(
        batch.input_ids, batch.attention_mask, positions=batch.positions, use_lora=use_lora
    )
    h = h[:, s - 1 : s + t - 1]  # position s + i - 1 predicts response token i
    return h, (model.values_from_hidden(h) if values else None)

  def _token_logprobs(self, model, h: Array, tokens: Array, *, entropy: str | None):
    """`models.logprobs.head_logprobs` at the sampling temperature (chunked if large)."""
    return head_logprobs(model, h, tokens, self.config.temperature, entropy=entropy,
                         chunk_bytes=self.logits_chunk_bytes)

  def _critic_values(self, params, frozen: FrozenParams, batch, shared_values):
    """Values `[B, T]` float32 of the critic at the positions that predict each token."""
    if self.shared_value_head:
      return shared_values
    critic = nnx.merge(self.value_graphdef, params["value"], frozen.value_rest)
    t = batch.response_ids.shape[1]
    s = batch.input_ids.shape[1] - t
    v = critic(batch.input_ids, batch.attention_mask, positions=batch.positions)
    return v[:, s - 1 : s + t - 1]

  def _outputs(self, params, frozen: FrozenParams, mb: Batch) -> dict[str, Array]:
    """Everything the loss reads from the models, per response token (`[B, T]` float32).

    `logprobs` of the response tokens at the sampling temperature, the policy's `entropy`
    (under `stop_gradient` when its weight is 0 throughout, so no backward pass runs through
    it) and, with a critic, its `values`. The loss depends on the parameters only through
    these, which is what lets `experience_update` differentiate it with `jax.vjp`.
    """
    c = self.config
    policy = self._policy(params["policy"], frozen)
    h, shared_values = self._forward(policy, mb, values=self.shared_value_head)
    trains_entropy = c.entropy_coef > 0 or (c.entropy_coef_final or 0.0) > 0
    logprobs, entropy = self._token_logprobs(
        policy, h, mb.response_ids, entropy="grad" if trains_entropy else "no_grad"
    )
    out = {"logprobs": logprobs, "entropy": entropy}
    if c.uses_critic and not self.critic_apart:
      out["values"] = self._critic_values(params, frozen, mb, shared_values)
    return out

  # -- experience ---------------------------------------------------------------------------

  @staticmethod
  def _view(rollout: Rollout) -> Batch:
    """The rollout as a `Batch` whose per-token training quantities are still placeholders."""
    mask = rollout.response_mask
    return Batch(
        input_ids=rollout.sequence_ids,
        attention_mask=rollout.attention_mask,
        positions=rollout.positions,
        response_ids=rollout.response_ids,
        response_mask=mask,
        old_logprobs=rollout.logprobs,
        ref_logprobs=rollout.logprobs,
        old_values=jnp.zeros(mask.shape, jnp.float32),
        advantages=jnp.zeros(mask.shape, jnp.float32),
        returns=jnp.zeros(mask.shape, jnp.float32),
    )

  def _experience(
      self, state: TrainState, frozen: FrozenParams, rollout: Rollout, raw_scores: Array,
      ref_logprobs: Array | None = None, values: Array | None = None,
  ) -> tuple[Batch, dict[str, Array]]:
    view = self._view(rollout)
    # Old log-probs (and values): a teacher-forced pass with the training numerics (item 4).
    behaviour = self._outputs(state.params, frozen, view)
    return self._experience_from(state, frozen, rollout, raw_scores, view, behaviour,
                                 ref_logprobs, values)

  def reference_logprobs(self, policy: nnx.State | None, frozen: FrozenParams,
                         rollout: Rollout | Batch) -> Array:
    """Reference log-probs `[B, T]` float32 of the response tokens (0 on padding), at the
    sampling temperature: the base weights with the adapters off for a LoRA policy (`policy`:
    its trainable variables), else `frozen.ref` (`policy` unused). `experience` computes them
    inside its program; `jax_ppo.ppo.placed_steps` runs this as its own program on the
    reference's devices and passes the result as `ref_logprobs`."""
    view = self._view(rollout) if isinstance(rollout, Rollout) else rollout
    if self.lora:
      ref_model = self._policy(policy, frozen)
      ref_h, _ = self._forward(ref_model, view, use_lora=False)
    else:
      ref_model = self._policy(frozen.ref, frozen)
      ref_h, _ = self._forward(ref_model, view)
    ref_logprobs, _ = self._token_logprobs(ref_model, ref_h, view.response_ids, entropy=None)
    return jnp.where(view.response_mask, ref_logprobs, 0.0)

  def _experience_from(
      self,
      state: TrainState,
      frozen: FrozenParams,
      rollout: Rollout,
      raw_scores: Array,
      view: Batch,
      behaviour: dict[str, Array],
      ref_logprobs: Array | None = None,
      values: Array | None = None,
  ) -> tuple[Batch, dict[str, Array]]:
    """The training batch and its metrics, given the behaviour policy's `_outputs` on `view`
    (and the reference log-probs, or the critic's values, when computed elsewhere)."""
    c = self.config
    mask = rollout.response_mask
    scores = process_scores(c, raw_scores, rollout)
    old_logprobs = jnp.where(mask, behaviour["logprobs"], 0.0)  # item 9: padding: ratio 1, KL 0
    if ref_logprobs is None:
      ref_logprobs = self.reference_logprobs(state.policy, frozen, view)
    else:
      ref_logprobs = jnp.where(mask, ref_logprobs, 0.0)

    kl = jnp.where(mask, core.kl_penalty(old_logprobs, ref_logprobs, estimator=c.kl_estimator), 0.0)
    beta = state.kl.coef
    beta_in_reward = beta if c.kl_enters_reward else jnp.zeros_like(beta)
    rewards = core.shape_rewards(scores, kl, mask, kl_coef=beta_in_reward)
    seq_kl = jnp.sum(kl, axis=1)

    critic_values = behaviour.get("values") if values is None else values
    values = jnp.zeros(mask.shape, jnp.float32)
    returns = jnp.zeros(mask.shape, jnp.float32)
    if c.advantage_mode == "gae":
      values = jnp.where(mask, critic_values, 0.0)
      gae_rewards = core.masked_whiten(rewards, mask, shift_mean=False) if c.whiten_rewards else (
          rewards)
      advantages, returns = core.gae(gae_rewards, values, mask, gamma=c.gamma, lam=c.lam)
      if c.whiten_advantages:
        advantages = core.masked_whiten(advantages, mask)
    elif c.advantage_mode == "reinforce++":
      advantages = core.reinforce_plus_plus_advantages(rewards, mask, gamma=c.gamma)
    else:
      seq_rewards = scores - beta_in_reward * seq_kl
      if c.advantage_mode == "grpo":
        seq_adv = core.grpo_advantages(seq_rewards, c.n_samples, scale=c.grpo_scale)
      else:
        seq_adv = core.rloo_advantages(seq_rewards, c.n_samples)
      advantages = jnp.where(mask, seq_adv[:, None], 0.0)

    batch = view.replace(
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        old_values=values,
        advantages=advantages,
        returns=returns,
    )
    non_score = jnp.sum(jnp.where(mask, -beta_in_reward * kl, 0.0), axis=1)
    lengths = rollout.response_lengths.astype(jnp.float32)
    metrics = {
        "objective/kl": jnp.mean(seq_kl),
        "objective/entropy": jnp.mean(jnp.sum(-old_logprobs, axis=1)),
        "objective/non_score_reward": jnp.mean(non_score),
        "objective/rlhf_reward": jnp.mean(scores + non_score),
        "objective/scores": jnp.mean(scores),
        "objective/scores_std": jnp.std(scores),
        "objective/raw_scores": jnp.mean(jnp.asarray(raw_scores, jnp.float32)),
        "val/num_eos_tokens": jnp.sum(rollout.has_stop).astype(jnp.float32),
        "response_length/mean": jnp.mean(lengths),
        "response_length/std": jnp.std(lengths),
        "kl_coef": beta,
        "advantages/mean": core.masked_mean(advantages, mask),
        "advantages/std": jnp.sqrt(core.masked_var(advantages, mask)),
        "rollout/logprob_mismatch": core.masked_mean(
            jnp.abs(rollout.logprobs - old_logprobs), mask
        ),
    }
    if c.uses_critic:
      metrics["val/explained_variance"] = core.explained_variance(values, returns, mask)
      metrics["val/mean"] = core.masked_mean(values, mask)
    return batch, metrics

  # -- update -------------------------------------------------------------------------------

  def _coefficients(self, state: TrainState) -> dict[str, Array]:
    c = self.config
    progress = jnp.clip(state.step.astype(jnp.float32) / c.total_updates, 0.0, 1.0)
    final = c.entropy_coef if c.entropy_coef_final is None else c.entropy_coef_final
    return {
        "entropy": c.entropy_coef + (final - c.entropy_coef) * progress,
        "kl": state.kl.coef,
    }

  def _loss_from_outputs(self, out: dict[str, Array], mb: Batch, weight, coefs):
    """Loss of one microbatch from its `_outputs`, pre-scaled by its share `weight` of the
    minibatch; returns `(loss, metrics)`."""
    c = self.config
    mask = mb.response_mask
    logprobs = out["logprobs"]
    pg_loss, pg = core.ppo_policy_loss(
        logprobs, mb.old_logprobs, mb.advantages, mask, clip_eps=c.clip_eps,
        clip_eps_high=c.clip_eps_high, dual_clip=c.dual_clip, reduction=c.loss_reduction,
    )
    entropy = core.aggregate_loss(out["entropy"], mask, c.loss_reduction)
    loss = pg_loss - coefs["entropy"] * entropy
    metrics = {
        "policy/approxkl_avg": pg["approx_kl"],
        "policy/clipfrac_avg": pg["clipfrac"],
        "policy/dual_clipfrac_avg": pg["dual_clipfrac"],
        "loss/policy_avg": pg_loss,
        "policy/entropy_avg": entropy,
        "val/ratio": pg["ratio_mean"],
        "val/ratio_var": pg["ratio_var"],
    }
    if not c.kl_enters_reward:
      kl = core.kl_penalty(logprobs, mb.ref_logprobs, estimator=c.kl_loss_estimator)
      kl_loss = core.aggregate_loss(kl, mask, c.loss_reduction)
      loss = loss + coefs["kl"] * kl_loss
      metrics["loss/kl_avg"] = kl_loss
    if "values" in out:  # a critic trained in this program (not `critic_apart`)
      vf_loss, vf = core.ppo_value_loss(
          out["values"], mb.old_values, mb.returns, mask, clip_eps=c.value_clip_eps,
          reduction=c.loss_reduction,
      )
      loss = loss + c.vf_coef * vf_loss
      metrics["loss/value_avg"] = vf_loss
      metrics["val/clipfrac_avg"] = vf["clipfrac"]
    metrics["loss/total_avg"] = loss
    return loss * weight, jax.tree.map(lambda m: m * weight, metrics)

  def _micro_loss(self, params, frozen, mb: Batch, weight, coefs):
    """Loss of one microbatch, pre-scaled by its share `weight` of the minibatch."""
    return self._loss_from_outputs(self._outputs(params, frozen, mb), mb, weight, coefs)

  def _share(self, mask_mb: Array) -> Array:
    """`[A, M, T]` masks of A microbatches -> each microbatch's share of the minibatch loss.

    Token-mean losses are normalised by the minibatch's token count (not per microbatch,
    item 18); sequence-level reductions by its count of non-empty rows.
    """
    if self.config.loss_reduction == "token-mean":
      per_micro = jnp.sum(mask_mb, axis=(1, 2)).astype(jnp.float32)
    else:
      per_micro = jnp.sum(jnp.any(mask_mb, axis=2), axis=1).astype(jnp.float32)
    total = jnp.sum(per_micro)
    return per_micro / jnp.where(total > 0, total, 1.0)

  def _micro_metric_zeros(self, state: TrainState, frozen, batch: Batch, coefs):
    """Zeros shaped like `_micro_loss`'s metrics (traced once per compile, never run)."""
    micro = jax.tree.map(lambda x: x[: self.config.microbatch_size], batch)
    shapes = jax.eval_shape(self._micro_loss, state.params, frozen, micro, 1.0, coefs)[1]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def _apply_gradients(self, state: TrainState, grads, metrics):
    """One AdamW step (scaled by `state.lr_scale`) with the minibatch's summed gradients
    (`jax_ppo.training.state.guarded_update`).

    A step whose loss (`metrics["loss/total_avg"]`) or gradient has a NaN or inf is skipped:
    parameters, optimizer state and `opt_steps` keep their values bit for bit, and
    `metrics["skipped"]` is 1 (a `lax.cond` around the optimizer step, so the moments are
    updated in place).
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

  def _minibatch_step(self, state: TrainState, frozen, mb: Batch, coefs, zero_metrics):
    c = self.config
    micro = jax.tree.map(
        lambda x: x.reshape(c.gradient_accumulation_steps, c.microbatch_size, *x.shape[1:]), mb
    )
    micro = constrain_rows(micro, self.mesh, axis=1)
    weights = self._share(micro.response_mask)
    grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

    def accumulate(carry, xs):
      grads, metrics = carry
      micro_batch, weight = xs
      (_, m), g = grad_fn(state.params, frozen, micro_batch, weight, coefs)
      return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, metrics, m)), None

    zero_grads = jax.tree.map(jnp.zeros_like, state.params)
    (grads, metrics), _ = jax.lax.scan(accumulate, (zero_grads, zero_metrics), (micro, weights))
    return self._apply_gradients(state, grads, metrics)

  def _epoch_rngs(self, state: TrainState) -> tuple[TrainState, Array]:
    """Advances the state's key; returns the `ppo_epochs` keys that shuffle each epoch."""
    rng, shuffle_rng = jax.random.split(state.rng)
    return state.replace(rng=rng), jax.random.split(shuffle_rng, self.config.ppo_epochs)

  def _stops(self, stopped: Array, epoch_kl: Array) -> Array:
    """Early stop (item 19): later epochs are skipped once an epoch's approx KL passes
    `target_kl`."""
    if self.config.target_kl is None:
      return stopped
    return stopped | (epoch_kl > self.config.target_kl)

  def _epochs(self, state: TrainState, frozen, batch: Batch, coefs, epoch_rngs, stopped):
    """Reshuffled passes over `batch`, one per key of `epoch_rngs` `[E]`.

    Returns `(state, stopped, metrics, ran, order)`; metrics `[E, num_minibatches]` per name,
    `ran` `[E, num_minibatches]` bool (False for minibatches skipped after the early stop),
    `order` `[E, num_minibatches, minibatch_size]` int32, the rows of each minibatch.
    """
    c = self.config
    b = batch.response_ids.shape[0]
    zero_metrics = self._micro_metric_zeros(state, frozen, batch, coefs)
    skipped_metrics = {**zero_metrics, "policy/grad_norm": jnp.zeros((), jnp.float32),
                       "skipped": jnp.zeros((), jnp.float32)}

    def run_minibatch(carry, idx):
      state, stopped = carry
      mb = constrain_rows(jax.tree.map(lambda x: x[idx], batch), self.mesh)

      state, metrics = jax.lax.cond(
          stopped,
          lambda s: (s, skipped_metrics),
          lambda s: self._minibatch_step(s, frozen, mb, coefs, zero_metrics),
          state,
      )
      return (state, stopped), (metrics, ~stopped)

    def run_epoch(carry, epoch_rng):
      state, stopped = carry
      order = jax.random.permutation(epoch_rng, b).reshape(c.num_minibatches, c.minibatch_size)
      (state, _), (metrics, ran) = jax.lax.scan(run_minibatch, (state, stopped), order)
      epoch_kl = jnp.sum(metrics["policy/approxkl_avg"]) / jnp.maximum(jnp.sum(ran), 1)
      return (state, self._stops(stopped, epoch_kl)), (metrics, ran, order.astype(jnp.int32))

    (state, stopped), (metrics, ran, order) = jax.lax.scan(run_epoch, (state, stopped),
                                                           epoch_rngs)
    return state, stopped, metrics, ran, order

  def _summary(self, state: TrainState, coefs, metrics, ran, stopped, seq_kl_mean, *, fresh):
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
    out["lr"] = self.schedule(jnp.maximum(state.opt_steps - 1, 0)) * state.lr_scale
    out["policy/epochs_run"] = n_ran.astype(jnp.float32) / c.num_minibatches
    out["policy/early_stopped"] = stopped.astype(jnp.float32)
    out["entropy_coef"] = coefs["entropy"]
    if fresh:
      kl = self.kl_controller.update(state.kl, seq_kl_mean, jnp.asarray(c.batch_size))
      kl = jax.tree.map(lambda new, old: jnp.where(jnp.isfinite(seq_kl_mean), new, old), kl,
                        state.kl)  # a non-finite KL leaves the controller as it was
      state = state.replace(kl=kl, step=state.step + 1, episode=state.episode + c.batch_size)
    return state, out

  def _check_batch_size(self, batch: Batch) -> None:
    b = batch.response_ids.shape[0]
    if b != self.config.batch_size:
      raise ValueError(f"Batch has {b} rows but PPOConfig.batch_size is {self.config.batch_size}.")

  def _update(
      self,
      state: TrainState,
      frozen: FrozenParams,
      batch: Batch,
      seq_kl_mean: Array,
      *,
      fresh: bool,
      plan: bool = False,
  ) -> tuple[TrainState, dict[str, Array]]:
    """`ppo_epochs` passes over `batch`; for a fresh batch (not a replayed one) also the
    KL-controller update with the batch's mean sequence KL and the step/episode counters.
    `plan`: also return `_plan` (`jax_ppo.ppo.placed_critic`: the critic's update program)."""
    self._check_batch_size(batch)
    coefs = self._coefficients(state)
    state, epoch_rngs = self._epoch_rngs(state)
    state, stopped, metrics, ran, order = self._epochs(
        state, frozen, batch, coefs, epoch_rngs, jnp.zeros((), bool)
    )
    out = self._summary(state, coefs, metrics, ran, stopped, seq_kl_mean, fresh=fresh)
    return (*out, self._plan(order, ran, metrics)) if plan else out

  @staticmethod
  def _plan(order: Array, ran: Array, metrics) -> dict[str, Array]:
    """The minibatch rows `order`, which ran, and which had their optimizer step applied."""
    return {"order": order, "ran": ran, "stepped": ran & (metrics["skipped"] == 0)}

  def _experience_update(
      self, state: TrainState, frozen: FrozenParams, rollout: Rollout, raw_scores: Array,
      ref_logprobs: Array | None = None, values: Array | None = None, *, plan: bool = False,
  ) -> tuple[TrainState, Batch, dict[str, Array], dict[str, Array]]:
    """`experience` then `update` in one program, sharing the first epoch's forward pass.

    Only for `fuses_first_epoch` configs: the first epoch is then one optimizer step on the
    whole batch with the behaviour parameters, so its forward pass computes exactly the old
    log-probs and values. `jax.vjp` keeps that pass's residuals while the reference pass,
    rewards and advantages are computed, and the loss gradient with respect to its outputs is
    pulled back to the parameters. The shuffle keys match `update`'s, epoch 0's permutation is
    the identity (a single minibatch sums over all rows in any order).
    """
    if not self.fuses_first_epoch:
      raise ValueError(
          "experience_update needs num_minibatches == 1 and gradient_accumulation_steps == 1 "
          f"(got {self.config.num_minibatches} and {self.config.gradient_accumulation_steps}); "
          "call experience and then update."
      )
    view = self._view(rollout)
    behaviour, pullback = jax.vjp(lambda p: self._outputs(p, frozen, view), state.params)
    batch, exp_metrics = self._experience_from(
        state, frozen, rollout, raw_scores, view, behaviour, ref_logprobs, values
    )
    self._check_batch_size(batch)
    coefs = self._coefficients(state)
    state, epoch_rngs = self._epoch_rngs(state)
    weight = self._share(batch.response_mask[None])[0]
    (_, metrics), d_outputs = jax.value_and_grad(self._loss_from_outputs, has_aux=True)(
        behaviour, batch, weight, coefs
    )
    (grads,) = pullback(d_outputs)
    state, metrics = self._apply_gradients(state, grads, metrics)
    metrics = jax.tree.map(lambda m: m[None, None], metrics)  # [epoch 0, minibatch 0]
    ran = jnp.ones((1, 1), bool)
    order = jnp.arange(batch.response_ids.shape[0], dtype=jnp.int32)[None, None]
    stopped = self._stops(jnp.zeros((), bool), metrics["policy/approxkl_avg"][0, 0])
    if self.config.ppo_epochs > 1:
      state, stopped, rest, rest_ran, rest_order = self._epochs(
          state, frozen, batch, coefs, epoch_rngs[1:], stopped
      )
      metrics = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), metrics, rest)
      ran = jnp.concatenate([ran, rest_ran])
      order = jnp.concatenate([order, rest_order])
    state, update_metrics = self._summary(
        state, coefs, metrics, ran, stopped, exp_metrics["objective/kl"], fresh=True
    )
    out = (state, batch, exp_metrics, update_metrics)
    return (*out, self._plan(order, ran, metrics)) if plan else out


__all__ = [
    "PPOSteps",
]
