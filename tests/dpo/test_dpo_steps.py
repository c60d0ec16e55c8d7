"""`DPOSteps`: the step's loss is `dpo_loss` of sequence log-probs computed independently in
NumPy (logits -> log-softmax -> gather -> masked sum); at step 0 the policy is the reference
(sigmoid loss log 2, rewards 0); the evaluation sums are per-pair means; gradient accumulation
equals the whole batch's step."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from jax_ppo.core import dpo_loss
from jax_ppo.dpo import DPOConfig, DPOOptimizer, DPOSteps, dpo_pairs
from jax_ppo.dpo.steps import split_trainable
from jax_ppo.models import CausalLM
from jax_ppo.models.config import ModelConfig
from jax_ppo.training.optim import make_optimizer
from jax_ppo.training.state import init_stage_state

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

MODEL = ModelConfig(
    model_type="llama", vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=48,
)


def pairs(n=4, seed=0):
  rng = np.random.default_rng(seed)
  ids = lambda lo, hi: [int(t) for t in rng.integers(3, 24, size=int(rng.integers(lo, hi)))]  # noqa: E731
  chosen, rejected = [], []
  for _ in range(n):
    prompt = ids(1, 5)
    chosen.append((prompt, ids(1, 6)))
    rejected.append((prompt, ids(1, 6)))
  return dpo_pairs(chosen, rejected, pad_token_id=0)


def build(config, model=None):
  model = model if model is not None else CausalLM(MODEL, rngs=nnx.Rngs(0))
  graphdef, params, rest = split_trainable(model, scan_layers=None)
  optimizer, schedule = make_optimizer(config.optimizer, 10)
  steps = DPOSteps(config, graphdef=graphdef, lora=False, optimizer=optimizer, schedule=schedule)
  return steps, init_stage_state(optimizer, params), rest, model


def numpy_seq_logps(model, ids, mask, response):
  """Sum over response tokens of log_softmax(logits)[next token], in float64 NumPy."""
  logits = np.asarray(model(ids, mask), np.float64)  # [B, S, V]
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  out = np.zeros(ids.shape[0])
  for b in range(ids.shape[0]):
    for t in range(1, ids.shape[1]):
      if response[b, t]:
        out[b] += logp[b, t - 1, ids[b, t]]
  return out


def test_loss_is_dpo_loss_of_independent_numpy_logprobs():
  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  # A reference that differs from the policy, so the margins are not 0.
  ref_model = CausalLM(MODEL, rngs=nnx.Rngs(7))
  _, ref, _ = split_trainable(ref_model, scan_layers=None)
  p = pairs()
  logps = [numpy_seq_logps(m, getattr(p, f"{side}_ids"), getattr(p, f"{side}_mask"),
                           getattr(p, f"{side}_response"))
           for m in (model, ref_model) for side in ("chosen", "rejected")]
  for loss_type, smoothing in (("sigmoid", 0.2), ("ipo", 0.0)):
    config = DPOConfig(beta=0.5, loss_type=loss_type, label_smoothing=smoothing, batch_size=4)
    steps, state, rest, _ = build(config, model)
    loss, metrics = jax.jit(steps.loss)(state.params, rest, ref, p)
    want, want_metrics = dpo_loss(*(np.float32(x) for x in logps), beta=0.5,
                                  loss_type=loss_type, label_smoothing=smoothing)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                "logps/rejected"):
      np.testing.assert_allclose(float(metrics[key]), float(want_metrics[key]), rtol=1e-5,
                                 atol=1e-5, err_msg=key)
    assert abs(float(metrics["rewards/margins"])) > 1e-3  # a real margin was compared


def test_padding_and_prompt_tokens_do_not_count():
  steps, state, rest, model = build(DPOConfig(batch_size=1))
  p = dpo_pairs([([5, 6], [7, 8])], [([5, 6], [9])], pad_token_id=0)
  longer = dpo_pairs([([5, 6], [7, 8])], [([5, 6], [9, 10, 11, 12, 13])], pad_token_id=0)
  pi, _ = steps.logps(state.params, rest, state.params, p)
  pi_long, _ = steps.logps(state.params, rest, state.params, longer)
  assert p.chosen_ids.shape[1] < longer.chosen_ids.shape[1]
  np.testing.assert_allclose(pi[0, 0], pi_long[0, 0], rtol=1e-6)  # more padding, same log-prob
  np.testing.assert_array_equal(p.chosen_response[0], [0, 0, 1, 1])
  np.testing.assert_array_equal(p.rejected_response[0], [0, 0, 1, 0])


def test_at_step_zero_the_policy_is_the_reference():
  config = DPOConfig(batch_size=4, optimizer=DPOOptimizer(learning_rate=1e-2))
  steps, state, rest, _ = build(config)
  ref = jax.tree.map(np.array, state.params)
  state, metrics = steps.train_step(state, rest, ref, pairs())
  assert metrics["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
  for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
    assert float(metrics[key]) == pytest.approx(0.0, abs=1e-6), key
  assert float(metrics["logps/chosen"]) < 0 and float(metrics["train/grad_norm"]) > 0
  _, metrics = steps.train_step(state, rest, ref, pairs())
  assert float(metrics["rewards/margins"]) > 0  # the first step moved towards the chosen


def test_accumulation_equals_the_whole_batch_and_eval_sums_are_per_pair_means():
  one = DPOConfig(batch_size=4, optimizer=DPOOptimizer(learning_rate=1e-2))
  two = DPOConfig(batch_size=4, gradient_accumulation_steps=2,
                  optimizer=DPOOptimizer(learning_rate=1e-2))
  steps1, state1, rest, _ = build(one)
  steps2, state2, _, _ = build(two)
  ref = jax.tree.map(np.array, state1.params)
  p = pairs()
  for _ in range(2):
    state1, m1 = steps1.train_step(state1, rest, ref, p)
    state2, m2 = steps2.train_step(state2, rest, ref, p)
  for key in m1:
    np.testing.assert_allclose(float(m2[key]), float(m1[key]), rtol=1e-4, atol=1e-6,
                               err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               state1.params, state2.params)
  # Evaluation: weighted sums of per-pair values; the means over real pairs are the batch's.
  sums = steps1.eval_sums(state1.params, rest, ref, p, np.ones(4, np.float32))
  loss_fn = jax.jit(steps1.loss)
  loss, metrics = loss_fn(state1.params, rest, ref, p)
  assert float(sums["pairs"]) == 4
  np.testing.assert_allclose(float(sums["loss"]) / 4, float(loss), rtol=1e-5)
  np.testing.assert_allclose(float(sums["rewards/margins"]) / 4, float(metrics["rewards/margins"]),
                             rtol=1e-5, atol=1e-7)
  half = steps1.eval_sums(state1.params, rest, ref, p, np.array([1, 1, 0, 0], np.float32))
  loss2, _ = loss_fn(state1.params, rest, ref, p.take(np.arange(2)))
  np.testing.assert_allclose(float(half["loss"]) / 2, float(loss2), rtol=1e-5)
