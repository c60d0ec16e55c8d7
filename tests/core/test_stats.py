"""Tests of jax_ppo.core.stats: masked sums, means, variances, whitening, explained variance."""

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
    explained_variance,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

# ---------------------------------------------------------------- NumPy float64 references


def _valid(x, mask):
  return np.asarray(x, np.float64)[np.asarray(mask) != 0]


def ref_masked_sum(x, mask, axis=None):
  x = np.where(np.asarray(mask) != 0, np.asarray(x, np.float64), 0.0)
  return np.sum(x * np.asarray(mask, np.float64), axis=axis)


def ref_masked_mean(x, mask, axis=None):
  total = ref_masked_sum(x, mask, axis)
  count = np.sum(np.asarray(mask, np.float64), axis=axis)
  return np.where(count != 0, total / np.where(count != 0, count, 1.0), 0.0)


def ref_masked_var(x, mask, unbiased=True):
  v = _valid(x, mask)
  if v.size < 2:
    return 0.0
  return float(np.var(v, ddof=1 if unbiased else 0))


def ref_masked_whiten(x, mask, shift_mean=True, eps=1e-8):
  v = _valid(x, mask)
  mean = v.mean() if v.size else 0.0
  var = ref_masked_var(x, mask)
  out = (np.asarray(x, np.float64) - mean) / np.sqrt(var + eps)
  if not shift_mean:
    out = out + mean
  return np.where(np.asarray(mask) != 0, out, 0.0)


def ref_explained_variance(values, returns, mask):
  var_r = ref_masked_var(returns, mask)
  if var_r == 0:
    return 0.0
  residual = np.asarray(returns, np.float64) - np.asarray(values, np.float64)
  return 1.0 - ref_masked_var(residual, mask) / var_r


# ---------------------------------------------------------------- strategies


@st.composite
def x_and_mask(draw, n_arrays=1):
  shape = draw(batch_shapes())
  xs = [draw(grid_arrays(shape)) for _ in range(n_arrays)]
  return (*xs, draw(masks(shape)))


def _all_stats(x, mask):
  """Every statistic of one array, as one jitted program."""
  return {
      "sum": masked_sum(x, mask),
      "sum0": masked_sum(x, mask, axis=0),
      "sum1": masked_sum(x, mask, axis=1),
      "mean": masked_mean(x, mask),
      "mean0": masked_mean(x, mask, axis=0),
      "mean1": masked_mean(x, mask, axis=1),
      "var": masked_var(x, mask),
      "var_biased": masked_var(x, mask, unbiased=False),
      "whiten": masked_whiten(x, mask),
      "whiten_noshift": masked_whiten(x, mask, shift_mean=False),
      "whiten_eps": masked_whiten(x, mask, eps=0.5),
  }


def _ref_all_stats(x, mask):
  return {
      "sum": ref_masked_sum(x, mask),
      "sum0": ref_masked_sum(x, mask, axis=0),
      "sum1": ref_masked_sum(x, mask, axis=1),
      "mean": ref_masked_mean(x, mask),
      "mean0": ref_masked_mean(x, mask, axis=0),
      "mean1": ref_masked_mean(x, mask, axis=1),
      "var": ref_masked_var(x, mask),
      "var_biased": ref_masked_var(x, mask, unbiased=False),
      "whiten": ref_masked_whiten(x, mask),
      "whiten_noshift": ref_masked_whiten(x, mask, shift_mean=False),
      "whiten_eps": ref_masked_whiten(x, mask, eps=0.5),
  }


# ---------------------------------------------------------------- reference agreement


@given(x_and_mask())
def test_statistics_match_numpy_reference(data):
  x, mask = data
  out = jit_call(_all_stats, x, mask)
  expected = _ref_all_stats(x, mask)
  for key, value in out.items():
    assert value.dtype == jnp.float32, key
    assert value.shape == np.shape(expected[key]), key
    assert_close(value, expected[key], rtol=1e-5, atol=1e-4, err_msg=key)


@given(x_and_mask(n_arrays=2))
def test_explained_variance_matches_numpy_reference(data):
  values, returns, mask = data
  out = jit_call(explained_variance, values, returns, mask)
  assert_f32_scalar(out)
  assert_close(out, ref_explained_variance(values, returns, mask), rtol=1e-5, atol=1e-5)
  # A perfect critic explains everything; a constant one (the mean) nothing.
  if ref_masked_var(returns, mask) > 0:
    assert_close(jit_call(explained_variance, returns, returns, mask), 1.0)
    mean = np.full_like(returns, ref_masked_mean(returns, mask))
    assert_close(jit_call(explained_variance, mean, returns, mask), 0.0, atol=1e-5)


@given(x_and_mask())
def test_whitened_values_have_zero_mean_and_unit_variance(data):
  x, mask = data
  out = np.asarray(jit_call(masked_whiten, x, mask), np.float64)
  assert np.all(out[np.asarray(mask) == 0] == 0.0)
  if ref_masked_var(x, mask) > 0:
    assert abs(_valid(out, mask).mean()) < 1e-5
    assert abs(np.var(_valid(out, mask), ddof=1) - 1.0) < 1e-4


def test_float_masks_are_weights():
  x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
  w = np.array([[0.5, 0.0, 1.0], [0.0, 2.0, 0.0]], np.float32)
  assert_close(masked_sum(x, w), 0.5 + 3.0 + 10.0)
  assert_close(masked_mean(x, w), (0.5 + 3.0 + 10.0) / 3.5)
  assert_close(masked_mean(x, w, axis=1), [3.5 / 1.5, 5.0])


