"""Tests of jax_ppo.core.advantages: GAE (masked and with dones), REINFORCE++, GRPO and RLOO."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from core_strategies import (
    assert_close,
    batch_shapes,
    fill_masked,
    grid_arrays,
    jit_call,
    junk,
    masks,
    permutations,
)
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jax_ppo.core import (
    gae,
    gae_from_dones,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)

GRPO_SCALES = ("group", "batch", "none")
DISCOUNTS = (0.0, 0.5, 0.9, 1.0)


# ---------------------------------------------------------------- NumPy float64 references


def ref_gae(rewards, values, mask, gamma, lam):
  """The recursion of docs/core_api.md, reading rewards and values only at valid tokens."""
  b, t = mask.shape
  valid = np.asarray(mask) != 0
  adv = np.zeros((b, t))
  for i in range(b):
    next_adv = 0.0
    for j in reversed(range(t)):
      if not valid[i, j]:
        continue
      next_valid = j + 1 < t and valid[i, j + 1]
      next_value = float(values[i, j + 1]) if next_valid else 0.0
      delta = float(rewards[i, j]) + gamma * next_value - float(values[i, j])
      next_adv = adv[i, j + 1] if next_valid else 0.0
      adv[i, j] = delta + gamma * lam * next_adv
  returns = np.where(valid, adv + np.where(valid, np.asarray(values, np.float64), 0.0), 0.0)
  return adv, returns


def ref_gae_from_dones(rewards, values, dones, bootstrap_value, gamma, lam):
  b, t = rewards.shape
  adv = np.zeros((b, t))
  for i in range(b):
    next_adv, next_value = 0.0, float(bootstrap_value[i])
    for j in reversed(range(t)):
      not_done = 1.0 - float(dones[i, j])
      delta = float(rewards[i, j]) + gamma * next_value * not_done - float(values[i, j])
      next_adv = delta + gamma * lam * not_done * next_adv
      adv[i, j] = next_adv
      next_value = float(values[i, j])
  return adv, adv + np.asarray(values, np.float64)


def _ref_whiten(x, mask, eps):
  valid = np.asarray(mask) != 0
  v = x[valid]
  mean = v.mean() if v.size else 0.0
  var = np.var(v, ddof=1) if v.size > 1 else 0.0
  return np.where(valid, (x - mean) / np.sqrt(var + eps), 0.0)


def ref_reinforce_plus_plus(rewards, mask, gamma, eps=1e-8):
  b, t = mask.shape
  valid = np.asarray(mask) != 0
  returns = np.zeros((b, t))
  for i in range(b):
    for j in reversed(range(t)):
      if valid[i, j]:
        later = returns[i, j + 1] if j + 1 < t and valid[i, j + 1] else 0.0
        returns[i, j] = float(rewards[i, j]) + gamma * later
  return _ref_whiten(returns, mask, eps)


def _ref_std(x):
  return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def ref_grpo(scores, group_size, scale, eps=1e-6):
  scores = np.asarray(scores, np.float64)
  out = np.zeros_like(scores)
  for start in range(0, len(scores), group_size):
    group = scores[start : start + group_size]
    centred = group - group.mean()
    if scale == "group":
      centred = centred / (_ref_std(group) + eps)
    elif scale == "batch":
      centred = centred / (_ref_std(scores) + eps)
    out[start : start + group_size] = centred
  return out


def ref_rloo(scores, group_size):
  scores = np.asarray(scores, np.float64)
  out = np.zeros_like(scores)
  for i, s in enumerate(scores):
    start = i - i % group_size
    others = [scores[j] for j in range(start, start + group_size) if j != i]
    out[i] = s - sum(others) / len(others)
  return out


# ---------------------------------------------------------------- strategies


@st.composite
def gae_inputs(draw, contiguous=False):
  shape = draw(batch_shapes())
  rewards = draw(grid_arrays(shape, lo=-2.0, hi=2.0))
  values = draw(grid_arrays(shape, lo=-2.0, hi=2.0))
  return rewards, values, draw(masks(shape, contiguous=contiguous))


@st.composite
def dones_inputs(draw):
  shape = draw(batch_shapes())
  rewards = draw(grid_arrays(shape, lo=-2.0, hi=2.0))
  values = draw(grid_arrays(shape, lo=-2.0, hi=2.0))
  dones = draw(hnp.arrays(np.bool_, shape)).astype(draw(st.sampled_from((np.bool_, np.float32))))
  bootstrap = draw(grid_arrays(shape[:1], lo=-2.0, hi=2.0))
  return rewards, values, dones, bootstrap


@st.composite
def grouped_scores(draw, group_sizes=(1, 2, 4)):
  group_size = draw(st.sampled_from(group_sizes))
  n_groups = draw(st.sampled_from((1, 2, 3)))
  kind = draw(st.sampled_from(("grid", "grid", "constant_groups")))
  scores = draw(grid_arrays((n_groups * group_size,)))
  if kind == "constant_groups":  # Zero within-group variance (all answers equally good).
    scores = np.repeat(scores[::group_size], group_size)
  return scores, group_size


@st.composite
def group_permutations(draw, n, group_size):
  """A permutation of `n` rows that moves whole groups and shuffles rows inside each group."""
  groups = draw(permutations(n // group_size))
  inside = [draw(permutations(group_size)) for _ in range(n // group_size)]
  return np.concatenate([g * group_size + inside[k] for k, g in enumerate(groups)])


def _gae(rewards, values, mask, gamma, lam):
  return jit_call(gae, rewards, values, mask, gamma=gamma, lam=lam)


# ---------------------------------------------------------------- GAE


@given(gae_inputs(), st.sampled_from(DISCOUNTS), st.sampled_from(DISCOUNTS))
def test_gae_matches_numpy_reference(data, gamma, lam):
  rewards, values, mask = data
  adv, returns = _gae(rewards, values, mask, gamma, lam)
  assert adv.dtype == jnp.float32 and returns.dtype == jnp.float32
  chex.assert_shape((adv, returns), rewards.shape)
  ref_adv, ref_returns = ref_gae(rewards, values, mask, gamma, lam)
  assert_close(adv, ref_adv, rtol=1e-5, atol=1e-5)
  assert_close(returns, ref_returns, rtol=1e-5, atol=1e-5)
  valid = np.asarray(mask) != 0
  assert np.all(np.asarray(adv)[~valid] == 0.0) and np.all(np.asarray(returns)[~valid] == 0.0)
  # returns = A + V on valid tokens.
  assert_close(np.asarray(returns)[valid], (np.asarray(adv) + values)[valid], atol=1e-6)


@given(gae_inputs(), st.sampled_from(DISCOUNTS))
def test_gae_with_lambda_zero_is_the_td_error(data, gamma):
  rewards, values, mask = data
  adv, _ = _gae(rewards, values, mask, gamma, 0.0)
  valid = np.asarray(mask) != 0
  next_valid = np.pad(valid[:, 1:], ((0, 0), (0, 1)))
  next_values = np.pad(values[:, 1:].astype(np.float64), ((0, 0), (0, 1)))
  td = rewards + gamma * np.where(next_valid, next_values, 0.0) - values
  assert_close(adv, np.where(valid, td, 0.0), atol=1e-6)


@given(gae_inputs(contiguous=True))
def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value(data):
  rewards, values, mask = data
  adv, returns = _gae(rewards, values, mask, 1.0, 1.0)
  valid = np.asarray(mask) != 0
  masked_rewards = np.where(valid, rewards.astype(np.float64), 0.0)
  reward_to_go = np.cumsum(masked_rewards[:, ::-1], axis=1)[:, ::-1]
  assert_close(adv, np.where(valid, reward_to_go - values, 0.0), atol=1e-5)
  assert_close(returns, np.where(valid, reward_to_go, 0.0), atol=1e-5)


@given(gae_inputs(), st.sampled_from(DISCOUNTS), st.sampled_from(DISCOUNTS), st.data())
def test_gae_ignores_padding_and_permutes_with_rows(data, gamma, lam, draw):
  rewards, values, mask = data
  clean = _gae(rewards, values, mask, gamma, lam)
  dirty_r = fill_masked(rewards, mask, draw.draw(junk(rewards.shape)))
  dirty_v = fill_masked(values, mask, draw.draw(junk(rewards.shape)))
  chex.assert_trees_all_equal(_gae(dirty_r, dirty_v, mask, gamma, lam), clean)
  perm = draw.draw(permutations(rewards.shape[0]))
  permuted = _gae(rewards[perm], values[perm], mask[perm], gamma, lam)
  chex.assert_trees_all_equal(permuted, jax.tree.map(lambda x: np.asarray(x)[perm], clean))


@given(gae_inputs(), st.sampled_from(DISCOUNTS), st.sampled_from(DISCOUNTS))
def test_gae_is_gae_from_dones_with_episode_end_after_the_last_valid_token(data, gamma, lam):
  rewards, values, mask = data
  valid = np.asarray(mask) != 0
  dones = ~np.pad(valid[:, 1:], ((0, 0), (0, 1)))
  zero = np.zeros(rewards.shape[:1], np.float32)
  adv_d, ret_d = jit_call(
      gae_from_dones, np.where(valid, rewards, 0), np.where(valid, values, 0), dones, zero,
      gamma=gamma, lam=lam,
  )
  adv, returns = _gae(rewards, values, mask, gamma, lam)
  assert_close(adv, np.where(valid, adv_d, 0.0), atol=1e-6)
  assert_close(returns, np.where(valid, ret_d, 0.0), atol=1e-6)


def test_gae_known_values():
  rewards = np.array([[0.0, 0.0, 1.0, 0.0]], np.float32)
  values = np.array([[0.5, 0.25, 0.75, 9.0]], np.float32)
  mask = np.array([[1, 1, 1, 0]], bool)
  adv, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
  # deltas: 0 + 0.25 - 0.5, 0 + 0.75 - 0.25, 1 - 0.75 (V after the last token is 0).
  d = [-0.25, 0.5, 0.25]
  expected = [d[0] + 0.5 * (d[1] + 0.5 * d[2]), d[1] + 0.5 * d[2], d[2], 0.0]
  assert_close(adv, [expected])
  assert_close(returns, [[expected[0] + 0.5, expected[1] + 0.25, expected[2] + 0.75, 0.0]])


# ---------------------------------------------------------------- GAE with dones


@given(dones_inputs(), st.sampled_from(DISCOUNTS), st.sampled_from(DISCOUNTS))
def test_gae_from_dones_matches_numpy_reference(data, gamma, lam):
  rewards, values, dones, bootstrap = data
  adv, returns = jit_call(gae_from_dones, rewards, values, dones, bootstrap, gamma=gamma, lam=lam)
  assert adv.dtype == jnp.float32 and returns.dtype == jnp.float32
  ref_adv, ref_returns = ref_gae_from_dones(rewards, values, dones, bootstrap, gamma, lam)
  assert_close(adv, ref_adv, rtol=1e-5, atol=1e-5)
  assert_close(returns, ref_returns, rtol=1e-5, atol=1e-5)
  # lam = 0: the one-step TD error.
  adv0, _ = jit_call(gae_from_dones, rewards, values, dones, bootstrap, gamma=gamma, lam=0.0)
  next_values = np.concatenate([values[:, 1:], bootstrap[:, None]], axis=1).astype(np.float64)
  td = rewards + gamma * next_values * (1.0 - dones.astype(np.float64)) - values
  assert_close(adv0, td, atol=1e-5)


@given(dones_inputs(), st.sampled_from(DISCOUNTS), st.sampled_from(DISCOUNTS), st.data())
def test_gae_from_dones_does_not_look_past_an_episode_end(data, gamma, lam, draw):
  rewards, values, dones, bootstrap = data
  b, t = rewards.shape
  adv, _ = jit_call(gae_from_dones, rewards, values, dones, bootstrap, gamma=gamma, lam=lam)
  # Everything after the first done of a row (and the bootstrap value, if there is a done)
  # belongs to another episode.
  done = np.asarray(dones) != 0
  first = np.where(done.any(1), done.argmax(1), t)
  after = np.arange(t)[None, :] > first[:, None]
  new_r = np.where(after, draw.draw(junk((b, t), nonfinite=False)), rewards).astype(np.float32)
  new_v = np.where(after, draw.draw(junk((b, t), nonfinite=False)), values).astype(np.float32)
  new_boot = np.where(first < t, draw.draw(junk((b,), nonfinite=False)), bootstrap)
  new_adv, _ = jit_call(
      gae_from_dones, new_r, new_v, dones, new_boot.astype(np.float32), gamma=gamma, lam=lam
  )
  np.testing.assert_array_equal(np.asarray(new_adv)[~after], np.asarray(adv)[~after])
  perm = draw.draw(permutations(b))
  permuted = jit_call(
      gae_from_dones, rewards[perm], values[perm], dones[perm], bootstrap[perm], gamma=gamma,
      lam=lam,
  )
  assert_close(permuted[0], np.asarray(adv)[perm], rtol=0, atol=0)


# ---------------------------------------------------------------- REINFORCE++


@given(gae_inputs(), st.sampled_from(DISCOUNTS), st.data())
def test_reinforce_plus_plus_matches_reference_and_ignores_padding(data, gamma, draw):
  rewards, _, mask = data
  out = jit_call(reinforce_plus_plus_advantages, rewards, mask, gamma=gamma)
  assert out.dtype == jnp.float32
  assert_close(out, ref_reinforce_plus_plus(rewards, mask, gamma), rtol=1e-5, atol=1e-4)
  dirty = fill_masked(rewards, mask, draw.draw(junk(rewards.shape)))
  chex.assert_trees_all_equal(
      jit_call(reinforce_plus_plus_advantages, dirty, mask, gamma=gamma), out
  )
  perm = draw.draw(permutations(rewards.shape[0]))
  permuted = jit_call(reinforce_plus_plus_advantages, rewards[perm], mask[perm], gamma=gamma)
  assert_close(permuted, np.asarray(out)[perm], rtol=1e-6, atol=1e-5)


# ---------------------------------------------------------------- GRPO and RLOO


@given(grouped_scores(), st.sampled_from(GRPO_SCALES))
def test_grpo_matches_numpy_reference(data, scale):
  scores, group_size = data
  out = jit_call(grpo_advantages, scores, group_size=group_size, scale=scale)
  assert out.dtype == jnp.float32
  chex.assert_shape(out, scores.shape)
  assert_close(out, ref_grpo(scores, group_size, scale), rtol=1e-5, atol=1e-5)
  # Every group's advantages sum to zero.
  group_sums = np.asarray(out, np.float64).reshape(-1, group_size).sum(1)
  assert_close(group_sums, np.zeros_like(group_sums), atol=1e-5)


@given(grouped_scores(), st.sampled_from(GRPO_SCALES), st.data())
def test_grpo_is_invariant_to_group_shifts_and_permutes_with_groups(data, scale, draw):
  scores, group_size = data
  out = np.asarray(jit_call(grpo_advantages, scores, group_size=group_size, scale=scale))
  perm = draw.draw(group_permutations(len(scores), group_size))
  permuted = jit_call(grpo_advantages, scores[perm], group_size=group_size, scale=scale)
  assert_close(permuted, out[perm], rtol=1e-6, atol=1e-6)
  if scale != "batch":  # The batch std depends on how far apart the groups are.
    shifts = draw.draw(grid_arrays((len(scores) // group_size,)))
    shifted = scores + np.repeat(shifts, group_size)
    shifted_out = jit_call(grpo_advantages, shifted, group_size=group_size, scale=scale)
    assert_close(shifted_out, out, atol=1e-5)


@given(grouped_scores(group_sizes=(2, 3, 4)), st.data())
def test_rloo_matches_reference_and_is_shift_invariant(data, draw):
  scores, group_size = data
  out = jit_call(rloo_advantages, scores, group_size=group_size)
  assert out.dtype == jnp.float32
  expected = ref_rloo(scores, group_size)
  assert_close(out, expected, rtol=1e-6, atol=1e-6)
  # Leave-one-out is the group-centred score scaled by k / (k - 1); groups sum to zero.
  centred = ref_grpo(scores, group_size, "none")
  assert_close(out, centred * group_size / (group_size - 1), atol=1e-5)
  shifts = np.repeat(draw.draw(grid_arrays((len(scores) // group_size,))), group_size)
  shifted = jit_call(rloo_advantages, scores + shifts, group_size=group_size)
  assert_close(shifted, expected, atol=1e-5)
  perm = draw.draw(group_permutations(len(scores), group_size))
  permuted = jit_call(rloo_advantages, scores[perm], group_size=group_size)
  assert_close(permuted, expected[perm], atol=1e-6)


def test_grpo_known_values():
  scores = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], np.float32)
  out = grpo_advantages(scores, 3, scale="none")
  assert_close(out, [2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])
  std = np.std([1.0, 0.0, 0.0], ddof=1)
  assert_close(grpo_advantages(scores, 3), np.asarray(out) / (std + 1e-6))
  batch_std = np.std(scores, ddof=1)
  assert_close(grpo_advantages(scores, 3, scale="batch"), np.asarray(out) / (batch_std + 1e-6))
  # A group of identical scores carries no signal: 0, not NaN.
  assert_close(grpo_advantages(np.ones(4, np.float32), 2), np.zeros(4))
  assert_close(rloo_advantages(scores, 3), [1.0, -0.5, -0.5, -1.0, 0.5, 0.5])


# ---------------------------------------------------------------- jit and vmap


def test_jit_and_vmap_match_eager():
  rng = np.random.default_rng(0)
  n, b, t = 2, 4, 5
  rewards = rng.standard_normal((n, b, t)).astype(np.float32)
  values = rng.standard_normal((n, b, t)).astype(np.float32)
  mask = np.arange(t)[None, None, :] < rng.integers(0, t + 1, size=(n, b, 1))
  dones = rng.random((n, b, t)) < 0.3
  boot = rng.standard_normal((n, b)).astype(np.float32)
  scores = rng.standard_normal((n, b)).astype(np.float32)
  cases = {
      "gae": (functools.partial(gae, gamma=0.9, lam=0.8), (rewards, values, mask)),
      "gae_from_dones": (
          functools.partial(gae_from_dones, gamma=0.99, lam=0.95), (rewards, values, dones, boot)
      ),
      "reinforce_plus_plus": (
          functools.partial(reinforce_plus_plus_advantages, gamma=0.9), (rewards, mask)
      ),
      "rloo": (functools.partial(rloo_advantages, group_size=2), (scores,)),
  }
  for scale in GRPO_SCALES:
    cases[f"grpo_{scale}"] = (
        functools.partial(grpo_advantages, group_size=2, scale=scale), (scores,)
    )
  for name, (fn, args) in cases.items():
    eager = [fn(*(a[i] for a in args)) for i in range(n)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *eager)
    chex.assert_trees_all_close(
        jax.jit(fn)(*(a[0] for a in args)), eager[0], atol=1e-6, custom_message=name
    )
    chex.assert_trees_all_close(
        jax.jit(jax.vmap(fn))(*args), stacked, atol=1e-5, custom_message=name
    )


def test_jitted_gae_compiles_once_for_new_values_and_hyperparameters():
  traces = []

  def fn(rewards, values, mask, gamma, lam):
    traces.append(None)
    return gae(rewards, values, mask, gamma=gamma, lam=lam)

  jitted = jax.jit(fn)
  rng = np.random.default_rng(1)
  for gamma, lam in ((1.0, 0.95), (0.99, 0.9), (0.5, 0.0)):
    rewards = rng.standard_normal((2, 4)).astype(np.float32)
    values = rng.standard_normal((2, 4)).astype(np.float32)
    mask = rng.random((2, 4)) < 0.7
    chex.assert_trees_all_close(
        jitted(rewards, values, mask, gamma, lam),
        gae(rewards, values, mask, gamma=gamma, lam=lam),
        atol=1e-6,
    )
  assert len(traces) == 1
  assert jitted._cache_size() == 1


# ---------------------------------------------------------------- bad input

_R, _M = np.zeros((2, 3)), np.ones((2, 3))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: gae(_R, _R, _M, gamma=-0.1, lam=0.9), "`gamma`"),
        (lambda: gae(_R, _R, _M, gamma=1.1, lam=0.9), "`gamma`"),
        (lambda: gae(_R, _R, _M, gamma=float("nan"), lam=0.9), "`gamma`"),
        (lambda: gae(_R, _R, _M, gamma=1.0, lam=-0.5), "`lam`"),
        (lambda: gae(_R, _R, _M, gamma=1.0, lam=1.5), "`lam`"),
        (lambda: gae(np.zeros(3), np.zeros(3), np.ones(3)), "`rewards`"),
        (lambda: gae(_R, np.zeros((2, 4)), _M), "`values`"),
        (lambda: gae(_R, _R, np.ones((3, 2))), "`mask`"),
        (lambda: gae_from_dones(_R, _R, _M, np.zeros(2), gamma=2.0), "`gamma`"),
        (lambda: gae_from_dones(_R, _R, _M, np.zeros(2), lam=-1.0), "`lam`"),
        (lambda: gae_from_dones(_R, _R, _M, np.zeros(3)), "`bootstrap_value`"),
        (lambda: gae_from_dones(_R, _R, _M, np.zeros((2, 1))), "`bootstrap_value`"),
        (lambda: gae_from_dones(_R, _R, np.ones((2, 2)), np.zeros(2)), "`dones`"),
        (lambda: reinforce_plus_plus_advantages(_R, _M, gamma=1.5), "`gamma`"),
        (lambda: reinforce_plus_plus_advantages(_R, np.ones((2, 4))), "`mask`"),
        (lambda: grpo_advantages(np.zeros(4), 3), "`group_size`"),
        (lambda: grpo_advantages(np.zeros(4), 0), "`group_size`"),
        (lambda: grpo_advantages(np.zeros(4), 2, scale="std"), "`scale`"),
        (lambda: grpo_advantages(np.zeros((2, 2)), 2), "`scores`"),
        (lambda: rloo_advantages(np.zeros(4), 3), "`group_size`"),
        (lambda: rloo_advantages(np.zeros(4), 1), "`group_size`"),
        (lambda: rloo_advantages(np.zeros((2, 2)), 2), "`scores`"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, name):
  with pytest.raises(ValueError, match=name):
    call()
