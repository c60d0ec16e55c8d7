"""The chunked log-prob path (`rollout.token_logprobs`) is what the sampler's teacher-forced pass
and the PPO step use above the logits budget, with the numbers of the unchunked path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOTrainer
from jax_ppo.rewards import TokenScorer
from jax_ppo.rollout import sampler as sampler_module
from jax_ppo.rollout import token_logprobs
from jax_ppo.rollout.token_logprobs import LOGITS_CHUNK_BYTES, head_logprobs, logits_chunk
from tests.ppo.conftest import CONFIG, MODEL, count_target, prompts


def _close(got, want, what, rtol=1e-5, atol=1e-6):
  got, want = jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=what)


def test_logits_chunk_rule():
  assert logits_chunk(8, 48, 2048, LOGITS_CHUNK_BYTES) is None  # the tiny/base benchmarks
  assert logits_chunk(8, 128, 65_536, LOGITS_CHUNK_BYTES) is None
  assert logits_chunk(8, 512, 151_936, LOGITS_CHUNK_BYTES) == 55  # Qwen: 256 MiB chunks
  assert logits_chunk(8, 512, 151_936, None) is None
  assert logits_chunk(4, 10, 100, 1) == 1  # never below one step


def test_head_logprobs_chunked_equals_whole_with_gradients():
  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  hidden = jax.random.normal(k1, (3, 9, MODEL.hidden_size))
  tokens = jax.random.randint(k2, (3, 9), 0, MODEL.vocab_size)

  def loss(params, chunk_bytes):
    m = nnx.merge(graphdef, params)
    lp, ent = head_logprobs(m, hidden, tokens, 0.8, entropy="grad", chunk_bytes=chunk_bytes)
    return jnp.sum(lp) + 0.1 * jnp.sum(ent), (lp, ent)

  run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (_, want), want_g = run(params, None)
  one_step = 3 * MODEL.vocab_size * 4
  assert logits_chunk(3, 9, MODEL.vocab_size, 4 * one_step) == 4
  (_, got), got_g = run(params, 4 * one_step)
  _close(got, want, "log-probs and entropies", rtol=1e-6)
  _close(got_g, want_g, "gradients")


def _trainer(config):
  # (no per-layer remat, so the only checkpoint in the jaxpr is the chunked path's)
  return PPOTrainer(config, CausalLM(MODEL, remat="none", rngs=nnx.Rngs(0)),
                    reward=TokenScorer(count_target), prompts=prompts())


def test_sampler_teacher_forced_logprobs_chunked(monkeypatch):
  trainer = _trainer(CONFIG)
  prompt_ids, _ = trainer.dataset.batch(0, trainer.config.prompts_per_update)
  rollout = trainer.sampler(prompt_ids, jax.random.PRNGKey(0), state=trainer.policy_state())
  model = trainer.policy_model()
  want = sampler_module.teacher_forced_logprobs(model, rollout, temperature=0.7)
  monkeypatch.setattr(token_logprobs, "LOGITS_CHUNK_BYTES", 2 * 8 * MODEL.vocab_size * 4)
  got = sampler_module.teacher_forced_logprobs(model, rollout, temperature=0.7)
  _close(got, want, "teacher-forced log-probs", rtol=1e-6)


@pytest.mark.slow
def test_ppo_steps_use_the_chunked_path_with_the_same_numbers():
  """One fused experience + update (the `jax.vjp` first epoch, then a scanned epoch) with 2-step
  chunks and a trained entropy equals the unchunked run."""
  config = dataclasses.replace(CONFIG, num_minibatches=1, entropy_coef=0.05)
  results = {}
  for name, limit in (("whole", None), ("chunked", 2 * 8 * MODEL.vocab_size * 4)):
    trainer = _trainer(config)
    steps = trainer.steps
    steps.logits_chunk_bytes = limit
    prompt_ids, _ = trainer.dataset.batch(3, trainer.config.prompts_per_update)
    rollout = trainer.sampler(prompt_ids, jax.random.PRNGKey(3), state=trainer.policy_state())
    scores = trainer.scorer(rollout, None)
    if steps.fuses_first_epoch:
      state, batch, _, metrics = steps.experience_update(trainer.state, trainer.frozen,
                                                         rollout, scores)
    else:
      batch, exp = steps.experience(trainer.state, trainer.frozen, rollout, scores)
      state, metrics = steps.update(trainer.state, trainer.frozen, batch, exp["objective/kl"])
    jaxpr = str(jax.make_jaxpr(steps.outputs)(state.params, trainer.frozen, batch))
    results[name] = (batch, metrics, state.params, jaxpr)
  (b0, m0, p0, j0), (b1, m1, p1, j1) = results["whole"], results["chunked"]
  assert "remat" in j1 and "remat" not in j0  # the chunked (checkpointed) path really ran
  _close(b1, b0, "batch")
  for name in m0:
    _close(m1[name], m0[name], name, rtol=1e-4)
  _close(p1, p0, "parameters", rtol=1e-4)
