r"""The compiled steps of a DPO run: sequence log-probs of both responses under the policy and
the frozen reference, `jax_ppo.core.dpo_loss` on them, one optimizer step.

For a pair (prompt `x`, chosen `y_c`, rejected `y_r`) the sequence log-prob of a response under a
causal LM is the masked sum over its tokens (prompt tokens and padding masked out), in float32:

.. math::
   \log\pi(y \mid x) = \sum_{t=1}^{|y|} \log\operatorname{softmax}(z_{t-1})[y_t]

where :math:`z_{t-1}` are the logits at the position before token :math:`y_t`
(`jax_ppo.models.logprobs.head_logprobs`, chunked over the sequence when the float32 logits
would exceed `DPOSteps.logits_chunk_bytes`). The reference's log-probs are computed on the fly in
the same step, under `stop_gradient`: the starting policy's weights (`ref`, a frozen copy with
no optimizer state), or, for a LoRA policy, the same module with its adapters off (the base
weights, which exist once in memory). With `DPOConfig.precompute_reference` the trainer instead
computes the reference's log-probs of every pair once (`reference_logps`) and feeds them to the
`*_cached` programs, which run the policy alone. The loss (Rafailov et al. 2023; IPO, hinge,
cDPO) is `dpo_loss` with the metrics under TRL's names (`rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`).

A step is the training kit's (`jax_ppo.training.state`): with `accumulation_steps = k > 1` the
pairs go through the model in `k` equal microbatches, each contributing `1 / k` of its mean
loss and metrics, so the summed gradient is the whole batch's; `apply_gradients` skips (bit for
bit) a step whose loss or gradient is not finite. On a mesh the programs are `MeshJit`s (state,
rest and reference placed by the logical-axis rules, pairs split on rows over `data` x `fsdp`);
the loss's mean is then over the global batch, as on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jax_ppo.core.preference import dpo_loss
from jax_ppo.dpo.config import DPOConfig
from jax_ppo.dpo.pairs import DPOPairs
from jax_ppo.models.logprobs import LOGITS_CHUNK_BYTES, head_logprobs
from jax_ppo.models.lora import has_lora
from jax_ppo.models.transformer import layer_loop
from jax_ppo.parallel.jit import MeshJit
from jax_ppo.parallel.rules import constrain_rows
from jax_ppo.training.loop import SKIPPED_METRIC
from jax_ppo.training.state import (
  LR_METRIC,
  StageState,
  accumulate_gradients,
  apply_gradients,
  microbatches,
)

Array = jax.Array


def sequence_logprobs(model, ids_bs: Array, mask_bs: Array, response_bs: Array, *,
                      use_lora: bool = True,
                      chunk_bytes: int | None = LOGITS_CHUNK_BYTES) -> Array:
  r"""Sequence log-probs `[B]` float32 of the response tokens of `ids_bs` under `model`:
  :math:`\sum_t r_{b,t} \log\pi(x_{b,t} \mid x_{b,<t})`.

  Args:
    model: a `CausalLM`.
    ids_bs: `[B, S]` int32 prompt + response ids.
    mask_bs: `[B, S]` int32 attention mask (1 on real tokens).
    response_bs: `[B, S]` int32, 1 on response tokens (0 in the first column).
    use_lora: False: a LoRA model with its adapters off (its base weights).
    chunk_bytes: see `head_logprobs`.
  """
  h_bsd = model.hidden_states(ids_bs, mask_bs, use_lora=use_lora)
  logprobs_bt, _ = head_logprobs(model, h_bsd[:, :-1], ids_bs[:, 1:], 1.0, entropy=None,
                                 chunk_bytes=chunk_bytes)
  return jnp.sum(jnp.where(response_bs[:, 1:] > 0, logprobs_bt, 0.0), axis=1)


def split_trainable(model: nnx.Module, *, scan_layers: bool | None
                    ) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """`(graphdef, params, rest)` of a DPO policy (`nnx.split` with the layer loop `scan_layers`,
  None: the model's own): `params` every `nnx.Param`, or only the LoRA adapters when the model
  has them; `rest` the other variables (LoRA's frozen base weights)."""
  trainable = nnx.LoRAParam if has_lora(model) else nnx.Param
  with layer_loop(model, scan_layers):
    return nnx.split(model, trainable, ...)


class DPOSteps:
  """The compiled functions of a DPO run (graph definition, loss settings and optimizer bound).

  - `train_step(state, rest, ref, pairs) -> (state, metrics)`: one AdamW step on the pairs'
    mean `dpo_loss` (the state donated). Metrics: `train/loss`, TRL's `rewards/chosen`,
    `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`,
    `logps/rejected`, `train/grad_norm`, `LR_METRIC` and `SKIPPED_METRIC`.
  - `eval_sums(params, rest, ref, pairs, weight) -> sums`: `weight`-weighted sums over the `[B]`
    pairs of the per-pair loss and of every metric above, and `pairs` (the weight sum).
  - `logps(params, rest, ref, pairs) -> (policy [B, 2], reference [B, 2])`: the chosen and
    rejected sequence log-probs (columns 0 and 1).
  - `reference_logps(params, rest, ref, pairs) -> reference [B, 2]`: the reference's alone
    (replicated on a mesh, so every process can read all of it): the log-probs that
    `DPOConfig.precompute_reference` caches.
  - `train_weighted_step(state, rest, ref, pairs, weight) -> (state, metrics)`: `train_step`
    on the `weight [B]`-weighted mean of the per-pair losses (online DPO: weight 0 masks a tied
    pair out of the loss and the metrics); the metrics are weighted means too, plus
    `objective/kl`, the unweighted mean over all `2B` responses of the sequence log-ratio
    `log pi - log pi_ref` (TRL's online-DPO KL estimate).
  - `train_cached_step(state, rest, ref_logps, pairs)` and
    `eval_cached_sums(params, rest, ref_logps, pairs, weight)`: `train_step` and `eval_sums` with
    the reference's `[B, 2]` float32 log-probs of the pairs given (`reference_logps`'s) instead
    of computed: one forward of the policy only.

  Args:
    config: the run's `DPOConfig` (`beta`, `loss_type`, `label_smoothing`,
      `gradient_accumulation_steps`).
    graphdef: the policy's graph (`split_trainable`).
    lora: the policy trains LoRA adapters; the reference is then its base (`ref` unused: pass
      an empty dict), else `ref` holds the reference's parameters (same structure as `params`).
    optimizer, schedule: from `jax_ppo.training.optim.make_optimizer`.
    mesh: compile for this device mesh (None: one device).

  Attributes:
    logits_chunk_bytes: the most bytes of float32 logits per log-prob pass (read when the
      functions are traced).
  """

  logits_chunk_bytes: int | None = LOGITS_CHUNK_BYTES

  def __init__(self, config: DPOConfig, *, graphdef: nnx.GraphDef, lora: bool,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule,
               mesh: Mesh | None = None):
    self.config = config
    self.graphdef = graphdef
    self.lora = lora
    self.optimizer = optimizer
    self.schedule = schedule
    self.mesh = mesh
    if mesh is None:
      self.train_step = jax.jit(self.train_impl, donate_argnums=0)
      self.train_cached_step = jax.jit(self.train_cached_impl, donate_argnums=0)
      self.train_weighted_step = jax.jit(self.train_weighted_impl, donate_argnums=0)
      self.eval_sums = jax.jit(self.eval_impl)
      self.eval_cached_sums = jax.jit(self.eval_cached_impl)
      self.logps = jax.jit(self.logps_impl)
      self.reference_logps = jax.jit(self.reference_impl)
    else:
      frozen = ("params", "params", "params")
      self.train_step = MeshJit(self.train_impl, mesh, in_roles=(*frozen, "batch"),
                                out_roles=("params", "replicated"), donate_argnums=(0,))
      self.train_cached_step = MeshJit(
          self.train_cached_impl, mesh, in_roles=("params", "params", "batch", "batch"),
          out_roles=("params", "replicated"), donate_argnums=(0,))
      self.train_weighted_step = MeshJit(
          self.train_weighted_impl, mesh, in_roles=(*frozen, "batch", "batch"),
          out_roles=("params", "replicated"), donate_argnums=(0,))
      self.eval_sums = MeshJit(self.eval_impl, mesh, in_roles=(*frozen, "batch", "batch"),
                               out_roles="replicated")
      self.eval_cached_sums = MeshJit(
          self.eval_cached_impl, mesh, in_roles=("params", "params", "batch", "batch", "batch"),
          out_roles="replicated")
      self.logps = MeshJit(self.logps_impl, mesh, in_roles=(*frozen, "batch"),
                           out_roles=("batch", "batch"))
      self.reference_logps = MeshJit(self.reference_impl, mesh, in_roles=(*frozen, "batch"),
                                     out_roles="replicated")

  @staticmethod
  def _rows(pairs: DPOPairs) -> tuple[Array, Array, Array]:
    """`(ids, mask, response)` `[2B, S]`: the chosen rows, then the rejected ones."""
    return (jnp.concatenate([pairs.chosen_ids, pairs.rejected_ids]),
            jnp.concatenate([pairs.chosen_mask, pairs.rejected_mask]),
            jnp.concatenate([pairs.chosen_response, pairs.rejected_response]))

  @staticmethod
  def _columns(lp_2b: Array) -> Array:
    """`[2B]` (chosen rows, then rejected) -> `[B, 2]` (chosen, rejected)."""
    b = lp_2b.shape[0] // 2
    return jnp.stack([lp_2b[:b], lp_2b[b:]], axis=1)

  def policy_logps(self, params: nnx.State, rest: nnx.State, pairs: DPOPairs) -> Array:
    """The policy's `[B, 2]` float32 sequence log-probs (chosen, rejected): one forward pass
    over the `2B` rows."""
    policy = nnx.merge(self.graphdef, params, rest)
    pi = sequence_logprobs(policy, *self._rows(pairs), chunk_bytes=self.logits_chunk_bytes)
    return self._columns(pi)

  def reference_impl(self, params: nnx.State, rest: nnx.State, ref: nnx.State,
                     pairs: DPOPairs) -> Array:
    """The reference's `[B, 2]` float32 sequence log-probs (chosen, rejected), under
    `stop_gradient`: `ref` merged with `rest`, or with LoRA the policy with its adapters off
    (`params` then only completes the graph). `reference_logps` compiles it."""
    chunk = self.logits_chunk_bytes
    if self.lora:
      reference = nnx.merge(self.graphdef, jax.lax.stop_gradient(params), rest)
      ref_lp = sequence_logprobs(reference, *self._rows(pairs), use_lora=False,
                                 chunk_bytes=chunk)
    else:
      reference = nnx.merge(self.graphdef, ref, rest)
      ref_lp = sequence_logprobs(reference, *self._rows(pairs), chunk_bytes=chunk)
    return jax.lax.stop_gradient(self._columns(ref_lp))

  def pair_logps(self, params: nnx.State, rest: nnx.State, ref: nnx.State,
                 pairs: DPOPairs) -> tuple[Array, Array]:
    """`(policy [B, 2], reference [B, 2])` float32 sequence log-probs (chosen, rejected), from
    one forward pass of each model over the `2B` rows; the reference's under `stop_gradient`."""
    return (self.policy_logps(params, rest, pairs),
            self.reference_impl(params, rest, ref, pairs))

  def pair_loss(self, pi: Array, ref_lp: Array) -> tuple[Array, dict[str, Array]]:
    """`dpo_loss` (mean over the pairs) of the policy's and the reference's `[B, 2]`
    log-probs."""
    c = self.config
    return dpo_loss(pi[:, 0], pi[:, 1], ref_lp[:, 0], ref_lp[:, 1], beta=c.beta,
                    loss_type=c.loss_type, label_smoothing=c.label_smoothing)

  def loss(self, params: nnx.State, rest: nnx.State, ref: nnx.State,
           pairs: DPOPairs) -> tuple[Array, dict[str, Array]]:
    """`dpo_loss` (mean over the pairs) of the policy's and reference's log-probs of `pairs`."""
    return self.pair_loss(*self.pair_logps(params, rest, ref, pairs))

  def cached_loss(self, params: nnx.State, rest: nnx.State, ref_logps: Array,
                  pairs: DPOPairs) -> tuple[Array, dict[str, Array]]:
    """`loss` with the reference's `[B, 2]` log-probs of `pairs` given."""
    return self.pair_loss(self.policy_logps(params, rest, pairs), ref_logps)

  def train_impl(self, state: StageState, rest: nnx.State, ref: nnx.State,
                 pairs: DPOPairs) -> tuple[StageState, dict[str, Array]]:
    """One optimizer step on `pairs` `[N, S]` (uncompiled; `train_step` compiles it)."""
    return self.optimizer_step(state, lambda p, b: self.loss(p, rest, ref, b), pairs)

  def train_cached_impl(self, state: StageState, rest: nnx.State, ref_logps: Array,
                        pairs: DPOPairs) -> tuple[StageState, dict[str, Array]]:
    """One optimizer step on `pairs` `[N, S]` with the reference's `[N, 2]` log-probs given
    (uncompiled; `train_cached_step` compiles it)."""
    return self.optimizer_step(state, lambda p, b: self.cached_loss(p, rest, *b),
                               (ref_logps, pairs))

  def train_weighted_impl(self, state: StageState, rest: nnx.State, ref: nnx.State,
                          pairs: DPOPairs, weight: Array) -> tuple[StageState, dict[str, Array]]:
    r"""One optimizer step on the weighted mean :math:`\sum_i w_i \ell_i / \sum_i w_i` of the
    per-pair losses of `pairs` `[B, S]` (uncompiled; `train_weighted_step` compiles it).

    The weights are rescaled to `w_i B / sum(w)` (all 0 when `sum(w) = 0`: a zero loss, no
    gradient) before the microbatches split them, so the mean of the microbatches' means of
    `w_i l_i` is the batch's weighted mean whatever rows each microbatch holds.
    """
    w = weight.astype(jnp.float32)
    total = jnp.sum(w)
    w = jnp.where(total > 0, w * (w.shape[0] / jnp.where(total > 0, total, 1.0)), 0.0)

    def loss_fn(params, batch):
      pairs_b, w_b = batch
      pi, ref_lp = self.pair_logps(params, rest, ref, pairs_b)
      loss, metrics = jax.vmap(lambda p, r: self.pair_loss(p[None], r[None]))(pi, ref_lp)
      out = {key: jnp.mean(w_b * v) for key, v in metrics.items()}
      out["objective/kl"] = jnp.mean(jax.lax.stop_gradient(pi - ref_lp))
      return jnp.mean(w_b * loss), out

    return self.optimizer_step(state, loss_fn, (pairs, w))

  def optimizer_step(self, state: StageState, loss_fn, batch) -> tuple[StageState,
                                                                        dict[str, Array]]:
    """One optimizer step on `loss_fn(params, batch) -> (loss, metrics)`, whose arrays have the
    pairs as rows (split into `gradient_accumulation_steps` microbatches)."""
    k = self.config.gradient_accumulation_steps
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if k == 1:
      (loss, metrics), grads = grad_fn(state.params, batch)
    else:  # equal microbatches: the mean of their means is the batch's mean

      def micro_grad(params, mb):
        (loss, metrics), grads = grad_fn(params, mb)
        return jax.tree.map(lambda x: x / k, ((loss, metrics), grads))

      xs = constrain_rows(microbatches(batch, k), self.mesh, axis=1)
      (loss, metrics), grads = accumulate_gradients(micro_grad, state.params, xs)
    new, finite, grad_norm = apply_gradients(state, self.optimizer, grads, loss=loss)
    out = {key: v for key, v in metrics.items() if key != "dpo_loss"}
    out.update({
        "train/loss": loss, "train/grad_norm": grad_norm,
        LR_METRIC: self.schedule(state.step) * state.lr_scale,
        SKIPPED_METRIC: 1.0 - finite.astype(jnp.float32),
    })
    return new, out

  def eval_impl(self, params: nnx.State, rest: nnx.State, ref: nnx.State, pairs: DPOPairs,
                weight: Array) -> dict[str, Array]:
    """Weighted sums of the per-pair loss and metrics (uncompiled; `eval_sums` compiles it):
    `dpo_loss` of each pair alone (`jax.vmap` over `[1]`-pair batches), times `weight [B]`."""
    return self.weighted_sums(*self.pair_logps(params, rest, ref, pairs), weight)

  def eval_cached_impl(self, params: nnx.State, rest: nnx.State, ref_logps: Array,
                       pairs: DPOPairs, weight: Array) -> dict[str, Array]:
    """`eval_impl` with the reference's `[B, 2]` log-probs given (`eval_cached_sums`)."""
    return self.weighted_sums(self.policy_logps(params, rest, pairs), ref_logps, weight)

  def weighted_sums(self, pi: Array, ref_lp: Array, weight: Array) -> dict[str, Array]:
    """`weight [B]`-weighted sums of each pair's `dpo_loss` and metrics, and `pairs`."""
    loss, metrics = jax.vmap(lambda p, r: self.pair_loss(p[None], r[None]))(pi, ref_lp)
    w = weight.astype(jnp.float32)
    sums = {key: jnp.sum(w * v) for key, v in metrics.items() if key != "dpo_loss"}
    sums.update({"loss": jnp.sum(w * loss), "pairs": jnp.sum(w)})
    return sums

  def logps_impl(self, params: nnx.State, rest: nnx.State, ref: nnx.State,
                 pairs: DPOPairs) -> tuple[Array, Array]:
    """`pair_logps` (uncompiled; `logps` compiles it)."""
    return self.pair_logps(params, rest, ref, pairs)


__all__ = ["DPOSteps", "sequence_logprobs", "split_trainable"]
