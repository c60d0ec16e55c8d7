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
weights, which exist once in memory). The loss (Rafailov et al. 2023; IPO, hinge, cDPO) is
`dpo_loss` with the metrics under TRL's names (`rewards/chosen`, `rewards/rejected`,
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
      self.eval_sums = jax.jit(self.eval_impl)
      self.logps = jax.jit(self.logps_impl)
    else:
      frozen = ("params", "params", "params")
      self.train_step = MeshJit(self.train_impl, mesh, in_roles=(*frozen, "batch"),
                                out_roles=("params", "replicated"), donate_argnums=(0,))
      self.eval_sums = MeshJit(self.eval_impl, mesh, in_roles=(*frozen, "batch", "batch"),
                               out_roles="replicated")
      self.logps = MeshJit(self.logps_impl, mesh, in_roles=(*frozen, "batch"),
                           out_roles=("batch", "batch"))

  def pair_logps(self, params: nnx.State, rest: nnx.State, ref: nnx.State,
                 pairs: DPOPairs) -> tuple[Array, Array]:
    """`(policy [B, 2], reference [B, 2])` float32 sequence log-probs (chosen, rejected), from
    one forward pass of each model over the `2B` rows; the reference's under `stop_gradient`."""
    ids = jnp.concatenate([pairs.chosen_ids, pairs.rejected_ids])
    mask = jnp.concatenate([pairs.chosen_mask, pairs.rejected_mask])
    response = jnp.concatenate([pairs.chosen_response, pairs.rejected_response])
    chunk = self.logits_chunk_bytes
    policy = nnx.merge(self.graphdef, params, rest)
    pi = sequence_logprobs(policy, ids, mask, response, chunk_bytes=chunk)
    if self.lora:
      reference = nnx.merge(self.graphdef, jax.lax.stop_gradient(params), rest)
      ref_lp = sequence_logprobs(reference, ids, mask, response, use_lora=False,
                                 chunk_bytes=chunk)
    else:
      reference = nnx.merge(self.graphdef, ref, rest)
      ref_lp = sequence_logprobs(reference, ids, mask, response, chunk_bytes=chunk)
    b = pairs.chosen_ids.shape[0]
    return (jnp.stack([pi[:b], pi[b:]], axis=1),
            jax.lax.stop_gradient(jnp.stack([ref_lp[:b], ref_lp[b:]], axis=1)))

  def loss(self, params: nnx.State, rest: nnx.State, ref: nnx.State,
           pairs: DPOPairs) -> tuple[Array, dict[str, Array]]:
    """`dpo_loss` (mean over the pairs) of the policy's and reference's log-probs of `pairs`."""
    c = self.config
    pi, ref_lp = self.pair_logps(params, rest, ref, pairs)
    return dpo_loss(pi[:, 0], pi[:, 1], ref_lp[:, 0], ref_lp[:, 1], beta=c.beta,
                    loss_type=c.loss_type, label_smoothing=c.label_smoothing)

  def train_impl(self, state: StageState, rest: nnx.State, ref: nnx.State,
                 pairs: DPOPairs) -> tuple[StageState, dict[str, Array]]:
    """One optimizer step on `pairs` `[N, S]` (uncompiled; `train_step` compiles it)."""
    k = self.config.gradient_accumulation_steps
    grad_fn = jax.value_and_grad(self.loss, has_aux=True)
    if k == 1:
      (loss, metrics), grads = grad_fn(state.params, rest, ref, pairs)
    else:  # equal microbatches: the mean of their means is the batch's mean

      def micro_grad(params, mb):
        (loss, metrics), grads = grad_fn(params, rest, ref, mb)
        return jax.tree.map(lambda x: x / k, ((loss, metrics), grads))

      xs = constrain_rows(microbatches(pairs, k), self.mesh, axis=1)
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
    c = self.config
    pi, ref_lp = self.pair_logps(params, rest, ref, pairs)

    def one(p, r):
      return dpo_loss(p[:1], p[1:], r[:1], r[1:], beta=c.beta, loss_type=c.loss_type,
                      label_smoothing=c.label_smoothing)

    loss, metrics = jax.vmap(one)(pi, ref_lp)
    w = weight.astype(jnp.float32)
    sums = {key: jnp.sum(w * v) for key, v in metrics.items() if key != "dpo_loss"}
    sums.update({"loss": jnp.sum(w * loss), "pairs": jnp.sum(w)})
    return sums

  def logps_impl(self, params: nnx.State, rest: nnx.State, ref: nnx.State,
                 pairs: DPOPairs) -> tuple[Array, Array]:
    """`pair_logps` (uncompiled; `logps` compiles it)."""
    return self.pair_logps(params, rest, ref, pairs)


__all__ = ["DPOSteps", "sequence_logprobs", "split_trainable"]
