"""Tests of jax_ppo.core.rewards: last_valid_index and shape_rewards."""

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

from jax_ppo.core import last_valid_index, overlong_penalty, shape_rewards

# ---------------------------------------------------------------- NumPy float64 references


def ref_last_valid_index(mask):
  out = []
  for row in np.asarray(mask) != 0:
    idx = np.flatnonzero(row)
    out.append(int(idx[-1]) if idx.size else -1)
  return np.array(out)


def ref_shape_rewards(scores, kl, mask, kl_coef):
  b, t = kl.shape
  coef = np.broadcast_to(np.asarray(kl_coef, np.float64), (b,))
  out = np.zeros((b, t))
  for i in range(b):
    last = -1
    for j in range(t):
      if mask[i, j] != 0:
        out[i, j] = -coef[i] * float(kl[i, j])
        last = j
    if last >= 0:
      out[i, last] += float(scores[i])
  return out


# ---------------------------------------------------------------- strategies


@st.composite
def reward_inputs(draw):
  b, t = draw(batch_shapes())
  scores = draw(grid_arrays((b,)))
  kl = draw(grid_arrays((b, t), lo=-1.0, hi=2.0))
  mask = draw(masks((b, t)))
  kind = draw(st.sampled_from(("float", "array", "rows")))
  if kind == "float":
    kl_coef = draw(st.sampled_from((0.0, 0.05, 0.2)))
  elif kind == "array":
    kl_coef = np.float32(draw(st.sampled_from((0.0, 0.05, 0.2))))
  else:
    kl_coef = draw(grid_arrays((b,), lo=0.0, hi=1.0))
  return scores, kl, mask, kl_coef


_shape_jit = jax.jit(lambda s, k, m, c: shape_rewards(s, k, m, kl_coef=c))


# ---------------------------------------------------------------- reference agreement


@given(reward_inputs())
def test_shape_rewards_matches_numpy_reference(data):
  scores, kl, mask, kl_coef = data
  out = _shape_jit(scores, kl, mask, kl_coef)
  assert out.dtype == jnp.float32
  chex.assert_shape(out, kl.shape)
  expected = ref_shape_rewards(scores, kl, mask, kl_coef)
  assert_close(out, expected, rtol=1e-6, atol=1e-6)
  # The score is all the reward a row gets beyond the KL penalty.
  valid = np.asarray(mask) != 0
  coef = np.broadcast_to(np.asarray(kl_coef, np.float64), scores.shape)
  kl_part = -(coef[:, None] * np.where(valid, kl, 0.0)).sum(1)
  has_token = valid.any(1)
  assert_close(np.asarray(out, np.float64).sum(1), kl_part + np.where(has_token, scores, 0.0))


@given(st.data())
def test_last_valid_index_matches_numpy_reference(draw):
  mask = draw.draw(masks(draw.draw(batch_shapes())))
  out = jit_call(last_valid_index, mask)
  assert out.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(out), ref_last_valid_index(mask))


def test_score_goes_on_the_last_valid_token_not_one_past_it():
  """trl#1893: the score belongs to the EOS token (the last valid one)."""
  mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]], bool)
  scores = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
  out = np.asarray(shape_rewards(scores, np.zeros((4, 5), np.float32), mask, kl_coef=0.1))
  expected = np.zeros((4, 5))
  expected[0, 2], expected[1, 4], expected[2, 3] = 1.0, 2.0, 3.0
  np.testing.assert_array_equal(out, expected)
  np.testing.assert_array_equal(np.asarray(last_valid_index(mask)), [2, 4, 3, -1])


# ---------------------------------------------------------------- invariances


@given(reward_inputs(), st.data())
def test_padding_never_matters_and_rows_permute(data, draw):
  scores, kl, mask, kl_coef = data
  clean = _shape_jit(scores, kl, mask, kl_coef)
  dirty_kl = fill_masked(kl, mask, draw.draw(junk(kl.shape)))
  dirty = _shape_jit(scores, dirty_kl, mask, kl_coef)
  np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
  assert np.all(np.asarray(clean)[np.asarray(mask) == 0] == 0.0)
  perm = draw.draw(permutations(kl.shape[0]))
  coef = kl_coef[perm] if np.ndim(kl_coef) == 1 else kl_coef
  permuted = _shape_jit(scores[perm], kl[perm], mask[perm], coef)
  np.testing.assert_array_equal(np.asarray(permuted), np.asarray(clean)[perm])
  np.testing.assert_array_equal(
      np.asarray(jit_call(last_valid_index, mask[perm])),
      np.asarray(jit_call(last_valid_index, mask))[perm],
  )


# ---------------------------------------------------------------- jit and vmap


