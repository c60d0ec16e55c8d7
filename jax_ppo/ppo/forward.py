"""The models' forward passes at the response positions, and the one teacher-forced log-prob path.

Position `s + i - 1` of a `[B, S + T]` sequence (prompt slots `S`, response slots `T`) predicts
response token `i`. `response_logprobs` runs the policy (or its reference) over the whole
sequence, keeps the hidden states `[B, T, D]` at those positions and scores the response tokens
with the LM head at a given temperature, chunked over `T` when the float32 logits would exceed
`chunk_bytes` (`jax_ppo.models.logprobs.head_logprobs`). It is the only place log-probs
of a response are computed for PPO: the behaviour (old) and new log-probs and the entropy of
training, the reference log-probs (in the experience program or on the reference's own mesh),
and evaluation (`PPOTrainer.evaluate`, `jax-ppo eval`, the placed evaluation), so that all of
them are the same numbers for the same parameters and rollout (docs/rlhf_details.md items 3, 4).
The temperature is always an argument (the run's `PPOConfig.sampling.temperature`).

`PolicyForward` binds the static parts (graph definitions, LoRA, the critic's kind) and gives
the quantities the loss reads (`outputs`), the critic's values and the reference log-probs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ppo.models.logprobs import LOGITS_CHUNK_BYTES, head_logprobs
from jax_ppo.ppo.batch import Batch, batch_view
from jax_ppo.ppo.state import FrozenParams
from jax_ppo.rollout.sampler import Rollout

Array = jax.Array


class ResponseOutputs(NamedTuple):
  """What one forward pass gives per response token (`[B, T]` float32 each).

  Attributes:
    logprobs: log-probs of the response tokens at the temperature (not masked: padding holds
      whatever the model gives there).
    entropy: the policy's entropy at the temperature, or None when not asked for.
    values: a value head's predictions from the same hidden states, or None.
  """

  logprobs: Array
  entropy: Array | None
  values: Array | None


def response_hidden(model, seq: Batch, *, use_lora: bool = True) -> Array:
  """Hidden states `[B, T, D]` at the positions that predict each response token.

  Args:
    model: a `CausalLM` (or anything with its `hidden_states`).
    seq: a `Batch` (its `input_ids [B, S + T]`, `attention_mask`, `positions` and
      `response_ids [B, T]` are read; `batch_view(rollout)` for a rollout).
    use_lora: False runs a LoRA policy with its adapters off (its reference).
  """
  t = seq.response_ids.shape[1]
  s = seq.input_ids.shape[1] - t
  h = model.hidden_states(seq.input_ids, seq.attention_mask, positions=seq.positions,
                          use_lora=use_lora)
  return h[:, s - 1 : s + t - 1]  # position s + i - 1 predicts response token i


def response_logprobs(
    model,
    seq: Batch,
    *,
    temperature: float | Array,
    use_lora: bool = True,
    entropy: str | None = None,
    values: bool = False,
    chunk_bytes: int | None = LOGITS_CHUNK_BYTES,
) -> ResponseOutputs:
  """Teacher-forced log-probs `log softmax(logits / temperature)[token]` of the response tokens.

  Args:
    model: a `CausalLM`.
    seq: a `Batch` (see `response_hidden`).
    temperature: the sampling temperature (a float or a float32 scalar).
    use_lora: False: a LoRA policy's base weights (the adapters off).
    entropy: "grad", "no_grad" (under `stop_gradient`) or None (not computed).
    values: also the model's value head on the same hidden states (a value head on the policy
      trunk).
    chunk_bytes: float32 logits above this many bytes are computed in chunks over `T`; None
      never chunks. The numbers are the same either way.

  Returns:
    `ResponseOutputs` `[B, T]` float32, not masked.
  """
  h = response_hidden(model, seq, use_lora=use_lora)
  logprobs, ent = head_logprobs(model, h, seq.response_ids, temperature, entropy=entropy,
                                chunk_bytes=chunk_bytes)
  return ResponseOutputs(logprobs, ent, model.values_from_hidden(h) if values else None)


def masked_logprobs(model, seq: Batch, *, temperature: float | Array, use_lora: bool = True,
                    chunk_bytes: int | None = LOGITS_CHUNK_BYTES) -> Array:
  """`response_logprobs(...).logprobs` with 0 on padding (`seq.response_mask` False), `[B, T]`
  float32: the reference's and the evaluation's log-probs."""
  out = response_logprobs(model, seq, temperature=temperature, use_lora=use_lora,
                          chunk_bytes=chunk_bytes)
  return jnp.where(seq.response_mask, out.logprobs, 0.0)


@dataclasses.dataclass(frozen=True)
class PolicyForward:
  """The static parts of a run's models and their forward passes.

  Attributes:
    policy_graphdef: the policy's graph definition (`nnx.split(policy, trainable, ...)`).
    value_graphdef: a separate critic's (`ScalarModel`), or None.
    shared_value_head: the critic is a value head on the policy trunk.
    lora: the policy trains LoRA adapters; its reference is the base with the adapters off.
    temperature: the sampling temperature of every log-prob.
  """

  policy_graphdef: Any
  value_graphdef: Any
  shared_value_head: bool
  lora: bool
  temperature: float

  def policy(self, trainable, rest) -> nnx.Module:
    """The policy module of `trainable` variables and the `rest`."""
    return nnx.merge(self.policy_graphdef, trainable, rest)

  def outputs(self, params, frozen: FrozenParams, mb: Batch, *, train_entropy: bool,
              critic: bool, chunk_bytes: int | None) -> dict[str, Array]:
    """Everything the loss reads from the models, per response token (`[B, T]` float32).

    `logprobs` of the response tokens, the policy's `entropy` (under `stop_gradient` unless
    `train_entropy`, so no backward pass runs through it) and, with `critic`, the critic's
    `values`. The loss depends on `params` (`{"policy", "value"}`) only through these, which is
    what lets the fused first epoch differentiate it with `jax.vjp`.
    """
    policy = self.policy(params["policy"], frozen.policy_rest)
    out = response_logprobs(policy, mb, temperature=self.temperature,
                            entropy="grad" if train_entropy else "no_grad",
                            values=critic and self.shared_value_head, chunk_bytes=chunk_bytes)
    result = {"logprobs": out.logprobs, "entropy": out.entropy}
    if critic:
      result["values"] = (out.values if self.shared_value_head else
                          self.critic_values(params["value"], frozen.value_rest, mb))
    return result

  def critic_values(self, value, value_rest, seq: Batch) -> Array:
    """A separate critic's values `[B, T]` float32 at the positions that predict each token."""
    critic = nnx.merge(self.value_graphdef, value, value_rest)
    t = seq.response_ids.shape[1]
    s = seq.input_ids.shape[1] - t
    v = critic(seq.input_ids, seq.attention_mask, positions=seq.positions)
    return v[:, s - 1 : s + t - 1]

  def reference_logprobs(self, policy, frozen: FrozenParams, seq: Batch, *,
                         chunk_bytes: int | None = LOGITS_CHUNK_BYTES) -> Array:
    """Reference log-probs `[B, T]` float32 (0 on padding): the base weights with the adapters
    off for a LoRA policy (`policy`: its trainable variables), else `frozen.ref` (`policy`
    unused)."""
    if self.lora:
      return masked_logprobs(self.policy(policy, frozen.policy_rest), seq,
                             temperature=self.temperature, use_lora=False,
                             chunk_bytes=chunk_bytes)
    return masked_logprobs(self.policy(frozen.ref, frozen.policy_rest), seq,
                           temperature=self.temperature, chunk_bytes=chunk_bytes)

  def eval_logprobs(self, trainable, frozen: FrozenParams,
                    rollout: Rollout) -> tuple[Array, Array]:
    """Policy and reference log-probs `[B, T]` float32 (0 on padding) of an evaluation rollout,
    with the default chunking (`PPOTrainer.evaluate`)."""
    seq = batch_view(rollout)
    logprobs = masked_logprobs(self.policy(trainable, frozen.policy_rest), seq,
                               temperature=self.temperature)
    return logprobs, self.reference_logprobs(trainable, frozen, seq)


__all__ = ["PolicyForward", "ResponseOutputs", "masked_logprobs", "response_hidden",
           "response_logprobs"]
