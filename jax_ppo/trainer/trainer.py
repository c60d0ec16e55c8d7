"""The RLHF loop: rollout -> scoring -> experience -> PPO epochs, one update at a time.

`PPOTrainer` owns the host-side orchestration only: prompt batches, the sampler, the reward
source, timing and metrics. All math runs in the compiled `PPOSteps` functions over the
immutable `TrainState`. One trainer serves every advantage mode ("gae" with a critic, "grpo",
"rloo", "reinforce++").
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ppo.data.prompts import PromptDataset
from jax_ppo.models.heads import ScalarModel
from jax_ppo.models.lora import has_lora
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Rollout, Sampler, teacher_forced_logprobs
from jax_ppo.trainer import perf
from jax_ppo.trainer.config import PPOConfig
from jax_ppo.trainer.rewards import (
    FunctionScorer,
    RewardModelScorer,
    TokenScorer,
    decode_rollout,
)
from jax_ppo.trainer.state import FrozenParams, TrainState
from jax_ppo.trainer.step import Batch, PPOSteps, init_train_state, make_optimizer


def _as_scorer(reward, tokenizer):
  if isinstance(reward, ScalarModel):
    return RewardModelScorer(reward, policy_tokenizer=tokenizer)
  if isinstance(reward, nnx.Module):
    raise ValueError(
        f"`reward` is a {type(reward).__name__}; pass a ScalarModel reward model, a scorer, or "
        "a function fn(prompts, responses) -> scores."
    )
  if isinstance(reward, (FunctionScorer, TokenScorer, RewardModelScorer)):
    return reward
  if callable(reward):
    return FunctionScorer(reward, tokenizer=tokenizer)
  raise ValueError(f"`reward` must be a reward model, a scorer or a function, got {reward!r}.")


def _to_host(metrics: dict[str, Any]) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


class PPOTrainer:
  """PPO / GRPO / RLOO / REINFORCE++ for a causal LM.

  Args:
    config: the run's `PPOConfig`.
    policy: a `jax_ppo.models.CausalLM` (with LoRA adapters from `add_lora` for LoRA training).
    reward: a `ScalarModel` reward model, a scorer from `jax_ppo.trainer.rewards`, or a Python
      function `fn(prompts, responses) -> scores` (texts when `tokenizer` is given, else ids).
    prompts: a `PromptDataset` of token-id prompts.
    tokenizer: the policy's tokenizer (for text rewards and sample logging).
    value_model: a separate critic (`ScalarModel`, e.g. `value_model_from_reward_model(rm)`);
      without one, "gae" puts a zero-initialised value head on the policy trunk.
    memory_budget_bytes: rollout micro-batching budget (see `Sampler`).
    peak_flops: matmul peak for the `mfu` metric; measured at start-up when None.
  """

  def __init__(
      self,
      config: PPOConfig,
      policy: nnx.Module,
      *,
      reward,
      prompts: PromptDataset,
      tokenizer=None,
      value_model: ScalarModel | None = None,
      memory_budget_bytes: int | None = None,
      peak_flops: float | None = None,
  ):
    self.config = c = config
    self.dataset = prompts
    self.tokenizer = tokenizer
    self.scorer = _as_scorer(reward, tokenizer)
    self.lora = has_lora(policy)

    shared_value_head = c.uses_critic and value_model is None
    if shared_value_head and policy.value_head is None:
      policy.add_value_head()
    if self.lora:
      trainable = nnx.Any(nnx.LoRAParam, nnx.PathContains("value_head"))
    else:
      trainable = nnx.Param
    self.policy_graphdef, policy_params, policy_rest = nnx.split(policy, trainable, ...)
    value_graphdef = value_params = value_rest = None
    if c.uses_critic and value_model is not None:
      value_graphdef, value_params, value_rest = nnx.split(value_model, nnx.Param, ...)
    ref = None if self.lora else jax.tree.map(jnp.copy, policy_params)
    self.frozen = FrozenParams(
        policy_rest=policy_rest,
        ref=ref,
        value_rest=value_rest,
        reward=getattr(self.scorer, "state", None),
    )
    self.optimizer, self.schedule = make_optimizer(c)
    self.steps = PPOSteps(
        c,
        policy_graphdef=self.policy_graphdef,
        value_graphdef=value_graphdef,
        shared_value_head=shared_value_head,
        lora=self.lora,
        optimizer=self.optimizer,
        schedule=self.schedule,
    )
    self.state: TrainState = init_train_state(
        c, self.optimizer, policy=policy_params, value=value_params,
        rng=jax.random.PRNGKey(c.seed),
    )
    self.sampling = SamplingConfig(
        max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_k=c.top_k,
        top_p=c.top_p, stop_token_ids=tuple(c.stop_token_ids), pad_token_id=c.pad_token_id,
        n_samples=c.n_samples, batch_buckets=(c.prompts_per_update,),
    )
    self.sampler = Sampler(policy, self.sampling, memory_budget_bytes=memory_budget_bytes)
    self._rollout_key = jax.random.PRNGKey(c.seed + 1)
    self.replay: collections.deque[Batch] = collections.deque(maxlen=c.replay_buffer_size or 1)
    self._replay_rng = np.random.default_rng(c.seed + 2)
    self.data_position = 0
    self.peak_flops = peak_flops
    self._param_counts = (
        perf.count_params(policy_params) + perf.count_params(policy_rest),
        perf.count_params(value_params) if value_params is not None else 0,
        perf.count_params(self.frozen.reward) if self.frozen.reward is not None else 0,
    )
    self._eval_logprobs = jax.jit(self._eval_logprobs_impl)
    self.last_rollout: Rollout | None = None
    self.last_scores: np.ndarray | None = None
    self.last_prompt_texts: list[str] | None = None

  # -- one update ----------------------------------------------------------------------------

  @property
  def step_count(self) -> int:
    return int(self.state.step)

  def policy_state(self, state: TrainState | None = None) -> tuple:
    """The sampler's view of the policy: `(trainable, frozen rest)`."""
    state = self.state if state is None else state
    return (state.policy, self.frozen.policy_rest)

  def step(self) -> dict[str, float]:
    """Runs one PPO update (rollout, scoring, experience, epochs) and returns its metrics."""
    c = self.config
    t_start = time.perf_counter()
    prompt_ids, texts = self.dataset.batch(self.data_position, c.prompts_per_update)
    key = jax.random.fold_in(self._rollout_key, self.step_count)
    rollout = self.sampler(prompt_ids, key, state=self.policy_state())
    jax.block_until_ready(rollout.response_ids)
    t_rollout = time.perf_counter()

    raw_scores = self.scorer(rollout, self.frozen.reward)
    jax.block_until_ready(raw_scores)
    t_score = time.perf_counter()

    batch, exp_metrics = self.steps.experience(self.state, self.frozen, rollout, raw_scores)
    self.state, upd_metrics = self.steps.update(
        self.state, self.frozen, batch, exp_metrics["objective/kl"]
    )
    if c.replay_buffer_size:
      if c.replay_batches_per_update and len(self.replay) > 0:
        picks = self._replay_rng.integers(0, len(self.replay), c.replay_batches_per_update)
        for j in picks:
          self.state, _ = self.steps.replay_update(
              self.state, self.frozen, self.replay[int(j)], jnp.zeros((), jnp.float32)
          )
      self.replay.append(batch)
    metrics = _to_host({**exp_metrics, **upd_metrics})
    t_end = time.perf_counter()
    self.data_position += 1

    prompt_len = int(rollout.prompt_ids.shape[1])
    tokens = c.batch_size * (prompt_len + c.max_new_tokens)
    flops = perf.update_flops(
        policy_params=self._param_counts[0], critic_params=self._param_counts[1],
        reward_params=self._param_counts[2], batch=c.batch_size, prompt_len=prompt_len,
        response_len=c.max_new_tokens, epochs=c.ppo_epochs,
    )
    total = t_end - t_start
    metrics.update({
        "time/rollout_s": t_rollout - t_start,
        "time/score_s": t_score - t_rollout,
        "time/update_s": t_end - t_score,
        "time/total_s": total,
        "tokens_per_s": tokens / total,
        "eps": c.batch_size / total,
        "episode": float(self.state.episode),
        "step": float(self.step_count),
        "rollout/prompt_len": float(prompt_len),
    })
    if self.peak_flops:
      metrics["mfu"] = flops / total / self.peak_flops
    self.last_rollout = rollout
    self.last_scores = np.asarray(raw_scores)
    self.last_prompt_texts = texts
    return metrics

  def train(
      self, num_updates: int | None = None, *, callback: Callable[[dict], Any] | None = None
  ) -> list[dict[str, float]]:
    """Runs `num_updates` updates (default: up to `config.total_updates`)."""
    if self.peak_flops is None:
      self.peak_flops = perf.measure_matmul_peak()
    remaining = self.config.total_updates - self.step_count
    n = remaining if num_updates is None else min(num_updates, remaining)
    history = []
    for _ in range(n):
      metrics = self.step()
      history.append(metrics)
      if callback is not None:
        callback(metrics)
    return history

  # -- samples and evaluation ----------------------------------------------------------------

  def samples(self, *, stage: str = "train", limit: int = 4) -> list[dict[str, Any]]:
    """`{stage, step, prompt, response, reward}` records of the last rollout."""
    if self.last_rollout is None:
      return []
    r = jax.tree.map(lambda x: x[:limit], self.last_rollout)
    if self.tokenizer is not None:
      prompts, responses = decode_rollout(self.tokenizer, r)
    else:
      prompts = [np.asarray(p)[np.asarray(m) != 0].tolist()
                 for p, m in zip(r.prompt_ids, r.prompt_mask, strict=True)]
      responses = [np.asarray(p)[np.asarray(m)].tolist()
                   for p, m in zip(r.response_ids, r.response_mask, strict=True)]
    return [
        {"stage": stage, "step": self.step_count, "prompt": p, "response": q,
         "reward": float(s)}
        for p, q, s in zip(prompts, responses, self.last_scores[:limit], strict=True)
    ]

  def evaluate(
      self, prompts: list[list[int]], *, temperature: float | None = None, seed: int = 0
  ) -> dict[str, float]:
    """Samples held-out prompts greedily (or at `temperature`) and scores them (item 20).

    Returns `eval/score_mean`, `eval/score_std`, `eval/response_length`, `eval/kl` (sum over
    tokens of log pi - log pi_ref, mean over responses) and `eval/entropy` (mean negative
    log-prob per token).
    """
    greedy = temperature is None
    sampling = SamplingConfig(
        max_new_tokens=self.config.max_new_tokens,
        temperature=1.0 if greedy else temperature,
        greedy=greedy,
        stop_token_ids=tuple(self.config.stop_token_ids),
        pad_token_id=self.config.pad_token_id,
    )
    sampler = Sampler(self.policy_model(), sampling)
    rollout = sampler(prompts, jax.random.PRNGKey(seed), state=self.policy_state())
    scores = np.asarray(self.scorer(rollout, self.frozen.reward))
    logprobs, ref_logprobs = jax.device_get(
        self._eval_logprobs(self.state.policy, self.frozen, rollout)
    )
    mask = np.asarray(rollout.response_mask)
    return {
        "eval/score_mean": float(scores.mean()),
        "eval/score_std": float(scores.std()),
        "eval/response_length": float(mask.sum(1).mean()),
        "eval/kl": float(np.sum((logprobs - ref_logprobs) * mask, axis=1).mean()),
        "eval/entropy": float(-np.sum(logprobs * mask) / max(mask.sum(), 1)),
    }

  def _eval_logprobs_impl(self, trainable, frozen: FrozenParams, rollout: Rollout):
    """Policy and reference log-probs `[B, T]` of a rollout at the training temperature."""
    temperature = self.config.temperature
    policy = nnx.merge(self.policy_graphdef, trainable, frozen.policy_rest)
    logprobs = teacher_forced_logprobs(policy, rollout, temperature=temperature)
    if self.lora:
      ref = teacher_forced_logprobs(policy, rollout, temperature=temperature, use_lora=False)
    else:
      ref_model = nnx.merge(self.policy_graphdef, frozen.ref, frozen.policy_rest)
      ref = teacher_forced_logprobs(ref_model, rollout, temperature=temperature)
    return logprobs, ref

  def policy_model(self) -> nnx.Module:
    """The current policy as an NNX module (for export with `save_pretrained`)."""
    return nnx.merge(self.policy_graphdef, *self.policy_state())