def test_degenerate_masks():
  x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
  empty = np.zeros((2, 2), bool)
  one = np.array([[False, True], [False, False]])
  for mask in (empty, one):
    assert_close(masked_var(x, mask), 0.0)
    assert_close(masked_whiten(x, mask), np.zeros((2, 2)))
    assert_close(explained_variance(x, x + 1.0, mask), 0.0)
  assert_close(masked_mean(x, empty), 0.0)
  assert_close(masked_mean(x, empty, axis=1), [0.0, 0.0])
  assert_close(masked_sum(x, empty), 0.0)
  assert_close(masked_mean(x, one), 2.0)
  assert_close(masked_mean(x, one, axis=1), [2.0, 0.0])


# ---------------------------------------------------------------- invariances


@given(x_and_mask(n_arrays=2), st.data())
def test_masked_entries_never_matter_even_nan_and_inf(data, draw):
  x, y, mask = data
  dirty_x = fill_masked(x, mask, draw.draw(junk(x.shape)))
  dirty_y = fill_masked(y, mask, draw.draw(junk(x.shape)))
  clean = jit_call(_all_stats, x, mask)
  dirty = jit_call(_all_stats, dirty_x, mask)
  chex.assert_trees_all_equal(dirty, clean)
  chex.assert_trees_all_equal(
      jit_call(explained_variance, dirty_x, dirty_y, mask),
      jit_call(explained_variance, x, y, mask),
  )


@given(x_and_mask(n_arrays=2), st.data())
def test_permuting_rows_permutes_rowwise_outputs_and_keeps_scalars(data, draw):
  x, y, mask = data
  perm = draw.draw(permutations(x.shape[0]))
  out = jit_call(_all_stats, x, mask)
  permuted = jit_call(_all_stats, x[perm], mask[perm])
  for key in ("sum", "mean", "var", "var_biased", "sum0", "mean0"):
    assert_close(permuted[key], out[key], rtol=1e-6, atol=1e-5, err_msg=key)
  for key in ("sum1", "mean1", "whiten", "whiten_noshift", "whiten_eps"):
    assert_close(permuted[key], np.asarray(out[key])[perm], rtol=1e-6, atol=1e-4, err_msg=key)
  assert_close(
      jit_call(explained_variance, x[perm], y[perm], mask[perm]),
      jit_call(explained_variance, x, y, mask),
      rtol=1e-5,
      atol=1e-5,
  )


# ---------------------------------------------------------------- jit and vmap


def test_jit_and_vmap_match_eager():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 2, 5)).astype(np.float32)
  y = rng.standard_normal((3, 2, 5)).astype(np.float32)
  mask = rng.random((3, 2, 5)) < 0.6
  mask[1] = False  # One whole batch of padding.
  fns = {
      "masked_sum": masked_sum,
      "masked_sum_axis1": functools.partial(masked_sum, axis=1),
      "masked_mean": masked_mean,
      "masked_mean_axis0": functools.partial(masked_mean, axis=0),
      "masked_var": masked_var,
      "masked_var_biased": functools.partial(masked_var, unbiased=False),
      "masked_whiten": masked_whiten,
      "masked_whiten_noshift": functools.partial(masked_whiten, shift_mean=False, eps=1e-6),
  }
  for name, fn in fns.items():
    eager = [fn(x[i], mask[i]) for i in range(3)]
    chex.assert_trees_all_close(
        jax.jit(fn)(x[0], mask[0]), eager[0], atol=1e-6, custom_message=name
    )
    chex.assert_trees_all_close(
        jax.jit(jax.vmap(fn))(x, mask), jnp.stack(eager), atol=1e-6, custom_message=name
    )
  eager = jnp.stack([explained_variance(x[i], y[i], mask[i]) for i in range(3)])
  chex.assert_trees_all_close(jax.jit(explained_variance)(x[0], y[0], mask[0]), eager[0])
  chex.assert_trees_all_close(jax.jit(jax.vmap(explained_variance))(x, y, mask), eager, atol=1e-6)


def test_bfloat16_inputs_reduce_in_float32():
  x = jnp.asarray(np.linspace(-3, 3, 12).reshape(3, 4), jnp.bfloat16)
  mask = np.ones((3, 4), bool)
  for fn in (masked_mean, masked_sum, masked_var):
    assert fn(x, mask).dtype == jnp.float32
  assert masked_whiten(x, mask).dtype == jnp.float32
  assert_close(masked_mean(x, mask), np.mean(np.asarray(x, np.float64)), atol=1e-6)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda: masked_mean(np.zeros((2, 3)), np.ones((2, 4))), ("`x`", "`mask`")),
        (lambda: masked_sum(np.zeros((2, 3)), np.ones((3, 2))), ("`x`", "`mask`")),
        (lambda: masked_var(np.zeros((2, 3)), np.ones((2,))), ("`x`", "`mask`")),
        (lambda: masked_whiten(np.zeros((2, 3)), np.ones((2, 3, 1))), ("`x`", "`mask`")),
        (
            lambda: explained_variance(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3))),
            ("`values`", "`returns`"),
        ),
    ],
)
def test_mismatched_shapes_raise_value_error_naming_the_arguments(call, names):
  with pytest.raises(ValueError) as info:
    call()
  for name in names:
    assert name in str(info.value)
