"""The PPO loss of one microbatch from the models' outputs (PureJaxRL's `_loss_fn`).

    loss = L_pg(ratio, A) - c_H(n) * H + [beta * KL(pi || pi_ref)] + [vf_coef * L_V]

with `ratio = exp(logprobs - old_logprobs)`, the policy loss `L_pg` named by `policy_loss`
(`jax_ppo.ppo.policy_losses`: PPO's clipped surrogate, GSPO or CISPO), the entropy bonus
`H` at the scheduled coefficient `c_H(n)`, the KL to the reference as a loss term when it does
not enter the reward (GRPO style, `kl_loss_estimator`), and the clipped value loss when a critic
trains in the same program (`core.ppo_value_loss`). Every term is reduced over the microbatch's
tokens by `loss_reduction` and scaled by the microbatch's share of its minibatch
(`loss_shares`), so that summing the microbatches' losses and gradients gives the minibatch's
(docs/rlhf_details.md items 12, 13, 18).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_ppo import core
from jax_ppo.ppo.batch import Batch
from jax_ppo.ppo.policy_losses import POLICY_LOSS_FNS
from jax_ppo.ppo.state import TrainState

Array = jax.Array


def coefficients(config: Any, state: TrainState) -> dict[str, Array]:
  """The loss's coefficients at this update: `entropy` (linear from `entropy_coef` to
  `entropy_coef_final` over `total_updates`) and `kl` (the KL controller's `beta`), float32
  scalars read from the state so nothing recompiles."""
  c = config
  progress = jnp.clip(state.step.astype(jnp.float32) / c.total_updates, 0.0, 1.0)
  final = c.entropy_coef if c.entropy_coef_final is None else c.entropy_coef_final
  return {
      "entropy": c.entropy_coef + (final - c.entropy_coef) * progress,
      "kl": state.kl.coef,
  }


def trains_entropy(config: Any) -> bool:
  """Whether the entropy bonus ever has a weight (else it is computed under `stop_gradient`)."""
  return config.entropy_coef > 0 or (config.entropy_coef_final or 0.0) > 0


def micro_loss(config: Any, out: dict[str, Array], mb: Batch, weight: Array | float,
               coefs: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
  """Loss of one microbatch from its model outputs, pre-scaled by its share `weight` of the
  minibatch.

  Args:
    config: the run's `PPOConfig`.
    out: `PolicyForward.outputs` of the microbatch: `logprobs`, `entropy` and, with a critic
      trained here, `values`, each `[b, T]` float32.
    mb: the microbatch (`b` rows of a `Batch`).
    weight: float32 scalar share of the minibatch (`loss_shares`).
    coefs: `coefficients(config, state)`.

  Returns:
    `(loss, metrics)`: the scaled scalar loss and its terms (each scaled by `weight`, so that
    they sum to the minibatch's averages).
  """
  c = config
  mask = mb.response_mask
  logprobs = out["logprobs"]
  pg_loss, pg = POLICY_LOSS_FNS[c.policy_loss](c, logprobs, mb)
  entropy = core.aggregate_loss(out["entropy"], mask, c.loss_reduction)
  loss = pg_loss - coefs["entropy"] * entropy
  metrics = {
      "policy/approxkl_avg": pg["approx_kl"],
      "policy/clipfrac_avg": pg["clipfrac"],
      "policy/dual_clipfrac_avg": pg.get("dual_clipfrac", jnp.zeros((), jnp.float32)),
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
  if "values" in out:  # a critic trained in this program (not on a mesh of its own)
    vf_loss, vf = value_loss(config, out["values"], mb)
    loss = loss + c.vf_coef * vf_loss
    metrics["loss/value_avg"] = vf_loss
    metrics["val/clipfrac_avg"] = vf["clipfrac"]
  metrics["loss/total_avg"] = loss
  return loss * weight, jax.tree.map(lambda m: m * weight, metrics)


def value_loss(config: Any, values: Array, mb: Any) -> tuple[Array, dict[str, Array]]:
  """The clipped value loss of `values [b, T]` against `mb.returns` around `mb.old_values`
  (`core.ppo_value_loss`, `value_clip_eps`, `loss_reduction`); `(loss, {"clipfrac"})`."""
  return core.ppo_value_loss(values, mb.old_values, mb.returns, mb.response_mask,
                             clip_eps=config.value_clip_eps, reduction=config.loss_reduction)


def loss_shares(config: Any, mask_mb: Array) -> Array:
  """`[A, M, T]` masks of A microbatches -> each microbatch's share `[A]` of the minibatch loss.

  Token-mean losses are normalised by the minibatch's token count (not per microbatch,
  item 18); sequence-level reductions by its count of non-empty rows; "token-sum-norm" (a sum
  over the padded `rows x T` slots) by its count of rows, empty or not.
  """
  if config.loss_reduction == "token-mean":
    per_micro = jnp.sum(mask_mb, axis=(1, 2)).astype(jnp.float32)
  elif config.loss_reduction == "token-sum-norm":
    per_micro = jnp.full(mask_mb.shape[:1], float(mask_mb.shape[1]), jnp.float32)
  else:
    per_micro = jnp.sum(jnp.any(mask_mb, axis=2), axis=1).astype(jnp.float32)
  total = jnp.sum(per_micro)
  return per_micro / jnp.where(total > 0, total, 1.0)


__all__ = ["coefficients", "loss_shares", "micro_loss", "trains_entropy", "value_loss"]
