"""The compiled programs of one RLHF update: experience, then epochs x minibatches x microbatches.

`PPOSteps` is the thin facade over the algorithm's seams: `jax_ppo.ppo.forward` (the models'
forward passes and the one log-prob path), `jax_ppo.ppo.experience` (rollout -> `Batch`, with
the advantage table of `jax_ppo.ppo.advantages`), `jax_ppo.ppo.loss` (one microbatch's loss) and
`jax_ppo.ppo.update` (epochs, minibatches, microbatches, the early stop, the fused first epoch).
It binds the static parts of a run (model graph definitions and the config) and compiles:

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
import optax
from flax import nnx
from jax.sharding import Mesh

from jax_ppo.models.logprobs import LOGITS_CHUNK_BYTES
from jax_ppo.ppo.batch import Batch, batch_view
from jax_ppo.ppo.config import PPOConfig
from jax_ppo.ppo.experience import make_batch
from jax_ppo.ppo.forward import PolicyForward
from jax_ppo.ppo.loss import micro_loss, trains_entropy
from jax_ppo.ppo.programs import ppo_step_jits
from jax_ppo.ppo.state import FrozenParams, TrainState, kl_controller
from jax_ppo.ppo.update import Updater, with_critic_learning_rate
from jax_ppo.rollout.sampler import Rollout

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
    optimizer: the optax transformation over `{"policy", "value"}` (`self.optimizer` is it with
      the critic's updates scaled by `PPOOptimizer.critic_lr_ratio`, when set).
    mesh: a device mesh: the steps are compiled with explicit shardings
      (`jax_ppo.ppo.programs.ppo_step_jits`); None: plain `jax.jit`.
    critic_apart: the separate critic (`value_graphdef`) lives on a mesh of its own: the
      programs here read and train the policy only (`jax_ppo.ppo.placed_critic`).

  Attributes:
    forward: the models' forward passes (`jax_ppo.ppo.forward.PolicyForward`).
    updater: the update's functions (`jax_ppo.ppo.update.Updater`).
    logits_chunk_bytes: the most bytes of float32 logits per log-prob/entropy pass of training
      on one device (default 256 MiB, `models.logprobs`); larger ones are chunked over `T`,
      None never chunks. Read when the functions are traced: set it before the first call.
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
    self.forward = PolicyForward(policy_graphdef=policy_graphdef, value_graphdef=value_graphdef,
                                 shared_value_head=shared_value_head, lora=lora,
                                 temperature=config.sampling.temperature)
    self.policy_graphdef = policy_graphdef
    self.value_graphdef = value_graphdef
    self.shared_value_head = shared_value_head
    self.lora = lora
    # The critic's own learning rate (`PPOOptimizer.critic_learning_rate`) scales its updates;
    # the state is the plain optimizer's.
    self.optimizer = with_critic_learning_rate(optimizer, config.optimizer.critic_lr_ratio)
    self.schedule = schedule
    self.kl_controller = kl_controller(config)
    self.mesh = mesh
    self.critic_apart = critic_apart
    self.updater = Updater(config=config, optimizer=self.optimizer, schedule=schedule,
                           kl_controller=self.kl_controller, loss=self.micro_loss, mesh=mesh)
    self.experience, self.update, self.replay_update, self.experience_update = ppo_step_jits(
        self.compute_experience, functools.partial(self.run_update, fresh=True),
        functools.partial(self.run_update, fresh=False), self.experience_and_update, mesh=mesh,
    )

  @property
  def fuses_first_epoch(self) -> bool:
    """Whether the trainer runs `experience_update` (one minibatch, one microbatch) instead of
    `experience` then `update`."""
    return self.config.num_minibatches == 1 and self.config.gradient_accumulation_steps == 1

  # -- the models' outputs --------------------------------------------------------------------

  def outputs(self, params, frozen: FrozenParams, mb: Batch) -> dict[str, Array]:
    """`PolicyForward.outputs` with this run's entropy, critic and chunking settings:
    `logprobs`, `entropy` and (a critic trained here) `values`, `[B, T]` float32 each."""
    c = self.config
    return self.forward.outputs(params, frozen, mb, train_entropy=trains_entropy(c),
                                critic=c.uses_critic and not self.critic_apart,
                                chunk_bytes=self.logits_chunk_bytes)

  def micro_loss(self, params, frozen: FrozenParams, mb: Batch, weight, coefs):
    """Loss of one microbatch from the parameters (`loss.micro_loss` of `outputs`), pre-scaled
    by its share `weight` of the minibatch; `(loss, metrics)`."""
    return micro_loss(self.config, self.outputs(params, frozen, mb), mb, weight, coefs)

  def reference_logprobs(self, policy: nnx.State | None, frozen: FrozenParams,
                         rollout: Rollout | Batch) -> Array:
    """Reference log-probs `[B, T]` float32 of the response tokens (0 on padding), at the
    sampling temperature (`PolicyForward.reference_logprobs`: `policy` is read for a LoRA
    policy only). `experience` computes them inside its program; `jax_ppo.ppo.placed_steps`
    runs this as its own program on the reference's devices and passes the result as
    `ref_logprobs`."""
    view = batch_view(rollout) if isinstance(rollout, Rollout) else rollout
    return self.forward.reference_logprobs(policy, frozen, view,
                                           chunk_bytes=self.logits_chunk_bytes)

  # -- the programs' functions (uncompiled; the placed programs compile them too) ------------

  def compute_experience(
      self, state: TrainState, frozen: FrozenParams, rollout: Rollout, raw_scores: Array,
      ref_logprobs: Array | None = None, values: Array | None = None,
  ) -> tuple[Batch, dict[str, Array]]:
    """`experience`'s function: the behaviour pass (the old log-probs and values, a
    teacher-forced pass with the training numerics, item 4), the reference's log-probs (unless
    given) and `experience.make_batch`."""
    view = batch_view(rollout)
    behaviour = self.outputs(state.params, frozen, view)
    if ref_logprobs is None:
      ref_logprobs = self.reference_logprobs(state.policy, frozen, view)
    return make_batch(self.config, state, rollout, raw_scores, view, behaviour, ref_logprobs,
                      values)

  def run_update(self, state: TrainState, frozen: FrozenParams, batch: Batch,
                 seq_kl_mean: Array, *, fresh: bool, plan: bool = False):
    """`update`'s (`fresh`) and `replay_update`'s function (`Updater.update`); with `plan` it
    also returns the minibatch plan (`jax_ppo.ppo.placed_critic`)."""
    return self.updater.update(state, frozen, batch, seq_kl_mean, fresh=fresh, plan=plan)

  def experience_and_update(
      self, state: TrainState, frozen: FrozenParams, rollout: Rollout, raw_scores: Array,
      ref_logprobs: Array | None = None, values: Array | None = None, *, plan: bool = False,
  ) -> tuple[TrainState, Batch, dict[str, Array], dict[str, Array]]:
    """`experience_update`'s function: `experience` then `update` in one program, sharing the
    first epoch's forward pass (`Updater.fused_update`).

    Only for `fuses_first_epoch` configs: the first epoch is then one optimizer step on the
    whole batch with the behaviour parameters, so its forward pass computes exactly the old
    log-probs and values. `jax.vjp` keeps that pass's residuals while the reference pass,
    rewards and advantages are computed.
    """
    if not self.fuses_first_epoch:
      raise ValueError(
          "experience_update needs num_minibatches == 1 and gradient_accumulation_steps == 1 "
          f"(got {self.config.num_minibatches} and {self.config.gradient_accumulation_steps}); "
          "call experience and then update."
      )
    view = batch_view(rollout)
    behaviour, pullback = jax.vjp(lambda p: self.outputs(p, frozen, view), state.params)
    if ref_logprobs is None:
      ref_logprobs = self.reference_logprobs(state.policy, frozen, view)
    batch, exp_metrics = make_batch(self.config, state, rollout, raw_scores, view, behaviour,
                                    ref_logprobs, values)
    state, upd_metrics, *plan_out = self.updater.fused_update(
        state, frozen, batch, behaviour, pullback, exp_metrics["objective/kl"], plan=plan)
    return (state, batch, exp_metrics, upd_metrics, *plan_out)


__all__ = [
    "PPOSteps",
]
