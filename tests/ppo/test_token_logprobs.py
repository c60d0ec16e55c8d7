"""The PPO step uses the chunked log-prob path (`models.logprobs`) above the logits budget, with
the numbers of the unchunked path (the path itself: tests/models/test_logprobs.py)."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOTrainer
from jax_ppo.rewards import TokenScorer
from tests.ppo.conftest import CONFIG, MODEL, count_target, prompts


def _close(got, want, what, rtol=1e-5, atol=1e-6):
  got, want = jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=what)


def _trainer(config):
  # (no per-layer remat, so the only checkpoint in the jaxpr is the chunked path's)
  return PPOTrainer(config, CausalLM(MODEL, remat="none", rngs=nnx.Rngs(0)),
                    reward=TokenScorer(count_target), prompts=prompts())


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
