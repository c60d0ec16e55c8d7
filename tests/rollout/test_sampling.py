"""Property tests for the sampling filters (jax_ppo/rollout/sampling.py)."""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_ppo.core import gather_logprobs
from jax_ppo.rollout import sampling

logits_strategy = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
    # XLA on CPU flushes subnormals to zero, so a subnormal logit ties with 0 there.
    elements=st.floats(-20, 20, width=32, allow_subnormal=False),
)


def _probs(logits):
  return np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)


@given(logits=logits_strategy, temperature=st.floats(0.1, 3.0))
def test_defaults_leave_distribution_unchanged(logits, temperature):
  out = sampling.filter_logits(logits, temperature=temperature, top_k=0, top_p=1.0)
  np.testing.assert_allclose(out, logits / np.float32(temperature), rtol=1e-6, atol=1e-6)


@given(logits=logits_strategy, top_k=st.integers(1, 12))
def test_top_k_keeps_the_k_largest(logits, top_k):
  out = np.asarray(sampling.top_k_filter(logits, top_k))
  kept = np.isfinite(out)
  v = logits.shape[-1]
  kth = np.sort(logits, axis=-1)[:, ::-1][:, min(top_k, v) - 1 : min(top_k, v)]
  np.testing.assert_array_equal(kept, logits >= kth)
  assert (kept.sum(-1) >= min(top_k, v)).all()
  np.testing.assert_array_equal(out[kept], logits[kept])


@given(logits=logits_strategy, top_p=st.floats(0.01, 1.0, exclude_max=True))
def test_top_p_keeps_the_smallest_nucleus(logits, top_p):
  out = np.asarray(sampling.top_p_filter(logits, top_p))
  kept = np.isfinite(out)
  probs = _probs(logits)
  for row in range(logits.shape[0]):
    p = probs[row]
    # Every kept token is at least as likely as every dropped one.
    if (~kept[row]).any():
      assert p[kept[row]].min() >= p[~kept[row]].max() - 1e-7
    # The nucleus reaches the mass (up to float32 rounding), and without its least likely
    # member (ties aside) it would not.
    assert p[kept[row]].sum() >= top_p - 1e-5
    smallest = p[kept[row]].min()
    strictly_more = p[kept[row] & (p > smallest)].sum()
    assert strictly_more < top_p + 1e-5
  assert kept.any(axis=-1).all()


@given(
    logits=logits_strategy,
    top_p=st.floats(0.05, 1.0),
    top_k=st.integers(0, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_sampled_tokens_lie_in_the_filtered_support(logits, top_p, top_k, seed):
  tokens, logprobs = sampling.sample_tokens(
      jax.random.PRNGKey(seed), jnp.asarray(logits), temperature=0.7, top_k=top_k, top_p=top_p
  )
  allowed = np.isfinite(sampling.filter_logits(logits, temperature=0.7, top_k=top_k, top_p=top_p))
  assert allowed[np.arange(len(tokens)), np.asarray(tokens)].all()
  expected = gather_logprobs(logits[:, None], np.asarray(tokens)[:, None], 0.7)[:, 0]
  np.testing.assert_allclose(logprobs, expected, rtol=1e-6, atol=1e-6)


@given(logits=logits_strategy)
def test_greedy_is_argmax(logits):
  tokens, _ = sampling.sample_tokens(jax.random.PRNGKey(0), jnp.asarray(logits), greedy=True)
  np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))


def test_sampling_frequencies_match_the_filtered_distribution():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  draw = jax.jit(
      jax.vmap(functools.partial(sampling.sample_tokens, top_p=0.8), in_axes=(0, None))
  )
  tokens, _ = draw(jax.random.split(jax.random.PRNGKey(1), 20000), logits)
  freq = np.bincount(np.asarray(tokens).ravel(), minlength=4) / tokens.size
  # The nucleus at 0.8 is {0, 1} (0.5 before the second token < 0.8, 0.8 before the third).
  np.testing.assert_allclose(freq, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.015)


