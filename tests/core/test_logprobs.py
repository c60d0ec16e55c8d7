"""Tests of jax_ppo.core.logprobs: gather_logprobs and entropy_from_logits."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from core_strategies import (
    assert_close,
    fill_masked,
    jit_call,
    junk,
    logits_shapes,
    masks,
    permutations,
    seeds,
)
from hypothesis import given
from hypothesis import strategies as st

from jax_ppo.core import entropy_from_logits, gather_logprobs

TEMPERATURES = (0.3, 0.7, 1.0, 1.6)


# ---------------------------------------------------------------- NumPy float64 references


def ref_log_softmax(logits, temperature=1.0):
  z = np.asarray(logits, np.float64) / temperature
  z = z - z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def ref_gather_logprobs(logits, tokens, temperature=1.0):
  log_p = ref_log_softmax(logits, temperature)
  b, t = tokens.shape
  out = np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      out[i, j] = log_p[i, j, tokens[i, j]]
  return out


def ref_entropy(logits, temperature=1.0):
  log_p = ref_log_softmax(logits, temperature)
  p = np.exp(log_p)
  return -np.sum(np.where(p > 0, p * log_p, 0.0), axis=-1)


# ---------------------------------------------------------------- strategies


@st.composite
def logits_and_tokens(draw):
  b, t, v = draw(logits_shapes())
  rng = np.random.default_rng(draw(seeds()))
  scale = draw(st.sampled_from((0.1, 1.0, 4.0, 10.0)))
  logits = (scale * rng.standard_normal((b, t, v))).astype(np.float32)
  tokens = rng.integers(0, v, size=(b, t)).astype(np.int32)
  return logits, tokens


# ---------------------------------------------------------------- reference agreement


def _gather(*args, **kwargs):
  return jit_call(gather_logprobs, *args, **kwargs)


def _entropy(*args, **kwargs):
  return jit_call(entropy_from_logits, *args, **kwargs)


def _every_token_logprobs(logits, temperature):
  """`[V, B, T]`: the log-probability of every vocabulary entry at every position."""
  v = logits.shape[-1]
  tokens = jnp.broadcast_to(jnp.arange(v)[:, None, None], (v,) + logits.shape[:2])
  return jax.vmap(lambda tok: gather_logprobs(logits, tok, temperature))(tokens)


@given(logits_and_tokens(), st.sampled_from(TEMPERATURES))
def test_gather_logprobs_matches_numpy_reference(data, temperature):
  logits, tokens = data
  out = _gather(logits, tokens, temperature=temperature)
  assert out.dtype == jnp.float32
  chex.assert_shape(out, tokens.shape)
  assert_close(out, ref_gather_logprobs(logits, tokens, temperature), rtol=1e-5, atol=3e-5)
  assert np.all(np.asarray(out) <= 1e-6)


@given(logits_and_tokens(), st.sampled_from(TEMPERATURES))
def test_entropy_from_logits_matches_numpy_reference(data, temperature):
  logits, _ = data
  out = _entropy(logits, temperature=temperature)
  assert out.dtype == jnp.float32
  chex.assert_shape(out, logits.shape[:2])
  assert_close(out, ref_entropy(logits, temperature), rtol=1e-5, atol=3e-5)
  v = logits.shape[-1]
  assert np.all(np.asarray(out) >= 0.0)
  assert np.all(np.asarray(out) <= np.log(v) + 1e-5)


@given(logits_and_tokens(), st.sampled_from(TEMPERATURES))
def test_logprobs_over_the_vocabulary_are_normalised(data, temperature):
  logits, _ = data
  log_p = np.asarray(jit_call(_every_token_logprobs, logits, temperature), np.float64)
  assert_close(np.exp(log_p).sum(axis=0), np.ones(logits.shape[:2]), atol=1e-5)


# ---------------------------------------------------------------- invariances


@given(logits_and_tokens(), st.data())
def test_positions_are_independent_and_rows_permute(data, draw):
  """An output never depends on logits at another position, even NaN ones (so padding junk
  cannot leak), and permuting rows permutes the outputs."""
  logits, tokens = data
  b, t, v = logits.shape
  mask = draw.draw(masks((b, t)))
  dirty = fill_masked(logits, mask, draw.draw(junk((b, t, v))))
  valid = mask != 0
  for clean_out, dirty_out in (
      (_gather(logits, tokens), _gather(dirty, tokens)),
      (_entropy(logits), _entropy(dirty)),
  ):
    np.testing.assert_array_equal(np.asarray(dirty_out)[valid], np.asarray(clean_out)[valid])
  perm = draw.draw(permutations(b))
  chex.assert_trees_all_close(_gather(logits[perm], tokens[perm]), _gather(logits, tokens)[perm])
  chex.assert_trees_all_close(_entropy(logits[perm]), _entropy(logits)[perm])


@given(logits_and_tokens(), st.floats(-50, 50, width=32))
def test_shifting_logits_changes_nothing(data, shift):
  logits, tokens = data
  shifted = logits + np.float32(shift)
  chex.assert_trees_all_close(_gather(shifted, tokens), _gather(logits, tokens), atol=1e-4)
  chex.assert_trees_all_close(_entropy(shifted), _entropy(logits), atol=1e-4)


def test_uniform_logits_give_log_v():
  v = 5
  logits = np.zeros((2, 3, v), np.float32)
  tokens = np.zeros((2, 3), np.int32)
  chex.assert_trees_all_close(gather_logprobs(logits, tokens), np.full((2, 3), -np.log(v)))
  chex.assert_trees_all_close(entropy_from_logits(logits), np.full((2, 3), np.log(v)))


def test_masked_vocabulary_entries_give_finite_values_and_gradients():
  """-inf logits (a masked vocabulary entry) have probability 0: entropy and log-probs and
  their gradients stay finite, and the masked entries get no gradient."""
  logits = jnp.array([[[0.0, 1.0, -jnp.inf, 0.5], [2.0, -jnp.inf, -jnp.inf, 0.0]]])
  tokens = jnp.array([[1, 3]])
  without_masked = [np.array([0.0, 1.0, 0.5]), np.array([2.0, 0.0])]
  ent = np.asarray(entropy_from_logits(logits))[0]
  lp = np.asarray(gather_logprobs(logits, tokens))[0]
  for t, row in enumerate(without_masked):
    assert_close(ent[t], ref_entropy(row[None, None])[0, 0], atol=1e-6)
  assert_close(lp, [ref_log_softmax(without_masked[0])[1], ref_log_softmax(without_masked[1])[1]])
  for fn in (
      lambda x: jnp.sum(entropy_from_logits(x)),
      lambda x: jnp.sum(gather_logprobs(x, tokens)),
  ):
    grad = np.asarray(jax.jit(jax.grad(fn))(logits))
    assert np.all(np.isfinite(grad)), grad
    assert np.all(grad[np.isinf(np.asarray(logits))] == 0.0)


def test_entropy_gradient_matches_finite_logits_version():
  """d entropy / d logits with a -inf entry equals the gradient of the same distribution
  without that entry."""
  logits = jnp.array([[[0.3, -1.0, 2.0, -jnp.inf]]])
  grad_fn = jax.jit(jax.grad(lambda x: jnp.sum(entropy_from_logits(x))))
  grad = grad_fn(logits)
  grad_ref = grad_fn(logits[..., :3])
  chex.assert_trees_all_close(grad[..., :3], grad_ref, atol=1e-6)


# ---------------------------------------------------------------- dtypes


def test_bfloat16_logits_match_float32_and_return_float32():
  rng = np.random.default_rng(0)
  logits = (3.0 * rng.standard_normal((3, 5, 64))).astype(np.float32)
  tokens = rng.integers(0, 64, size=(3, 5)).astype(np.int32)
  logits_bf16 = jnp.asarray(logits, jnp.bfloat16)
  for temperature in (1.0, 0.7):
    lp16 = gather_logprobs(logits_bf16, tokens, temperature=temperature)
    lp32 = gather_logprobs(logits, tokens, temperature=temperature)
    ent16 = entropy_from_logits(logits_bf16, temperature=temperature)
    ent32 = entropy_from_logits(logits, temperature=temperature)
    assert lp16.dtype == jnp.float32 and ent16.dtype == jnp.float32
    # bfloat16 keeps 8 significant bits: |logit| <~ 12 moves by <~ 0.05 after rounding.
    assert_close(lp16, lp32, rtol=0, atol=0.1)
    assert_close(ent16, ent32, rtol=0, atol=0.05)
    # The computation itself is float32: exactly the float32 result on the rounded logits.
    upcast = jnp.asarray(logits_bf16, jnp.float32)
    assert_close(lp16, gather_logprobs(upcast, tokens, temperature=temperature), atol=1e-6)
    assert_close(ent16, entropy_from_logits(upcast, temperature=temperature), atol=1e-6)
    # And far better than a bfloat16 log-softmax would be.
    assert_close(lp16, ref_gather_logprobs(np.asarray(upcast), tokens, temperature), atol=2e-5)


def test_integer_tokens_of_any_int_dtype():
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((2, 3, 4)).astype(np.float32)
  tokens = rng.integers(0, 4, size=(2, 3))
  expected = gather_logprobs(logits, tokens.astype(np.int32))
  for dtype in (np.int64, np.uint8, np.int16):
    chex.assert_trees_all_close(gather_logprobs(logits, tokens.astype(dtype)), expected)


# ---------------------------------------------------------------- jit and vmap


def test_jit_and_vmap_match_eager():
  rng = np.random.default_rng(2)
  logits = rng.standard_normal((3, 2, 4, 6)).astype(np.float32)
  tokens = rng.integers(0, 6, size=(3, 2, 4)).astype(np.int32)
  gather = functools.partial(gather_logprobs, temperature=0.7)
  entropy = functools.partial(entropy_from_logits, temperature=0.7)
  eager_lp = np.stack([gather(logits[i], tokens[i]) for i in range(3)])
  eager_ent = np.stack([entropy(logits[i]) for i in range(3)])
  chex.assert_trees_all_close(jax.jit(gather)(logits[0], tokens[0]), eager_lp[0], atol=1e-6)
  chex.assert_trees_all_close(jax.jit(entropy)(logits[0]), eager_ent[0], atol=1e-6)
  chex.assert_trees_all_close(jax.jit(jax.vmap(gather))(logits, tokens), eager_lp, atol=1e-6)
  chex.assert_trees_all_close(jax.jit(jax.vmap(entropy))(logits), eager_ent, atol=1e-6)
  # The temperature may be a traced array (e.g. annealed): same result, one compilation.
  traces = []

  def counted(logits, tokens, temperature):
    traces.append(None)
    return gather_logprobs(logits, tokens, temperature)

  traced = jax.jit(counted)
  for temperature in (0.7, 0.9, 1.3):
    chex.assert_trees_all_close(
        traced(logits[0], tokens[0], jnp.float32(temperature)),
        gather_logprobs(logits[0], tokens[0], temperature=temperature),
        atol=1e-6,
    )
  assert len(traces) == 1
  assert traced._cache_size() == 1


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: gather_logprobs(np.zeros((2, 3)), np.zeros((2, 3), np.int32)), "`logits`"),
        (lambda: gather_logprobs(np.zeros((2, 3, 4)), np.zeros((2,), np.int32)), "`tokens`"),
        (lambda: gather_logprobs(np.zeros((2, 3, 4)), np.zeros((2, 3, 1), np.int32)), "`tokens`"),
        (lambda: gather_logprobs(np.zeros((2, 3, 4)), np.zeros((2, 4), np.int32)), "`logits`"),
        (lambda: gather_logprobs(np.zeros((2, 3, 4)), np.zeros((3, 3), np.int32)), "`tokens`"),
        (
            lambda: gather_logprobs(np.zeros((2, 3, 4)), np.zeros((2, 3), np.int32), 0.0),
            "`temperature`",
        ),
        (
            lambda: gather_logprobs(np.zeros((2, 3, 4)), np.zeros((2, 3), np.int32), -1.0),
            "`temperature`",
        ),
        (lambda: entropy_from_logits(np.zeros((2, 3))), "`logits`"),
        (lambda: entropy_from_logits(np.zeros((2, 3, 4)), temperature=0.0), "`temperature`"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, name):
  with pytest.raises(ValueError, match=name):
    call()
