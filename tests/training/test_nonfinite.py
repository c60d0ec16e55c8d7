"""Non-finite updates: an optimizer step whose loss or gradient is NaN/inf is skipped inside the
jitted step (state unchanged bit for bit, counted in `skipped_updates`), and a run whose updates
keep skipping stops with `NonFiniteUpdates` naming the causes and the last good checkpoint.

The faults are injected through the real compiled steps: poisoned advantages or scores in the
batch, never a mocked step.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOConfig, PPOTrainer
from jax_ppo.rewards import TokenScorer
from jax_ppo.training import RunOptions
from jax_ppo.training.loop import NonFiniteUpdates, RunCollapsed
from tests.ppo.conftest import CONFIG, MODEL, count_target, prompts

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def _trainer(config=CONFIG, **kwargs):
  return PPOTrainer(config, CausalLM(MODEL, rngs=nnx.Rngs(0)), reward=TokenScorer(count_target),
                    prompts=prompts(), peak_flops=1e11, **kwargs)


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _rollout(trainer):
  ids, _ = trainer.dataset.batch(0, trainer.config.prompts_per_update)
  rollout = trainer.sampler(ids, jax.random.PRNGKey(3), state=trainer.policy_state())
  return rollout, trainer.scorer(rollout, trainer.frozen.reward)


def _trained(state):
  """What a skipped step must leave alone."""
  return {"policy": state.policy, "value": state.value, "opt_state": state.opt_state,
          "opt_steps": state.opt_steps}


def _equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _assert_changed(before, after):
  leaves = zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
  assert any(not np.array_equal(x, y) for x, y in leaves)


@pytest.mark.parametrize("poison", ["inf_advantages", "nan_old_logprobs"])
def test_update_skips_every_poisoned_step_and_keeps_the_state(poison):
  trainer = _trainer()  # 2 epochs x 2 minibatches
  rollout, scores = _rollout(trainer)
  batch, exp = trainer.steps.experience(trainer.state, trainer.frozen, rollout, scores)
  if poison == "inf_advantages":
    bad = batch.replace(advantages=jnp.full_like(batch.advantages, jnp.inf))
  else:
    bad = batch.replace(old_logprobs=jnp.full_like(batch.old_logprobs, jnp.nan))
  before = _host(trainer.state)
  state, metrics = trainer.steps.update(trainer.state, trainer.frozen, bad, exp["objective/kl"])
  assert float(metrics["skipped_updates"]) == 4
  _equal(_trained(before), _host(_trained(state)))
  assert int(state.step) == 1  # the update itself is counted; its optimizer steps are not
  assert not np.isfinite(float(metrics["loss/total_avg"]))  # still visible in the metrics

  # The same update on the clean batch applies all four steps.
  trainer.state = jax.tree.map(jnp.asarray, before)
  state, metrics = trainer.steps.update(trainer.state, trainer.frozen, batch, exp["objective/kl"])
  assert float(metrics["skipped_updates"]) == 0 and int(state.opt_steps) == 4
  _assert_changed(before.policy, _host(state.policy))


def test_only_the_minibatch_with_the_poisoned_row_is_skipped():
  trainer = _trainer(dataclasses.replace(CONFIG, ppo_epochs=1))
  rollout, scores = _rollout(trainer)
  batch, exp = trainer.steps.experience(trainer.state, trainer.frozen, rollout, scores)
  bad = batch.replace(advantages=batch.advantages.at[0].set(jnp.nan))
  state, metrics = trainer.steps.update(trainer.state, trainer.frozen, bad, exp["objective/kl"])
  assert float(metrics["skipped_updates"]) == 1
  assert int(state.opt_steps) == 1  # the other minibatch's step was applied
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(_host(state.policy)))


def test_fused_experience_update_skips_a_non_finite_reward_batch():
  config = dataclasses.replace(CONFIG, num_minibatches=1, ppo_epochs=2)
  trainer = _trainer(config)
  assert trainer.steps.fuses_first_epoch
  rollout, scores = _rollout(trainer)
  before = _host(trainer.state)
  state, _, exp, metrics = trainer.steps.experience_update(
      trainer.state, trainer.frozen, rollout, scores.at[1].set(jnp.inf)
  )
  assert float(metrics["skipped_updates"]) == 2  # both epochs
  _equal(_trained(before), _host(_trained(state)))
  _equal(before.kl, _host(state.kl))  # fixed controller; the KL itself is finite
  assert np.isfinite(float(exp["objective/kl"]))


def test_replay_update_skips_and_the_trainer_sums_the_skips():
  config = dataclasses.replace(CONFIG, replay_buffer_size=1, replay_batches_per_update=1)
  trainer = _trainer(config)
  trainer.step()
  # Poison the buffered batch: the next update's replay steps (2 epochs x 2) are skipped.
  old = trainer.replay[0]
  trainer.replay[0] = old.replace(advantages=jnp.full_like(old.advantages, jnp.nan))
  metrics = trainer.step()
  assert metrics["skipped_updates"] == 4
  assert int(trainer.state.opt_steps) == 4 + 4  # fresh steps of both updates only
  assert trainer.step()["skipped_updates"] == 0  # the poisoned batch has left the buffer


def _nan_scores_after(trainer, good_updates):
  """Makes the trainer's scores NaN after `good_updates` updates (the reward source breaks)."""
  real = trainer.scorer
  calls = []

  def scorer(rollout, state):
    calls.append(1)
    scores = real(rollout, state)
    return scores if len(calls) <= good_updates else jnp.full_like(scores, jnp.nan)

  trainer.scorer = scorer


