"""Tests of jax_ppo.core.kl: per-token KL estimators and KL-coefficient controllers."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from core_strategies import (
    assert_close,
    assert_f32_scalar,
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

from jax_ppo.core import (
    KL_ESTIMATORS,
    KLControllerState,
    adaptive_kl_controller,
    fixed_kl_controller,
    kl_penalty,
    multiplicative_kl_controller,
    shape_rewards,
)

# ---------------------------------------------------------------- NumPy float64 references


def ref_kl_penalty(logprobs, ref_logprobs, estimator):
  d = np.asarray(logprobs, np.float64) - np.asarray(ref_logprobs, np.float64)
  return {
      "k1": d,
      "k2": 0.5 * d**2,
      "k3": np.exp(-d) - 1.0 + d,
      "abs": np.abs(d),
  }[estimator]


def ref_fixed(coef, history):
  return [coef for _ in history]


def ref_adaptive(init_coef, target, horizon, history):
  coef, out = init_coef, []
  for kl, n_steps in history:
    err = min(max(kl / target - 1.0, -0.2), 0.2)
    coef = coef * (1.0 + err * n_steps / horizon)
    out.append(coef)
  return out


def ref_multiplicative(init_coef, target, history):
  coef, out = init_coef, []
  for kl, _ in history:
    if kl < target / 1.5:
      coef = coef * 0.5
    elif kl > 1.5 * target:
      coef = coef * 2.0
    coef = min(max(coef, 0.001), 1.0)
    out.append(coef)
  return out


# ---------------------------------------------------------------- strategies


@st.composite
def logprob_pairs(draw):
  shape = draw(batch_shapes())
  logprobs = draw(grid_arrays(shape, lo=-6.0, hi=0.0))
  ref_logprobs = draw(grid_arrays(shape, lo=-6.0, hi=0.0))
  return logprobs, ref_logprobs, draw(masks(shape))


# Six updates with observed KLs on a grid (thresholds of the rules are never hit ambiguously)
# and sample counts.
kl_histories = st.lists(
    st.tuples(st.integers(0, 160).map(lambda i: i / 8), st.sampled_from((1, 64, 512, 4096))),
    min_size=6,
    max_size=6,
)

CONTROLLERS = {
    "fixed": fixed_kl_controller,
    "adaptive": adaptive_kl_controller,
    "multiplicative": multiplicative_kl_controller,
}


def _eager_coefs(controller, history):
  state = controller.init()
  coefs = []
  for kl, n_steps in history:
    state = controller.update(state, jnp.float32(kl), jnp.float32(n_steps))
    assert_f32_scalar(state.coef)
    coefs.append(float(state.coef))
  return coefs


@functools.partial(jax.jit, static_argnames="kind")
def _scanned_coefs(hparams, kls, n_steps, *, kind):
  """The controller built from traced hyperparameters and updated inside `lax.scan`."""
  controller = CONTROLLERS[kind](*hparams)

  def step(state, inputs):
    state = controller.update(state, *inputs)
    return state, state.coef

  return jax.lax.scan(step, controller.init(), (kls, n_steps))[1]


def _check_controller(kind, hparams, history, expected, rtol):
  """Eager updates and a jitted scan of updates both follow the reference."""
  assert_close(_eager_coefs(CONTROLLERS[kind](*hparams), history), expected, rtol=rtol)
  kls, n_steps = (np.asarray(column, np.float32) for column in zip(*history, strict=True))
  scanned = _scanned_coefs(tuple(map(float, hparams)), kls, n_steps, kind=kind)
  assert scanned.dtype == jnp.float32
  assert_close(scanned, expected, rtol=rtol)


# ---------------------------------------------------------------- estimators


@given(logprob_pairs(), st.sampled_from(KL_ESTIMATORS))
def test_kl_penalty_matches_numpy_reference(data, estimator):
  logprobs, ref_logprobs, _ = data
  out = jit_call(kl_penalty, logprobs, ref_logprobs, estimator=estimator)
  assert out.dtype == jnp.float32
  chex.assert_shape(out, logprobs.shape)
  expected = ref_kl_penalty(logprobs, ref_logprobs, estimator)
  assert_close(out, expected, rtol=1e-5, atol=1e-5)
  if estimator != "k1":
    assert np.all(np.asarray(out) >= 0.0)
  # Equal log-probs (the padding convention) give exactly 0 for every estimator.
  assert np.all(np.asarray(jit_call(kl_penalty, logprobs, logprobs, estimator=estimator)) == 0.0)


@given(logprob_pairs(), st.sampled_from(KL_ESTIMATORS), st.data())
def test_kl_penalty_is_per_token_so_padding_and_row_order_do_not_matter(data, estimator, draw):
  logprobs, ref_logprobs, mask = data
  valid = mask != 0
  dirty_lp = fill_masked(logprobs, mask, draw.draw(junk(logprobs.shape)))
  dirty_ref = fill_masked(ref_logprobs, mask, draw.draw(junk(logprobs.shape)))
  clean = np.asarray(jit_call(kl_penalty, logprobs, ref_logprobs, estimator=estimator))
  dirty = np.asarray(jit_call(kl_penalty, dirty_lp, dirty_ref, estimator=estimator))
  np.testing.assert_array_equal(dirty[valid], clean[valid])
  perm = draw.draw(permutations(logprobs.shape[0]))
  permuted = jit_call(kl_penalty, logprobs[perm], ref_logprobs[perm], estimator=estimator)
  np.testing.assert_array_equal(np.asarray(permuted), clean[perm])


def test_kl_estimators_on_known_values():
  lp = np.array([[np.log(0.5), np.log(0.25)]], np.float32)
  ref = np.array([[np.log(0.25), np.log(0.5)]], np.float32)
  d = np.log(2.0)
  assert_close(kl_penalty(lp, ref, estimator="k1"), [[d, -d]])
  assert_close(kl_penalty(lp, ref, estimator="k2"), [[0.5 * d**2, 0.5 * d**2]])
  assert_close(kl_penalty(lp, ref, estimator="k3"), [[0.5 - 1 + d, 2.0 - 1 - d]])
  assert_close(kl_penalty(lp, ref, estimator="abs"), [[d, d]])
  assert_close(kl_penalty(lp, ref), kl_penalty(lp, ref, estimator="k1"))


def test_kl_penalty_upcasts_bfloat16():
  lp = jnp.asarray([[-1.0, -2.0]], jnp.bfloat16)
  ref = jnp.asarray([[-1.5, -1.0]], jnp.bfloat16)
  for estimator in KL_ESTIMATORS:
    out = kl_penalty(lp, ref, estimator=estimator)
    assert out.dtype == jnp.float32
    assert_close(out, ref_kl_penalty(lp, ref, estimator), atol=1e-6)


# ---------------------------------------------------------------- controllers


@given(st.sampled_from((0.0, 0.05, 0.2)), kl_histories)
def test_fixed_controller_never_changes(coef, history):
  assert_f32_scalar(fixed_kl_controller(coef).init().coef)
  _check_controller("fixed", (coef,), history, ref_fixed(coef, history), rtol=0)


@given(
    st.sampled_from((0.05, 0.2, 1.0)),
    st.sampled_from((1.0, 3.0, 6.0)),
    st.sampled_from((1000.0, 10000.0)),
    kl_histories,
)
def test_adaptive_controller_matches_ziegler_reference(init_coef, target, horizon, history):
  assert_close(adaptive_kl_controller(init_coef, target, horizon).init().coef, init_coef)
  expected = ref_adaptive(init_coef, target, horizon, history)
  _check_controller("adaptive", (init_coef, target, horizon), history, expected, rtol=1e-5)


@given(st.sampled_from((0.001, 0.05, 0.2, 1.0)), st.sampled_from((1.0, 3.0, 6.0)), kl_histories)
def test_multiplicative_controller_matches_reference(init_coef, target, history):
  expected = ref_multiplicative(init_coef, target, history)
  _check_controller("multiplicative", (init_coef, target), history, expected, rtol=1e-6)


def test_adaptive_controller_error_is_clipped():
  controller = adaptive_kl_controller(0.2, 6.0, 10.0)
  state = controller.init()
  # kl / target - 1 = 9 is clipped to 0.2; n_steps / horizon = 1.
  assert_close(controller.update(state, 60.0, 10.0).coef, 0.2 * 1.2)
  assert_close(controller.update(state, 0.0, 10.0).coef, 0.2 * 0.8)
  assert_close(controller.update(state, 6.0, 10.0).coef, 0.2)
  assert_close(controller.update(state, 6.6, 5.0).coef, 0.2 * (1 + 0.1 * 0.5))


def test_multiplicative_controller_dead_band_and_bounds():
  controller = multiplicative_kl_controller(0.5, 6.0)
  state = controller.init()
  assert_close(controller.update(state, 3.9, 1).coef, 0.25)
  assert_close(controller.update(state, 4.1, 1).coef, 0.5)
  assert_close(controller.update(state, 8.9, 1).coef, 0.5)
  assert_close(controller.update(state, 9.1, 1).coef, 1.0)
  high = controller.update(KLControllerState(jnp.float32(0.8)), 100.0, 1)
  low = controller.update(KLControllerState(jnp.float32(0.0015)), 0.0, 1)
  assert_close(high.coef, 1.0)
  assert_close(low.coef, 0.001)


def test_controller_coefficient_is_an_array_and_does_not_recompile():
  """The coefficient reaches jitted code as an argument: changing it neither recompiles the
  update nor a consumer such as reward shaping, and the consumer sees every new value."""
  controller = adaptive_kl_controller(0.2, 6.0, 100.0)
  traces = {"update": 0, "shape": 0}

  def update(state, kl, n_steps):
    traces["update"] += 1
    return controller.update(state, kl, n_steps)

  def shaped(scores, kl, mask, state):
    traces["shape"] += 1
    return shape_rewards(scores, kl, mask, kl_coef=state.coef)

  update, shaped = jax.jit(update), jax.jit(shaped)
  scores = np.ones((2,), np.float32)
  kl = np.ones((2, 3), np.float32)
  mask = np.ones((2, 3), bool)
  state = controller.init()
  assert isinstance(state.coef, jax.Array)
  assert_f32_scalar(state.coef)
  seen = []
  for step in range(5):
    rewards = shaped(scores, kl, mask, state)
    seen.append(-float(rewards[0, 0]))
    state = update(state, jnp.float32(20.0 + step), jnp.float32(50.0))
  assert traces == {"update": 1, "shape": 1}
  assert update._cache_size() == 1 and shaped._cache_size() == 1
  assert_close(seen, [0.2 * 1.1**i for i in range(5)], rtol=1e-5)


def test_controllers_vmap_over_independent_runs():
  controller = adaptive_kl_controller(0.2, 6.0, 100.0)
  states = jax.vmap(lambda _: controller.init())(jnp.arange(3))
  kls = jnp.array([0.0, 6.0, 60.0], jnp.float32)
  update = jax.jit(jax.vmap(controller.update, in_axes=(0, 0, None)))
  out = update(states, kls, jnp.float32(100.0))
  assert_close(out.coef, [0.2 * 0.8, 0.2, 0.2 * 1.2])
  multiplicative = multiplicative_kl_controller(0.5, 6.0)
  states = KLControllerState(jnp.full((3,), 0.5, jnp.float32))
  out = jax.jit(jax.vmap(multiplicative.update, in_axes=(0, 0, None)))(states, kls, 1.0)
  assert_close(out.coef, [0.25, 0.5, 1.0])


# ---------------------------------------------------------------- jit and vmap


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_penalty_jit_and_vmap_match_eager(estimator):
  rng = np.random.default_rng(0)
  lp = -rng.random((3, 2, 5)).astype(np.float32) * 3
  ref = -rng.random((3, 2, 5)).astype(np.float32) * 3
  fn = functools.partial(kl_penalty, estimator=estimator)
  eager = jnp.stack([fn(lp[i], ref[i]) for i in range(3)])
  chex.assert_trees_all_close(jax.jit(fn)(lp[0], ref[0]), eager[0], atol=1e-6)
  chex.assert_trees_all_close(jax.jit(jax.vmap(fn))(lp, ref), eager, atol=1e-6)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: kl_penalty(np.zeros((2, 3)), np.zeros((2, 3)), estimator="k4"), "`estimator`"),
        (lambda: kl_penalty(np.zeros((2, 3)), np.zeros((2, 3)), estimator="K1"), "`estimator`"),
        (lambda: kl_penalty(np.zeros((2, 3)), np.zeros((2, 4))), "`ref_logprobs`"),
        (lambda: kl_penalty(np.zeros((2, 3)), np.zeros((3,))), "`ref_logprobs`"),
        (lambda: fixed_kl_controller(-0.1), "`coef`"),
        (lambda: adaptive_kl_controller(-0.1, 6.0, 10.0), "`init_coef`"),
        (lambda: adaptive_kl_controller(0.2, 0.0, 10.0), "`target`"),
        (lambda: adaptive_kl_controller(0.2, 6.0, 0.0), "`horizon`"),
        (lambda: adaptive_kl_controller(0.2, 6.0, -5.0), "`horizon`"),
        (lambda: multiplicative_kl_controller(0.2, 0.0), "`target`"),
        (lambda: multiplicative_kl_controller(0.2, 6.0, factor=1.0), "`factor`"),
        (lambda: multiplicative_kl_controller(0.2, 6.0, tolerance=0.5), "`tolerance`"),
        (lambda: multiplicative_kl_controller(2.0, 6.0), "`init_coef`"),
        (lambda: multiplicative_kl_controller(0.2, 6.0, min_coef=0.5, max_coef=0.1), "`max_coef`"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, name):
  with pytest.raises(ValueError, match=name):
    call()