def test_jit_and_vmap_match_eager():
  rng = np.random.default_rng(0)
  scores = rng.standard_normal((3, 2)).astype(np.float32)
  kl = rng.standard_normal((3, 2, 5)).astype(np.float32)
  mask = np.arange(5)[None, None, :] < rng.integers(0, 6, size=(3, 2, 1))
  for kl_coef in (0.1, jnp.float32(0.3)):
    fn = functools.partial(shape_rewards, kl_coef=kl_coef)
    eager = jnp.stack([fn(scores[i], kl[i], mask[i]) for i in range(3)])
    chex.assert_trees_all_close(jax.jit(fn)(scores[0], kl[0], mask[0]), eager[0])
    chex.assert_trees_all_close(jax.jit(jax.vmap(fn))(scores, kl, mask), eager)
  # A per-row coefficient, and a coefficient that is itself batched over the vmapped axis.
  coefs = rng.random((3,)).astype(np.float32)
  eager = jnp.stack([shape_rewards(scores[i], kl[i], mask[i], kl_coef=coefs[i]) for i in range(3)])
  per_row = jax.jit(jax.vmap(lambda s, k, m, c: shape_rewards(s, k, m, kl_coef=c)))
  chex.assert_trees_all_close(per_row(scores, kl, mask, coefs), eager)
  eager_last = jnp.stack([last_valid_index(mask[i]) for i in range(3)])
  chex.assert_trees_all_equal(jax.jit(last_valid_index)(mask[0]), eager_last[0])
  chex.assert_trees_all_equal(jax.jit(jax.vmap(last_valid_index))(mask), eager_last)


def test_traced_kl_coef_does_not_recompile():
  traces = []

  def fn(scores, kl, mask, kl_coef):
    traces.append(None)
    return shape_rewards(scores, kl, mask, kl_coef=kl_coef)

  jitted = jax.jit(fn)
  kl = np.ones((2, 3), np.float32)
  for coef in (0.1, 0.2, 0.4):
    out = jitted(np.zeros(2, np.float32), kl, np.ones((2, 3), bool), jnp.float32(coef))
    assert_close(out, -coef * kl)
  assert len(traces) == 1


# ---------------------------------------------------------------- bad input


_B, _KL, _MASK = np.zeros(2), np.zeros((2, 3)), np.ones((2, 3))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: shape_rewards(np.zeros((2, 1)), _KL, _MASK, kl_coef=0.1), "`scores`"),
        (lambda: shape_rewards(np.zeros(3), _KL, _MASK, kl_coef=0.1), "`scores`"),
        (lambda: shape_rewards(_B, np.zeros((2,)), np.ones((2,)), kl_coef=0.1), "`kl`"),
        (lambda: shape_rewards(_B, _KL, np.ones((2, 4)), kl_coef=0.1), "`mask`"),
        (lambda: shape_rewards(_B, _KL, _MASK, kl_coef=np.zeros((2, 3))), "`kl_coef`"),
        (lambda: last_valid_index(np.ones((2, 3, 1))), "`mask`"),
        (lambda: last_valid_index(np.ones((3,))), "`mask`"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, name):
  with pytest.raises(ValueError, match=name):
    call()


# ---------------------------------------------------------------- overlong_penalty


def ref_overlong(lengths, max_length, cache_length, penalty):
  start = max_length - cache_length
  out = []
  for n in np.asarray(lengths, np.float64):
    if n <= start:
      out.append(0.0)
    elif n <= max_length:
      out.append(penalty * (start - n) / cache_length)
    else:
      out.append(-penalty)
  return np.array(out)


@given(st.integers(1, 64), st.data())
def test_overlong_penalty_matches_reference_and_is_continuous(max_length, data):
  cache = data.draw(st.integers(1, max_length))
  penalty = data.draw(st.sampled_from((0.0, 0.5, 1.0, 2.0)))
  lengths = np.arange(0, max_length + 3)
  got = jit_call(overlong_penalty, lengths, max_length=max_length, cache_length=cache,
                 penalty=penalty)
  assert got.dtype == jnp.float32 and got.shape == lengths.shape
  assert_close(got, ref_overlong(lengths, max_length, cache, penalty), rtol=1e-6, atol=1e-6)
  # 0 up to the window, -penalty at the limit, never increasing with the length.
  assert_close(got[max_length - cache], 0.0, atol=0)
  assert_close(got[max_length], -penalty, rtol=1e-6, atol=1e-7)
  assert np.all(np.diff(np.asarray(got)) <= 1e-7)


def test_overlong_penalty_known_values():
  # DAPO's setting: a 20480-token limit with a 4096-token window.
  got = overlong_penalty(np.array([100, 16384, 18432, 20480, 20481]), max_length=20480,
                         cache_length=4096)
  assert_close(got, [0.0, 0.0, -0.5, -1.0, -1.0], rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(max_length=0, cache_length=1), "`max_length`"),
        (dict(max_length=10, cache_length=0), "`cache_length`"),
        (dict(max_length=10, cache_length=11), "`cache_length`"),
        (dict(max_length=10, cache_length=2.5), "`cache_length`"),
        (dict(max_length=10, cache_length=4, penalty=-1.0), "`penalty`"),
    ],
)
def test_overlong_penalty_bad_options(kwargs, name):
  with pytest.raises(ValueError, match=name):
    overlong_penalty(np.array([3, 4]), **kwargs)


def test_overlong_penalty_bad_shape():
  with pytest.raises(ValueError, match="`lengths`"):
    overlong_penalty(np.zeros((2, 3)), max_length=10, cache_length=4)