def test_consecutive_skips_stop_the_run_naming_causes_and_checkpoint(tmp_path):
  config = dataclasses.replace(CONFIG, max_consecutive_skips=2)
  opts = RunOptions(save_every=1, progress=False, tensorboard=False, log_samples_every=0)
  trainer = _trainer(config, run_dir=tmp_path, run_options=opts)
  _nan_scores_after(trainer, 2)
  policies = {}

  def snapshot(metrics):
    policies[int(metrics["step"])] = _host(trainer.state.policy)

  with pytest.raises(NonFiniteUpdates) as e:
    trainer.train(10, callback=snapshot)
  assert isinstance(e.value, RunCollapsed)  # the CLI reports it (exit status 1)
  message = str(e.value)
  assert "Steps 3 to 4" in message and "max_consecutive_skips=2" in message
  for cause in ("learning rate", "reward", "bfloat16", "NaN in the inputs"):
    assert cause in message
  assert f"step 2 in {str(tmp_path / 'checkpoints')!r}" in message
  assert trainer.checkpointer is None  # closed
  _equal(policies[2], policies[3])  # the skipped updates left the parameters alone
  logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["skipped_updates"] for r in logged] == [0, 0, 4, 4]
  # The monitor reports the non-finite metrics once per update, not once per metric.
  assert [r["monitor/warnings"] for r in logged] == [0, 0, 1, 1]


def test_a_skip_streak_is_reset_by_a_clean_update_and_none_never_stops():
  trainer = _trainer(dataclasses.replace(CONFIG, max_consecutive_skips=2))
  real = trainer.scorer
  calls = []

  def every_other_nan(rollout, state):
    calls.append(1)
    scores = real(rollout, state)
    return jnp.full_like(scores, jnp.nan) if len(calls) % 2 else scores

  trainer.scorer = every_other_nan
  history = trainer.train(4)
  assert [m["skipped_updates"] for m in history] == [4, 0, 4, 0]

  never = _trainer(dataclasses.replace(CONFIG, max_consecutive_skips=None))
  _nan_scores_after(never, 0)
  assert [m["skipped_updates"] for m in never.train(3)] == [4, 4, 4]

  stops = _trainer(dataclasses.replace(CONFIG, max_consecutive_skips=1))
  _nan_scores_after(stops, 0)
  with pytest.raises(NonFiniteUpdates, match="There is no run folder"):
    stops.train(3)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_consecutive_skips_is_validated(value):
  with pytest.raises(ValueError, match="PPOConfig.max_consecutive_skips"):
    PPOConfig(max_consecutive_skips=value)


def test_a_non_finite_gradient_with_a_finite_loss_is_skipped_too():
  """The core's losses keep NaN at padded positions out of both the loss and the gradient, so a
  finite loss with a non-finite gradient is injected at the optimizer step itself."""
  trainer = _trainer()
  state = trainer.state
  grads = jax.tree.map(jnp.ones_like, state.params)
  leaf = jax.tree.leaves(grads)[0]
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf) if g is leaf else g, grads)
  apply = jax.jit(trainer.steps.updater.apply_gradients)
  before = _host(state)
  skipped_state, m = apply(state, bad, {"loss/total_avg": jnp.float32(0.5)})
  assert float(m["skipped"]) == 1
  _equal(_trained(before), _host(_trained(skipped_state)))
  applied_state, m = apply(state, grads, {"loss/total_avg": jnp.float32(0.5)})
  assert float(m["skipped"]) == 0 and int(applied_state.opt_steps) == 1
  _assert_changed(before.policy, _host(applied_state.policy))
