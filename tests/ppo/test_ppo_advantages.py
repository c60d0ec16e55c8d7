"""Tests of jax_ppo.ppo.advantages: the advantage modes as a name -> function table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ppo import core
from jax_ppo.ppo.advantages import ADVANTAGE_FNS, CRITIC_MODES, GROUP_MODES, AdvantageInputs
from jax_ppo.ppo.config import ADVANTAGE_MODES, PPOConfig


def _inputs(b: int = 4, t: int = 5, seed: int = 0) -> AdvantageInputs:
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  lengths = jnp.asarray([5, 3, 1, 4])[:b]
  mask = jnp.arange(t)[None, :] < lengths[:, None]
  return AdvantageInputs(
      rewards=jnp.where(mask, jax.random.normal(k[0], (b, t)), 0.0),
      seq_rewards=jax.random.normal(k[1], (b,)),
      values=jnp.where(mask, jax.random.normal(k[2], (b, t)), 0.0),
      mask=mask,
  )


def test_the_config_validates_against_the_table():
  assert ADVANTAGE_MODES == tuple(ADVANTAGE_FNS) == ("gae", "grpo", "rloo", "reinforce++")
  with pytest.raises(ValueError, match=r"advantage_mode='ppo' is invalid: choose one of "
                                       r"\('gae', 'grpo', 'rloo', 'reinforce\+\+'\)"):
    PPOConfig(advantage_mode="ppo")
  assert {m for m in ADVANTAGE_MODES if PPOConfig(advantage_mode=m, n_samples=2,
                                                  batch_size=8).uses_critic} == CRITIC_MODES
  for mode in GROUP_MODES:
    with pytest.raises(ValueError, match="needs n_samples >= 2"):
      PPOConfig(advantage_mode=mode, n_samples=1)


@pytest.mark.parametrize("mode", sorted(ADVANTAGE_FNS))
def test_every_mode_has_the_same_signature_and_is_zero_on_padding(mode):
  inputs = _inputs()
  config = PPOConfig(advantage_mode=mode, n_samples=2, batch_size=4, whiten_advantages=False)
  advantages, returns = jax.jit(ADVANTAGE_FNS[mode], static_argnums=1)(inputs, config)
  assert advantages.shape == returns.shape == inputs.mask.shape
  assert advantages.dtype == returns.dtype == jnp.float32
  assert np.all(np.asarray(advantages)[~np.asarray(inputs.mask)] == 0.0)
  if mode not in CRITIC_MODES:
    assert np.all(np.asarray(returns) == 0.0)


def test_each_mode_is_its_core_estimator():
  inputs = _inputs()
  mask = inputs.mask
  config = PPOConfig(n_samples=2, batch_size=4, whiten_advantages=False, lam=0.9)
  adv, ret = ADVANTAGE_FNS["gae"](inputs, config)
  want_adv, want_ret = core.gae(inputs.rewards, inputs.values, mask, gamma=1.0, lam=0.9)
  np.testing.assert_array_equal(adv, want_adv)
  np.testing.assert_array_equal(ret, want_ret)
  adv, _ = ADVANTAGE_FNS["rloo"](inputs, config)
  rloo = core.rloo_advantages(inputs.seq_rewards, 2)
  np.testing.assert_array_equal(adv, jnp.where(mask, rloo[:, None], 0.0))
  adv, _ = ADVANTAGE_FNS["grpo"](inputs, config)
  grpo = core.grpo_advantages(inputs.seq_rewards, 2, scale="group")
  np.testing.assert_array_equal(adv, jnp.where(mask, grpo[:, None], 0.0))
  adv, _ = ADVANTAGE_FNS["reinforce++"](inputs, config)
  np.testing.assert_array_equal(adv, core.reinforce_plus_plus_advantages(inputs.rewards, mask,
                                                                         gamma=1.0))
