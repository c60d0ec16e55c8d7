"""The PPO step's programs (`jax_ppo/ppo/steps.py`) against hand computations.

- docs/rlhf_details.md item 3: at a temperature other than 1 the rollout's, old, new and
  reference log-probs are all `log_softmax(logits / T)` of the response tokens;
- item 10: the returns that train the critic are the raw GAE advantages plus the values, taken
  before the advantages are whitened;
- item 18: every epoch reshuffles the batch into minibatches, each row used once per epoch.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOTrainer
from jax_ppo.ppo.loss import coefficients
from jax_ppo.rewards import TokenScorer
from tests.ppo.conftest import CONFIG, MODEL, count_target, prompts
from tests.ppo.test_wired_paths import (
  ONE_STEP,
  RAW_SCORES,
  _gae_reference,
  _hand_rollout,
  _np,
  _perturbed,
  _score_rewards,
)

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def _trainer(config) -> PPOTrainer:
  return PPOTrainer(config, CausalLM(MODEL, rngs=nnx.Rngs(0)), reward=TokenScorer(count_target),
                    prompts=prompts(), peak_flops=None)


# -- item 3: one temperature everywhere ----------------------------------------------------------


def _hand_logprobs(trainer: PPOTrainer, params, batch, temperature: float) -> np.ndarray:
  """`log_softmax(logits / T)` of the response tokens, in float64 from the model's full-sequence
  logits (`params`: the policy's trainable variables), 0 on padding."""
  model = nnx.merge(trainer.policy_graphdef, params, trainer.frozen.policy_rest)
  graphdef, state = nnx.split(model)
  logits = jax.jit(lambda st, ids, m, pos: nnx.merge(graphdef, st)(ids, m, positions=pos))(
      state, batch.input_ids, batch.attention_mask, batch.positions)
  t = batch.response_ids.shape[1]
  s = batch.input_ids.shape[1] - t
  z = np.asarray(logits, np.float64)[:, s - 1 : s + t - 1] / temperature
  z = z - z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  tokens = np.asarray(batch.response_ids)
  picked = np.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
  return np.where(np.asarray(batch.response_mask), picked, 0.0)


@pytest.mark.slow  # ~20 s: two updates of the trainer, compiled
def test_trainer_at_temperature_0_7_divides_every_logprob_by_t():
  temp = 0.7
  config = dataclasses.replace(
      CONFIG, sampling=dataclasses.replace(CONFIG.sampling, temperature=temp))
  trainer = _trainer(config)
  assert not trainer.steps.fuses_first_epoch  # `experience`, then `update` on 2 minibatches
  first = trainer.step()  # the policy moves away from the reference
  assert abs(first["val/ratio_first_minibatch"] - 1.0) < 1e-5
  assert first["rollout/logprob_mismatch"] < 1e-5

  # The next update, step by step, as `PPOTrainer.step` runs it.
  prompt_ids, _ = trainer.dataset.batch(trainer.data_position, config.prompts_per_update)
  rollout = trainer.sampler(prompt_ids, jax.random.PRNGKey(5), state=trainer.policy_state())
  policy = jax.tree.map(jnp.copy, trainer.state.policy)
  batch, exp = trainer.steps.experience(trainer.state, trainer.frozen, rollout,
                                        trainer.scorer(rollout, None))
  mask = np.asarray(batch.response_mask)
  old = _hand_logprobs(trainer, policy, batch, temp)
  ref = _hand_logprobs(trainer, trainer.frozen.ref, batch, temp)
  # The sampler's log-probs, the old (behaviour) and the reference log-probs are those at T.
  np.testing.assert_allclose(_np(rollout.logprobs), old, atol=1e-5)
  np.testing.assert_allclose(_np(batch.old_logprobs), old, atol=1e-5)
  np.testing.assert_allclose(_np(batch.ref_logprobs), ref, atol=1e-5)
  assert float(exp["objective/kl"]) == pytest.approx((old - ref).sum(1).mean(), abs=1e-5)
  # The check can tell: at T = 1 the log-probs are far from these, and the policy has moved
  # away from the reference.
  for params, at_t in ((policy, old), (trainer.frozen.ref, ref)):
    assert np.abs(_hand_logprobs(trainer, params, batch, 1.0) - at_t)[mask].max() > 1e-2
  assert np.abs(old - ref)[mask].max() > 1e-3

  # The training forward of the first minibatch of the first epoch reproduces them: ratio 1.
  _, m = trainer.steps.update(trainer.state, trainer.frozen, batch, exp["objective/kl"])
  assert abs(float(m["val/ratio_first_minibatch"]) - 1.0) < 1e-5


# -- item 10: returns before whitening -----------------------------------------------------------


def test_returns_are_raw_advantages_plus_values_before_whitening():
  config = dataclasses.replace(ONE_STEP, whiten_advantages=True, reward_clip=None)
  # The defaults of `PPOConfig` (gamma 1, lam 0.95) reach GAE.
  defaults = dataclasses.fields(type(config))
  assert (config.gamma, config.lam) == (1.0, 0.95) == tuple(
      f.default for f in defaults if f.name in ("gamma", "lam"))
  trainer = _trainer(config)
  state = _perturbed(trainer.state)  # non-zero values and KL
  batch, _ = trainer.steps.experience(state, trainer.frozen, _hand_rollout(),
                                      jnp.asarray(RAW_SCORES))
  mask = np.asarray(batch.response_mask)
  values = _np(batch.old_values)
  kl = np.where(mask, _np(batch.old_logprobs) - _np(batch.ref_logprobs), 0.0)
  assert np.abs(values).max() > 0.05 and np.abs(kl).max() > 0.05
  rewards = np.where(mask, -config.kl_coef * kl, 0.0) + _score_rewards(RAW_SCORES, mask)
  adv, returns = _gae_reference(rewards, values, mask, 1.0, 0.95)

  np.testing.assert_allclose(_np(batch.returns), returns, rtol=1e-4, atol=1e-5)
  valid = adv[mask]
  whitened = np.where(mask, (adv - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8), 0.0)
  np.testing.assert_allclose(_np(batch.advantages), whitened, rtol=1e-4, atol=1e-5)
  # Returns from the whitened advantages would be far from these.
  assert np.abs(np.where(mask, whitened + values, 0.0) - returns).max() > 0.5


# -- item 18: reshuffled every epoch -------------------------------------------------------------


def test_minibatches_are_reshuffled_every_epoch_and_use_every_row_once():
  config = dataclasses.replace(CONFIG, ppo_epochs=4, num_minibatches=2,
                               optimizer=dataclasses.replace(CONFIG.optimizer, learning_rate=1e-9),
                               whiten_advantages=True)
  trainer = _trainer(config)
  steps = trainer.steps
  batch, exp = steps.experience(trainer.state, trainer.frozen, _hand_rollout(),
                                jnp.asarray(RAW_SCORES))
  b, e, n = config.batch_size, config.ppo_epochs, config.num_minibatches

  @jax.jit
  def epochs(state, frozen, batch):
    """`Updater.update`'s passes, keeping the per-minibatch metrics."""
    coefs = coefficients(steps.config, state)
    state, rngs = steps.updater.epoch_keys(state)
    state, _, metrics, _, order = steps.updater.epochs(state, frozen, batch, coefs, rngs,
                                                       jnp.zeros((), bool))
    return state, metrics, order

  planned = jax.jit(functools.partial(steps.run_update, fresh=True, plan=True))
  start = jax.tree.map(jnp.copy, trainer.state)
  _, metrics, order = epochs(jax.tree.map(jnp.copy, start), trainer.frozen, batch)
  kl = exp["objective/kl"]
  state, _, plan = planned(jax.tree.map(jnp.copy, start), trainer.frozen, batch, kl)
  order = np.asarray(order)
  np.testing.assert_array_equal(np.asarray(plan["order"]), order)  # the update's own order
  assert order.shape == (e, n, config.minibatch_size)
  for epoch in order:  # every row exactly once per epoch
    np.testing.assert_array_equal(np.sort(epoch.ravel()), np.arange(b))
  partitions = {tuple(sorted(tuple(sorted(mb)) for mb in epoch)) for epoch in order}
  assert len({tuple(epoch.ravel()) for epoch in order}) == e  # a new permutation each epoch
  assert len(partitions) > 1  # and different minibatches, not only a new order within them

  # Each minibatch trained on the rows its order names: with a learning rate of 1e-9 the ratio
  # stays 1, so its policy loss is minus the token-mean advantage of those rows.
  adv, mask = _np(batch.advantages), np.asarray(batch.response_mask)
  loss = np.asarray(metrics["loss/policy_avg"])
  for i in range(e):
    for j in range(n):
      rows = order[i, j]
      assert loss[i, j] == pytest.approx(-adv[rows][mask[rows]].mean(), abs=1e-5), (i, j)
  assert np.abs(loss).max() > 0.05  # row subsets differ in their mean advantage

  # The next update draws new permutations (the state's key moved on).
  _, _, next_plan = planned(state, trainer.frozen, batch, kl)
  assert not np.array_equal(np.asarray(next_plan["order"]), order)