@given(
    logits=hnp.arrays(
        np.float32, (3, 9), elements=st.floats(-8, 8, width=32, allow_subnormal=False)
    ),
    masked=hnp.arrays(bool, (3, 9)),
    seed=st.integers(0, 2**31 - 1),
    block=st.sampled_from([1, 2, 4, 128]),
)
def test_categorical_never_draws_a_masked_entry(logits, masked, seed, block):
  masked[np.arange(3), seed % 9] = False  # every row keeps at least one entry
  x = np.where(masked, -np.inf, logits).astype(np.float32)
  tokens = np.asarray(
      sampling.categorical(jax.random.PRNGKey(seed), jnp.asarray(x), block=block)
  )
  assert tokens.dtype == np.int32
  assert ((tokens >= 0) & (tokens < 9)).all()
  assert np.isfinite(x[np.arange(3), tokens]).all()


@pytest.mark.parametrize("block", [2, 4, 128])
def test_categorical_frequencies_match_softmax_including_the_last_entry(block):
  # A chi-square check of the inverse-CDF draw against the exact probabilities, with most of the
  # mass on the last entry (where rounding of `u * total` would overflow the range). Blocks of
  # 2 and 4 split the six entries over several blocks, one of them partly padding.
  p = np.array([0.02, 0.0, 0.08, 0.1, 0.0, 0.8])
  logits = jnp.asarray(np.log(np.where(p > 0, p, 1.0)) + np.where(p > 0, 0.0, -np.inf),
                       jnp.float32)[None]
  n = 40000
  draw = jax.jit(jax.vmap(functools.partial(sampling.categorical, block=block),
                          in_axes=(0, None)))
  tokens = np.asarray(draw(jax.random.split(jax.random.PRNGKey(3), n), logits)).ravel()
  counts = np.bincount(tokens, minlength=6)
  assert counts[1] == counts[4] == 0
  keep = p > 0
  chi2 = np.sum((counts[keep] - n * p[keep]) ** 2 / (n * p[keep]))
  assert chi2 < 16.3  # the 0.999 quantile of chi-square with 3 degrees of freedom


@pytest.mark.parametrize("block", [1, 2, 3, 128])
def test_categorical_uniform_at_the_top_of_its_range_stays_in_range(monkeypatch, block):
  # u * total rounding up to total must still give the last entry of non-zero weight, also when
  # that entry is followed by masked entries in its own block or in later ones.
  monkeypatch.setattr(
      sampling.jax.random, "uniform", lambda key, shape, dtype: jnp.full(shape, 1.0, dtype)
  )
  x = jnp.asarray([[0.0, 1.0, -jnp.inf, -jnp.inf], [0.5, 0.0, 0.0, 2.0]], jnp.float32)
  np.testing.assert_array_equal(
      sampling.categorical(jax.random.PRNGKey(0), x, block=block), [1, 3]
  )


def test_categorical_at_a_large_vocabulary_matches_softmax():
  # GPT-2's vocabulary (50257, not a multiple of the block): frequencies of the likeliest
  # entries against their probabilities, and the far end of the vocabulary is reachable.
  rng = np.random.default_rng(0)
  logits = rng.normal(size=50257).astype(np.float32)
  logits[[7, 30000, 50256]] += 9.0
  p = np.asarray(jax.nn.softmax(jnp.asarray(logits)))
  n = 20000
  draw = jax.jit(jax.vmap(sampling.categorical, in_axes=(0, None)))
  tokens = np.asarray(draw(jax.random.split(jax.random.PRNGKey(4), n), jnp.asarray(logits)[None]))
  freq = np.bincount(tokens.ravel(), minlength=50257) / n
  for i in (7, 30000, 50256):
    assert abs(freq[i] - p[i]) < 4 * np.sqrt(p[i] * (1 - p[i]) / n), (i, freq[i], p[i])


def test_traced_top_p_does_not_recompile():
  f = jax.jit(lambda x, p: sampling.top_p_filter(x, p))
  x = jnp.zeros((2, 5))
  f(x, jnp.float32(0.5))
  f(x, jnp.float32(0.9))
  assert f._cache_size() == 1


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_invalid_parameters_name_the_parameter(kwargs, name):
  with pytest.raises(ValueError, match=name):
    sampling.filter_logits(jnp.zeros((1, 3)), **kwargs)
