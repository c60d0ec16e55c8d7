"""`Batch`, one rollout ready for training, its view of a rollout (`batch_view`), and the
post-processing of reward scores (`process_scores`).

Every PPO program reads a `Batch`: the experience programs build it from a rollout
(`jax_ppo.ppo.experience`), the updates train on it (`jax_ppo.ppo.update`), the placed programs
(`jax_ppo.ppo.placed_steps`, `jax_ppo.ppo.placed_critic`) send parts of it to other meshes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jax_ppo import core
from jax_ppo.ppo.config import PPOConfig
from jax_ppo.rollout.sampler import Rollout

Array = jax.Array


class Batch(struct.PyTreeNode):
  """One rollout batch ready for training (`B` rows, `S` prompt and `T` response slots).

  Attributes:
    input_ids: `[B, S + T]` prompt then response ids.
    attention_mask: `[B, S + T]` int32.
    positions: `[B, S + T]` int32 position ids.
    response_ids: `[B, T]`.
    response_mask: `[B, T]` bool.
    old_logprobs: `[B, T]` behaviour log-probs (teacher-forced at rollout time).
    ref_logprobs: `[B, T]` reference log-probs.
    old_values: `[B, T]` critic values at rollout time (0 without a critic).
    advantages: `[B, T]` (whitened where configured).
    returns: `[B, T]` critic targets (0 without a critic).
  """

  input_ids: Array
  attention_mask: Array
  positions: Array
  response_ids: Array
  response_mask: Array
  old_logprobs: Array
  ref_logprobs: Array
  old_values: Array
  advantages: Array
  returns: Array


def batch_view(rollout: Rollout) -> Batch:
  """The rollout as a `Batch` whose per-token training quantities are still placeholders:
  `old_logprobs` and `ref_logprobs` are the sampler's log-probs, `old_values`, `advantages` and
  `returns` zeros `[B, T]` float32 (what a forward pass reads: ids, masks, positions)."""
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


def process_scores(config: PPOConfig, raw_scores: Array, rollout: Rollout) -> Array:
  """Reward-model scores -> training scores `[B]` (items 7 and 16).

  `clip((raw - shift) * scale, ±reward_clip) - length_penalty * length`, plus DAPO's overlong
  shaping (`core.overlong_penalty`, when `overlong_cache_length` is set), then the missing-EOS
  penalty replaces the score of responses without a stop token.
  """
  s = (jnp.asarray(raw_scores, jnp.float32) - config.reward_shift) * config.reward_scale
  if config.reward_clip is not None:
    s = jnp.clip(s, -config.reward_clip, config.reward_clip)
  s = s - config.length_penalty * rollout.response_lengths.astype(jnp.float32)
  if config.overlong_cache_length is not None:
    s = s + core.overlong_penalty(
        rollout.response_lengths, max_length=config.sampling.max_new_tokens,
        cache_length=config.overlong_cache_length, penalty=config.overlong_penalty)
  if config.missing_eos_penalty is not None and config.sampling.stop_token_ids:
    s = jnp.where(rollout.has_stop, s, config.missing_eos_penalty)
  return s


__all__ = ["Batch", "batch_view", "process_scores"]
