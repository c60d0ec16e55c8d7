"""Tests of jax_ppo.core.masks: stop-token masks, truncation and position ids."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from core_strategies import batch_shapes, jit_call, masks, permutations
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jax_ppo.core import position_ids_from_mask, response_mask_from_stop_tokens, truncate_after_stop

PAD = 9
VOCAB = 6  # Token ids 0..5; PAD is outside the vocabulary so it is never a stop token.


# ---------------------------------------------------------------- NumPy references


def ref_response_mask(tokens, stop_ids):
  b, t = tokens.shape
  out = np.zeros((b, t), bool)
  for i in range(b):
    for j in range(t):
      out[i, j] = True
      if tokens[i, j] in stop_ids:
        break
  return out


def ref_truncate(tokens, stop_ids, pad):
  mask = ref_response_mask(tokens, stop_ids)
  has_stop = np.array([any(tok in stop_ids for tok in row) for row in tokens])
  return np.where(mask, tokens, pad), mask, has_stop


def ref_position_ids(attention_mask):
  out = np.zeros(attention_mask.shape, np.int64)
  for i, row in enumerate(np.asarray(attention_mask) != 0):
    seen = 0
    for j, real in enumerate(row):
      seen += int(real)
      out[i, j] = max(seen - 1, 0)
  return out


# ---------------------------------------------------------------- strategies


@st.composite
def tokens_and_stops(draw):
  shape = draw(batch_shapes())
  tokens = draw(hnp.arrays(np.int32, shape, elements=st.integers(0, VOCAB - 1)))
  stop_ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3, unique=True))
  return tokens, stop_ids


def _stop_array(stop_ids):
  """Three stop ids, repeating the first: one shape for every draw, so one compilation."""
  return np.asarray(list(stop_ids) + [stop_ids[0]] * (3 - len(stop_ids)), np.int32)


def _truncate(tokens, stop_ids):
  return jit_call(truncate_after_stop, tokens, _stop_array(stop_ids), pad_token_id=PAD)


# ---------------------------------------------------------------- reference agreement


@given(tokens_and_stops())
def test_response_mask_and_truncation_match_numpy_reference(data):
  tokens, stop_ids = data
  mask = jit_call(response_mask_from_stop_tokens, tokens, _stop_array(stop_ids))
  assert mask.dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(mask), ref_response_mask(tokens, stop_ids))
  out_tokens, out_mask, has_stop = _truncate(tokens, stop_ids)
  ref_tokens, ref_mask, ref_has_stop = ref_truncate(tokens, stop_ids, PAD)
  np.testing.assert_array_equal(np.asarray(out_tokens), ref_tokens)
  np.testing.assert_array_equal(np.asarray(out_mask), ref_mask)
  np.testing.assert_array_equal(np.asarray(has_stop), ref_has_stop)
  assert out_tokens.dtype == tokens.dtype


@given(st.data())
def test_position_ids_match_numpy_reference(draw):
  attention_mask = draw.draw(masks(draw.draw(batch_shapes()), dtypes=(np.bool_, np.int32)))
  out = jit_call(position_ids_from_mask, attention_mask)
  assert out.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(out), ref_position_ids(attention_mask))


def test_first_stop_token_is_kept_and_everything_after_is_masked():
  eos, stop = 2, 4
  tokens = np.array(
      [
          [5, 1, 2, 3, 2],  # EOS at 2: kept; the tokens after it (even another EOS) are not.
          [2, 5, 5, 5, 5],  # EOS first.
          [5, 4, 2, 1, 1],  # An extra stop id before the EOS.
          [1, 1, 1, 1, 1],  # No stop token: valid throughout, flagged for the missing-EOS rule.
      ],
      np.int32,
  )
  out_tokens, mask, has_stop = truncate_after_stop(tokens, [eos, stop], pad_token_id=PAD)
  np.testing.assert_array_equal(
      np.asarray(mask),
      [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]],
  )
  np.testing.assert_array_equal(
      np.asarray(out_tokens),
      [[5, 1, 2, PAD, PAD], [2, PAD, PAD, PAD, PAD], [5, 4, PAD, PAD, PAD], [1, 1, 1, 1, 1]],
  )
  np.testing.assert_array_equal(np.asarray(has_stop), [True, True, True, False])
  np.testing.assert_array_equal(
      np.asarray(response_mask_from_stop_tokens(tokens, eos)),
      [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]],
  )


def test_left_padded_positions_start_at_zero():
  mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(
      np.asarray(position_ids_from_mask(mask)),
      [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [0, 1, 2, 2, 2]],
  )


# ---------------------------------------------------------------- invariances


@given(tokens_and_stops(), st.data())
def test_tokens_after_the_first_stop_never_matter_and_rows_permute(data, draw):
  tokens, stop_ids = data
  mask = ref_response_mask(tokens, stop_ids)
  other = draw.draw(hnp.arrays(np.int32, tokens.shape, elements=st.integers(0, VOCAB - 1)))
  rewritten = np.where(mask, tokens, other)
  chex.assert_trees_all_equal(_truncate(rewritten, stop_ids)[:2], _truncate(tokens, stop_ids)[:2])
  perm = draw.draw(permutations(tokens.shape[0]))
  permuted = _truncate(tokens[perm], stop_ids)
  expected = jax.tree.map(lambda x: np.asarray(x)[perm], _truncate(tokens, stop_ids))
  chex.assert_trees_all_equal(permuted, expected)
  # Truncating twice changes nothing more (with PAD outside the stop ids).
  chex.assert_trees_all_equal(_truncate(np.asarray(permuted[0]), stop_ids)[0], permuted[0])


@given(st.data())
def test_positions_of_real_tokens_ignore_left_padding(draw):
  b, t = draw.draw(batch_shapes())
  lengths = draw.draw(hnp.arrays(np.int64, (b,), elements=st.integers(0, t)))
  left = np.arange(t)[None, :] >= (t - lengths)[:, None]
  right = np.arange(t)[None, :] < lengths[:, None]
  pos_left = np.asarray(jit_call(position_ids_from_mask, left))
  pos_right = np.asarray(jit_call(position_ids_from_mask, right))
  for i in range(b):
    np.testing.assert_array_equal(pos_left[i][left[i]], np.arange(lengths[i]))
    np.testing.assert_array_equal(pos_left[i][left[i]], pos_right[i][right[i]])
  perm = draw.draw(permutations(b))
  permuted = jit_call(position_ids_from_mask, left[perm])
  np.testing.assert_array_equal(np.asarray(permuted), pos_left[perm])


# ---------------------------------------------------------------- jit and vmap


def test_jit_and_vmap_match_eager():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB, size=(3, 2, 7)).astype(np.int32)
  attention = rng.random((3, 2, 7)) < 0.7
  fns = {
      "response_mask": functools.partial(response_mask_from_stop_tokens, stop_token_ids=[2, 4]),
      "truncate": functools.partial(truncate_after_stop, stop_token_ids=(2,), pad_token_id=PAD),
  }
  for name, fn in fns.items():
    eager = jax.tree.map(lambda *xs: jnp.stack(xs), *[fn(tokens[i]) for i in range(3)])
    first = jax.tree.map(lambda x: x[0], eager)
    chex.assert_trees_all_equal(jax.jit(fn)(tokens[0]), first, custom_message=name)
    chex.assert_trees_all_equal(jax.jit(jax.vmap(fn))(tokens), eager, custom_message=name)
  eager = jnp.stack([position_ids_from_mask(attention[i]) for i in range(3)])
  chex.assert_trees_all_equal(jax.jit(position_ids_from_mask)(attention[0]), eager[0])
  chex.assert_trees_all_equal(jax.jit(jax.vmap(position_ids_from_mask))(attention), eager)
  # Stop ids may be a traced array argument.
  traced = jax.jit(response_mask_from_stop_tokens)(tokens[0], jnp.array([2, 4]))
  chex.assert_trees_all_equal(traced, fns["response_mask"](tokens[0]))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: response_mask_from_stop_tokens(np.zeros((2,), np.int32), [1]), "`tokens`"),
        (lambda: response_mask_from_stop_tokens(np.zeros((2, 3, 1), np.int32), [1]), "`tokens`"),
        (lambda: response_mask_from_stop_tokens(np.zeros((2, 3), int), []), "`stop_token_ids`"),
        (lambda: truncate_after_stop(np.zeros((3,), np.int32), [1], pad_token_id=0), "`tokens`"),
        (lambda: position_ids_from_mask(np.ones((3,))), "`attention_mask`"),
        (lambda: position_ids_from_mask(np.ones((1, 2, 3))), "`attention_mask`"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, name):
  with pytest.raises(ValueError, match=name):
    call()
