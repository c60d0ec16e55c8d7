"""Tests of jax_ppo.ppo.forward: one teacher-forced log-prob path for training, the reference and
evaluation (the placed evaluation on split meshes: tests/parallel/test_placed_update.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models import LoRAConfig, add_lora
from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOTrainer
from jax_ppo.ppo.batch import batch_view
from jax_ppo.ppo.forward import masked_logprobs, response_logprobs
from jax_ppo.rewards import TokenScorer
from tests.ppo.conftest import CONFIG, MODEL, count_target, prompts


def _trainer(lora: bool) -> PPOTrainer:
  policy = CausalLM(MODEL, rngs=nnx.Rngs(0))
  if lora:
    policy = add_lora(policy, LoRAConfig(rank=4, alpha=8), rngs=nnx.Rngs(1))
  trainer = PPOTrainer(dataclasses.replace(CONFIG, num_minibatches=1), policy,
                       reward=TokenScorer(count_target), prompts=prompts(), peak_flops=1e11)
  if lora:  # adapters away from their zero init, so that the policy is not its reference
    trainer.state = trainer.state.replace(
        policy=jax.tree.map(lambda x: x + 0.1, trainer.state.policy))
  else:  # a reference unlike the policy
    ref = jax.tree.map(lambda x: x * 1.25 + 0.01, trainer.frozen.ref)
    trainer.frozen = trainer.frozen.replace(ref=ref)
  return trainer


@pytest.mark.parametrize("lora", [False, True])
def test_training_and_evaluation_log_probs_agree_to_a_few_ulps(lora):
  trainer = _trainer(lora)
  prompt_ids, _ = trainer.dataset.batch(0, trainer.config.prompts_per_update)
  rollout = trainer.sampler(prompt_ids, jax.random.PRNGKey(0), state=trainer.policy_state())
  mask = np.asarray(rollout.response_mask)
  assert mask.any() and not mask.all()  # padding in the batch
  scores = trainer.scorer(rollout, None)
  # Evaluation's program first: the fused experience_update donates the state.
  policy = jax.tree.map(jnp.copy, trainer.state.policy)
  eval_lp, eval_ref = (np.asarray(x) for x in trainer.eval_logprobs(policy, trainer.frozen,
                                                                    rollout))
  state, batch, _, _ = trainer.steps.experience_update(trainer.state, trainer.frozen, rollout,
                                                       scores)
  del state
  # The same function in two compiled programs: XLA may fuse (and so round) each program its own
  # way, so a few values differ in their last bit (2.4e-7 at -3.19 on some CPUs): a few ulps.
  np.testing.assert_allclose(eval_lp, np.asarray(batch.old_logprobs), rtol=5e-7, atol=0)
  np.testing.assert_allclose(eval_ref, np.asarray(batch.ref_logprobs), rtol=5e-7, atol=0)
  assert np.all(eval_lp[~mask] == 0.0) and np.all(eval_ref[~mask] == 0.0)
  assert np.abs(eval_lp - eval_ref)[mask].max() > 1e-4  # not trivially equal
  # The temperature is the config's: another one gives other numbers.
  model = nnx.merge(trainer.policy_graphdef, policy, trainer.frozen.policy_rest)
  hot = jax.jit(lambda r: masked_logprobs(model, batch_view(r), temperature=2.0))(rollout)
  assert np.abs(np.asarray(hot) - eval_lp)[mask].min() > 0


def test_response_logprobs_chunked_equals_whole_and_values_come_from_the_same_pass():
  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  model.add_value_head()
  trainer = _trainer(False)
  prompt_ids, _ = trainer.dataset.batch(0, trainer.config.prompts_per_update)
  rollout = trainer.sampler(prompt_ids, jax.random.PRNGKey(1), state=trainer.policy_state())
  seq = batch_view(rollout)
  whole = response_logprobs(model, seq, temperature=0.7, entropy="no_grad", values=True,
                            chunk_bytes=None)
  chunked = response_logprobs(model, seq, temperature=0.7, entropy="no_grad", values=True,
                              chunk_bytes=2 * 8 * MODEL.vocab_size * 4)
  for a, b in zip(whole, chunked, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  b, t = rollout.response_ids.shape
  assert whole.values.shape == whole.entropy.shape == whole.logprobs.shape == (b, t)
  assert response_logprobs(model, seq, temperature=0.7).entropy is None


def test_masked_logprobs_equal_a_full_forward_pass_and_its_logits():
  # The reference: the model's full logits over prompt + response (left-padded prompts, a row
  # that stopped early), the positions S - 1 ... S + T - 2 that predict the response tokens,
  # `gather_logprobs` at the temperature, 0 on padding; whole and chunked.
  from jax_ppo import core

  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  trainer = _trainer(False)
  prompt_ids, _ = trainer.dataset.batch(0, trainer.config.prompts_per_update)
  rollout = trainer.sampler(prompt_ids, jax.random.PRNGKey(2), state=trainer.policy_state())
  seq = batch_view(rollout)
  mask = np.asarray(seq.response_mask)
  assert mask.any() and not mask.all() and not np.asarray(rollout.prompt_mask).all()
  s, t = rollout.prompt_ids.shape[1], rollout.response_ids.shape[1]
  logits = model(rollout.sequence_ids, rollout.attention_mask, positions=rollout.positions)
  want = np.where(mask, core.gather_logprobs(logits[:, s - 1:s + t - 1], seq.response_ids, 0.7),
                  0.0)
  for chunk_bytes in (None, 2 * 8 * MODEL.vocab_size * 4):
    got = masked_logprobs(model, seq, temperature=0.7, chunk_bytes=chunk_bytes)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
