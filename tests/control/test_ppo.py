"""Tests of jax_ppo.control.ppo: config validation, episode statistics, and a short CartPole run
that must learn (PPO from the core functions beats a random policy by a wide margin)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ppo.control import (
    ControlPPOConfig,
    final_return,
    init_episode_stats,
    make_train,
    return_curve,
    update_episode_stats,
)
from jax_ppo.control import ppo as ppo_module

# Trainers with identical programs load them from the cache instead of recompiling.
pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

# A uniformly random policy lasts about 22 steps on CartPole-v1 (reward 1 per step).
RANDOM_POLICY_RETURN = 22.0


def test_default_config_is_purejaxrl_cartpole():
  c = ControlPPOConfig()
  assert (c.total_timesteps, c.num_envs, c.num_steps) == (500_000, 4, 128)
  assert (c.update_epochs, c.num_minibatches, c.lr, c.anneal_lr) == (4, 4, 2.5e-4, True)
  assert (c.gamma, c.gae_lambda, c.clip_eps, c.value_clip_eps) == (0.99, 0.95, 0.2, 0.2)
  assert (c.ent_coef, c.vf_coef, c.max_grad_norm) == (0.01, 0.5, 0.5)
  assert (c.hidden_sizes, c.activation) == ((64, 64), "tanh")
  assert (c.batch_size, c.minibatch_size, c.num_updates) == (512, 128, 976)


def test_config_is_frozen_and_keyword_only():
  c = ControlPPOConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.lr = 1.0  # type: ignore[misc]
  with pytest.raises(TypeError):
    ControlPPOConfig("CartPole-v1")  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        # 4 * 128 = 512 transitions cannot be split into 3 minibatches.
        ({"num_minibatches": 3}, "num_minibatches"),
        ({"num_envs": 3, "num_steps": 5, "num_minibatches": 2}, "num_minibatches"),
        ({"total_timesteps": 100}, "total_timesteps"),
        ({"num_envs": 0}, "num_envs"),
        ({"update_epochs": 1.5}, "update_epochs"),
        ({"gamma": 1.5}, "gamma"),
        ({"gae_lambda": -0.1}, "gae_lambda"),
        ({"lr": 0.0}, "lr"),
        ({"clip_eps": 0.0}, "clip_eps"),
        ({"value_clip_eps": -1.0}, "value_clip_eps"),
        ({"ent_coef": -0.01}, "ent_coef"),
        ({"activation": "gelu"}, "activation"),
        ({"hidden_sizes": ()}, "hidden_sizes"),
        ({"log_every": -1}, "log_every"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
  with pytest.raises(ValueError, match=rf"ControlPPOConfig\.{field}\b"):
    ControlPPOConfig(**kwargs)


def test_config_divisibility_message_gives_the_fix():
  with pytest.raises(ValueError, match=r"must divide num_envs \* num_steps = 4 \* 128 = 512"):
    ControlPPOConfig(num_minibatches=3)


@pytest.mark.slow  # three small compiled runs, ~20 s on two cores
def test_value_clip_can_be_disabled():
  """`value_clip_eps=None` trains with the plain squared error; a clip range changes training.

  Three tiny runs from the same key: without clipping, with a clip range so wide that it never
  binds (the clipped formula then equals the squared error), and with a range so narrow that the
  critic's values leave it after the first step. The first two must train identically and never
  report a clipped token; the narrow one must clip and train differently.
  """
  tiny = dict(total_timesteps=96, num_envs=2, num_steps=16, num_minibatches=2, hidden_sizes=(8,),
              lr=1e-2, anneal_lr=False)
  runs = {}
  for eps in (None, 1e9, 1e-3):
    params, metrics = jax.jit(make_train(ControlPPOConfig(value_clip_eps=eps, **tiny)))(
        jax.random.key(0)
    )
    runs[eps] = (jax.tree.map(np.asarray, params), jax.device_get(metrics))
  (p_off, m_off), (p_wide, m_wide), (p_narrow, m_narrow) = runs[None], runs[1e9], runs[1e-3]

  np.testing.assert_array_equal(m_off["value_clipfrac"], 0.0)
  np.testing.assert_array_equal(m_wide["value_clipfrac"], 0.0)
  for name in ("value_loss", "policy_loss", "loss"):
    np.testing.assert_allclose(m_off[name], m_wide[name], rtol=1e-5, err_msg=name)
  for a, b in zip(jax.tree.leaves(p_off), jax.tree.leaves(p_wide), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  assert np.all(m_narrow["value_clipfrac"] > 0.5), m_narrow["value_clipfrac"]
  # The first update's first step starts at the rollout's values, later steps see clipped ones.
  assert not np.allclose(m_narrow["value_loss"], m_off["value_loss"], rtol=1e-3)
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(p_off), jax.tree.leaves(p_narrow), strict=True)) > 1e-3


def test_continuous_action_env_is_rejected():
  with pytest.raises(ValueError, match=r"ControlPPOConfig\.env_name.*Discrete"):
    make_train(ControlPPOConfig(env_name="Pendulum-v1"))


def test_episode_stats_match_a_log_wrapper():
  # Two environments; env 0 ends its episode at steps 2 and 4, env 1 never.
  rewards = jnp.array([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [3.0, 2.0], [5.0, 2.0]])
  dones = jnp.array([[0, 0], [0, 0], [1, 0], [0, 0], [1, 0]], bool)
  stats = init_episode_stats(2)
  returned = []
  for r, d in zip(rewards, dones, strict=True):
    stats = update_episode_stats(stats, r, d)
    returned.append(np.asarray(stats.returned_episode_return))
  np.testing.assert_array_equal(
      np.stack(returned), [[0, 0], [0, 0], [3, 0], [3, 0], [8, 0]]
  )
  np.testing.assert_array_equal(stats.returned_episode_length, [2, 0])
  np.testing.assert_array_equal(stats.episode_return, [0, 10])
  np.testing.assert_array_equal(stats.episode_length, [0, 5])
  np.testing.assert_array_equal(stats.timestep, [5, 5])


def test_final_return_averages_completed_episodes_of_the_last_updates():
  metrics = {
      "episode_return_sum": np.array([[10.0, 0.0, 300.0, 500.0], [0.0, 0.0, 0.0, 0.0]]),
      "episodes": np.array([[1, 0, 1, 1], [0, 0, 0, 0]]),
  }
  out = final_return(metrics, last_updates=3)
  assert out[0] == pytest.approx(400.0)
  assert np.isnan(out[1])  # No completed episode: NaN, not 0.


def test_return_curve_is_a_trailing_window_over_completed_episodes():
  metrics = {
      "episode_return_sum": np.array([0.0, 10.0, 0.0, 300.0, 500.0]),
      "episodes": np.array([0, 1, 0, 1, 1]),
  }
  np.testing.assert_allclose(
      return_curve(metrics, window=2), [np.nan, 10.0, 10.0, 300.0, 400.0]
  )
  np.testing.assert_allclose(
      return_curve(metrics, window=10), [np.nan, 10.0, 10.0, 155.0, 270.0]
  )
  assert return_curve(metrics, window=3)[-1] == final_return(metrics, last_updates=3)
  with pytest.raises(ValueError, match="window"):
    return_curve(metrics, window=0)


def test_auto_reset_step_matches_gymnax_step():
  # With the reset state drawn from the key gymnax's own `step` would use, the pre-drawn-reset
  # step gives the same observation, state, reward and done flag, including at episode ends.
  env, params = ppo_module.make_env("CartPole-v1")
  _, state = env.reset(jax.random.key(1), params)

  @jax.jit
  def both(key, state, action):
    obs_ref, state_ref, reward_ref, terminated, truncated, _ = env.step(key, state, action, params)
    key_step, key_reset = jax.random.split(key)
    reset_obs, reset_state = env.reset_env(key_reset, params)
    add_axis = lambda tree: jax.tree.map(lambda x: jnp.asarray(x)[None], tree)
    obs, new_state, reward, done = ppo_module._auto_reset_step(
        env, params, key_step[None], add_axis(state), action[None], add_axis(reset_obs),
        add_axis(reset_state),
    )
    ref = (obs_ref, state_ref, reward_ref, terminated | truncated)
    return ref, jax.tree.map(lambda x: x[0], (obs, new_state, reward, done))

  key = jax.random.key(2)
  dones = 0
  for _ in range(120):  # Always pushing right ends an episode every ~10 steps.
    key, k = jax.random.split(key)
    ref, ours = both(k, state, jnp.int32(1))
    jax.tree.map(np.testing.assert_array_equal, ours, ref)
    dones += int(ref[3])
    state = ref[1]
  assert dones >= 5


@pytest.fixture(scope="module")
def short_run():
  config = ControlPPOConfig(total_timesteps=40_000)
  params, metrics = jax.jit(make_train(config))(jax.random.key(0))
  return config, params, jax.device_get(metrics)


def test_short_cartpole_run_learns(short_run):
  config, _, metrics = short_run
  early = final_return({k: v[:10] for k, v in metrics.items()}, last_updates=10)
  late = final_return(metrics, last_updates=10)
  # About 20 at the start (random policy), 150-200 after 4e4 steps across seeds.
  assert early < 2 * RANDOM_POLICY_RETURN
  assert late > 5 * RANDOM_POLICY_RETURN, (early, late)


def test_short_run_metrics(short_run):
  config, params, metrics = short_run
  u = config.num_updates
  for name in ("loss", "policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac",
               "value_clipfrac", "episode_return_sum", "returned_episode_returns"):
    assert metrics[name].shape == (u,), name
    assert np.all(np.isfinite(metrics[name])), name
  np.testing.assert_array_equal(metrics["timestep"], np.arange(1, u + 1) * config.batch_size)
  # Two actions: entropy starts near log(2) (orthogonal 0.01 head) and stays in (0, log 2].
  assert metrics["entropy"][0] == pytest.approx(np.log(2.0), abs=1e-3)
  assert np.all((metrics["entropy"] > 0) & (metrics["entropy"] <= np.log(2.0) + 1e-6))
  # The learning rate anneals linearly from lr towards 0.
  assert metrics["learning_rate"][0] == pytest.approx(config.lr)
  assert metrics["learning_rate"][-1] == pytest.approx(config.lr / u, rel=1e-4)
  assert np.all(np.diff(metrics["learning_rate"]) < 0)
  # CartPole's reward is 1 per step, so completed episodes sum to <= 500 each.
  assert np.all(metrics["episode_return_sum"] <= 500 * metrics["episodes"])
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))
