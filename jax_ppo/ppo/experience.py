"""A rollout -> the training `Batch`: log-probs, KL, rewards, values and advantages.

    scores   = process_scores(raw_scores)                     (items 7, 16)
    kl_t     = kl(old_logprobs_t, ref_logprobs_t)             (0 on padding; `kl_estimator`)
    r_t      = score at the last token - beta * kl_t          (beta 0 when the KL is a loss term)
    A, R     = ADVANTAGE_FNS[advantage_mode](r, score - beta * sum_t kl_t, V, mask)

`make_batch` is the pure function the experience programs (`jax_ppo.ppo.steps`) call once the
behaviour policy's outputs (teacher-forced with the training numerics, item 4) and the
reference's log-probs are known; it also returns the rollout's metrics.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_ppo import core
from jax_ppo.ppo.advantages import ADVANTAGE_FNS, AdvantageInputs
from jax_ppo.ppo.batch import Batch, process_scores
from jax_ppo.ppo.state import TrainState
from jax_ppo.rollout.sampler import Rollout

Array = jax.Array


def make_batch(
    config: Any,
    state: TrainState,
    rollout: Rollout,
    raw_scores: Array,
    view: Batch,
    behaviour: dict[str, Array],
    ref_logprobs: Array,
    values: Array | None = None,
) -> tuple[Batch, dict[str, Array]]:
  """The training batch and its metrics.

  Args:
    config: the run's `PPOConfig`.
    state: the `TrainState` (its KL coefficient `state.kl.coef` is read).
    rollout: the rollout (`B` rows, `T` response slots).
    raw_scores: `[B]` scores of the reward source.
    view: `batch_view(rollout)`.
    behaviour: the behaviour policy's `PolicyForward.outputs` on `view`: `logprobs [B, T]` and,
      with a critic in the same program, `values [B, T]`.
    ref_logprobs: `[B, T]` reference log-probs (masked here again).
    values: `[B, T]` critic values computed elsewhere (a critic on its own mesh), else None:
      `behaviour["values"]`.

  Returns:
    `(batch, metrics)`: `view` with its old log-probs, reference log-probs, old values,
    advantages and returns filled in (0 on padding), and the rollout's scalar metrics.
  """
  c = config
  mask = rollout.response_mask
  scores = process_scores(c, raw_scores, rollout)
  old_logprobs = jnp.where(mask, behaviour["logprobs"], 0.0)  # item 9: padding: ratio 1, KL 0
  ref_logprobs = jnp.where(mask, ref_logprobs, 0.0)

  kl = jnp.where(mask, core.kl_penalty(old_logprobs, ref_logprobs, estimator=c.kl_estimator), 0.0)
  beta = state.kl.coef
  beta_in_reward = beta if c.kl_enters_reward else jnp.zeros_like(beta)
  rewards = core.shape_rewards(scores, kl, mask, kl_coef=beta_in_reward)
  seq_kl = jnp.sum(kl, axis=1)

  critic_values = behaviour.get("values") if values is None else values
  if c.uses_critic:
    values = jnp.where(mask, critic_values, 0.0)
  else:
    values = jnp.zeros(mask.shape, jnp.float32)
  inputs = AdvantageInputs(rewards=rewards, seq_rewards=scores - beta_in_reward * seq_kl,
                           values=values, mask=mask)
  advantages, returns = ADVANTAGE_FNS[c.advantage_mode](inputs, c)
  # Rollout correction: the sampler drew the tokens, the trainer's old log-probs are the
  # behaviour policy; the loss of each token is weighted by their ratio, through its advantage
  # (every policy loss is linear in A with a non-negative weight).
  mismatch = jnp.where(mask, old_logprobs - rollout.logprobs, 0.0)
  correction_metrics = {
      # KL(sampler || trainer) per token, k3 estimate on the sampler's own tokens.
      "rollout_correction/kl": core.masked_mean(jnp.expm1(mismatch) - mismatch, mask),
  }
  if c.rollout_correction_level is not None:
    weights = core.rollout_correction_weights(
        old_logprobs, rollout.logprobs, mask, cap=c.rollout_correction_cap,
        level=c.rollout_correction_level, mode=c.rollout_correction_mode)
    advantages = advantages * weights
    if c.rollout_correction_mode == "mask":
      correction_metrics["rollout_correction/masked_frac"] = core.masked_mean(weights == 0, mask)
    else:
      uncapped = core.rollout_correction_weights(
          old_logprobs, rollout.logprobs, mask, cap=float("inf"),
          level=c.rollout_correction_level)
      correction_metrics["rollout_correction/truncated_frac"] = core.masked_mean(
          weights < uncapped, mask)
    correction_metrics["rollout_correction/weight_mean"] = core.masked_mean(weights, mask)

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
      **correction_metrics,
  }
  if c.uses_critic:
    metrics["val/explained_variance"] = core.explained_variance(values, returns, mask)
    metrics["val/mean"] = core.masked_mean(values, mask)
  return batch, metrics


__all__ = ["make_batch"]
