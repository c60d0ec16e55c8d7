"""The fused first epoch: `PPOSteps.experience_update` equals `experience` then `update`.

With one minibatch and no gradient accumulation the first optimizer step sees the whole batch
with the behaviour parameters, so the trainer takes the old log-probs and values from that
step's own forward pass (`jax.vjp`) instead of a separate pass. Nothing but float summation
order may change.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models import LoRAConfig, ScalarModel, add_lora
from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOTrainer
from jax_ppo.rewards import TokenScorer
from tests.ppo.conftest import CONFIG, MODEL, count_target, prompts

# Trainers with identical programs load them from the cache instead of recompiling.
pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

FUSED = dataclasses.replace(CONFIG, num_minibatches=1, ppo_epochs=3)

CASES = {
    "gae, value head on the trunk, entropy bonus, target_kl": (
        {"entropy_coef": 0.05, "target_kl": 0.5}, {}),
    "gae, separate critic, one epoch": ({"ppo_epochs": 1}, {"value_model": "critic"}),
    "grpo, KL as a loss term": ({"advantage_mode": "grpo", "n_samples": 4}, {}),
    "gae, LoRA policy": ({}, {"policy": "lora"}),
}


def _trainer(config, policy=None, value_model=None):
  if policy == "lora":
    policy = add_lora(CausalLM(MODEL, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, alpha=8),
                      rngs=nnx.Rngs(1))
  if value_model == "critic":
    value_model = ScalarModel(MODEL, head_init="reward", rngs=nnx.Rngs(3))
  return PPOTrainer(
      config, policy if policy is not None else CausalLM(MODEL, rngs=nnx.Rngs(0)),
      reward=TokenScorer(count_target), prompts=prompts(), value_model=value_model,
  )


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _close(got, want, what, rtol=1e-4, atol=1e-6):
  got, want = jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want)
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_first_epoch_matches_experience_then_update(case):
  overrides, models = CASES[case]
  trainer = _trainer(dataclasses.replace(FUSED, **overrides), **models)
  steps = trainer.steps
  assert steps.fuses_first_epoch
  # Move the trained parameters away from the reference, so that the KL terms are not zero.
  leaves, tree = jax.tree.flatten(trainer.state.policy)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  moved = [
      x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
      for x, k in zip(leaves, keys, strict=True)
  ]
  trainer.state = trainer.state.replace(policy=jax.tree.unflatten(tree, moved))
  prompt_ids, _ = trainer.dataset.batch(5, trainer.config.prompts_per_update)
  rollout = trainer.sampler(prompt_ids, jax.random.PRNGKey(5), state=trainer.policy_state())
  scores = trainer.scorer(rollout, None)

  batch, exp_metrics = steps.experience(_copy(trainer.state), trainer.frozen, rollout, scores)
  want_state, want_metrics = steps.update(
      _copy(trainer.state), trainer.frozen, batch, exp_metrics["objective/kl"]
  )
  got_state, got_batch, got_exp, got_metrics = steps.experience_update(
      _copy(trainer.state), trainer.frozen, rollout, scores
  )

  assert abs(float(exp_metrics["objective/kl"])) > 1e-3  # k1 may be negative per batch
  _close(got_batch, batch, "batch", rtol=1e-5)
  _close(got_exp, exp_metrics, "experience metrics", rtol=1e-5)
  assert set(got_metrics) == set(want_metrics)
  for name in want_metrics:
    _close(got_metrics[name], want_metrics[name], name)
  assert got_metrics["val/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-6)
  _close(got_state.params, want_state.params, "parameters")
  _close(got_state.opt_state, want_state.opt_state, "optimizer state", atol=1e-7)
  for name in ("rng", "step", "opt_steps", "episode", "kl", "lr_scale"):
    _close(getattr(got_state, name), getattr(want_state, name), name, rtol=0, atol=0)


def test_trainer_uses_the_fused_step_and_learns():
  trainer = _trainer(FUSED)
  history = [trainer.step() for _ in range(20)]
  scores = [m["objective/scores"] for m in history]
  assert np.mean(scores[-5:]) > np.mean(scores[:5]) + 1.0, scores
  for m in history:
    assert abs(m["val/ratio_first_minibatch"] - 1.0) < 1e-5
    assert m["policy/epochs_run"] == FUSED.ppo_epochs
  assert trainer.steps.experience_update._cache_size() == len(
      {m["rollout/prompt_len"] for m in history}
  )
  assert trainer.steps.update._cache_size() == 0  # no separate experience/update programs


@pytest.mark.parametrize("overrides", [{"num_minibatches": 2}, {"gradient_accumulation_steps": 2}])
def test_fused_step_refuses_configs_whose_first_step_is_not_the_whole_batch(overrides):
  trainer = _trainer(dataclasses.replace(FUSED, **overrides))
  assert not trainer.steps.fuses_first_epoch
  prompt_ids, _ = trainer.dataset.batch(0, trainer.config.prompts_per_update)
  rollout = trainer.sampler(prompt_ids, jax.random.PRNGKey(0), state=trainer.policy_state())
  with pytest.raises(ValueError, match="num_minibatches == 1 and gradient_accumulation_steps"):
    trainer.steps.experience_update(trainer.state, trainer.frozen, rollout,
                                    trainer.scorer(rollout, None))
