"""Tests of jax_ppo.core.importance: rollout-correction weights (truncated and masked, per token
and per sequence) against a float64 NumPy reference; padding, gradients and overflow."""

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
)
from hypothesis import given
from hypothesis import strategies as st

from jax_ppo.core import CORRECTION_LEVELS, CORRECTION_MODES, rollout_correction_weights


def ref_weights(logprobs, sampler, mask, cap, level, mode):
  valid = np.asarray(mask) != 0
  log_w = np.where(valid, np.float64(logprobs) - np.float64(sampler), 0.0)
  if level == "sequence":
    log_w = np.repeat(log_w.sum(1, keepdims=True), log_w.shape[1], 1)
  w = np.exp(log_w)
  out = np.minimum(w, cap) if mode == "truncate" else (w <= cap).astype(np.float64)
  return np.where(valid, out, 0.0), log_w


@given(st.data())
def test_weights_match_numpy_reference_and_ignore_padding(data):
  shape = data.draw(batch_shapes())
  sampler = data.draw(grid_arrays(shape, lo=-4.0, hi=0.0))
  logprobs = (sampler + data.draw(grid_arrays(shape, lo=-1.0, hi=1.0, step=1 / 64))).astype(
      np.float32)
  mask = data.draw(masks(shape))
  cap = data.draw(st.sampled_from((1.5, 2.0, 5.0)))
  dirty = fill_masked(logprobs, mask, data.draw(junk(shape)))
  for level in CORRECTION_LEVELS:
    for mode in CORRECTION_MODES:
      want, log_w = ref_weights(logprobs, sampler, mask, cap, level, mode)
      got = jit_call(rollout_correction_weights, logprobs, sampler, mask, cap=cap, level=level,
                     mode=mode)
      assert got.dtype == jnp.float32 and got.shape == shape
      near = np.abs(log_w - np.log(cap)) < 1e-5  # which side of the cap: float32 rounding
      ok = ~near if mode == "mask" else np.ones(shape, bool)
      assert_close(np.asarray(got)[ok], want[ok], rtol=1e-5, atol=1e-6, err_msg=f"{level} {mode}")
      again = jit_call(rollout_correction_weights, dirty, sampler, mask, cap=cap, level=level,
                       mode=mode)
      assert_close(again, got, rtol=0, atol=0)


def test_equal_log_probs_give_the_mask():
  lp = np.array([[-1.0, -2.0, -3.0], [-0.5, -0.1, 7.0]], np.float32)
  mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
  for level in CORRECTION_LEVELS:
    for mode in CORRECTION_MODES:
      w = rollout_correction_weights(lp, lp, mask, level=level, mode=mode)
      np.testing.assert_array_equal(np.asarray(w), mask.astype(np.float32))


def test_sequence_level_is_the_product_of_token_ratios_and_does_not_overflow():
  sampler = np.zeros((2, 4), np.float32)
  lp = np.array([[0.1, 0.1, 0.1, 0.0], [100.0, 100.0, 100.0, 100.0]], np.float32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
  w = rollout_correction_weights(lp, sampler, mask, cap=2.0, level="sequence")
  assert_close(w[0], [np.exp(0.3)] * 3 + [0.0], rtol=1e-6)
  assert_close(w[1], [2.0] * 4, rtol=1e-6)  # exp(400) overflows float32; the cap does not
  masked = rollout_correction_weights(lp, sampler, mask, cap=2.0, level="sequence", mode="mask")
  assert_close(masked, [[1, 1, 1, 0], [0, 0, 0, 0]], rtol=0, atol=0)


def test_no_gradient_flows_through_the_weights():
  sampler = np.full((2, 3), -1.0, np.float32)
  lp = np.array([[-0.5, -1.5, -1.0], [-2.0, -0.2, -1.0]], np.float32)
  mask = np.ones((2, 3), bool)
  for level in CORRECTION_LEVELS:
    g = jax.grad(lambda x, lv=level: rollout_correction_weights(x, sampler, mask, level=lv).sum()
                 )(lp)
    assert float(np.abs(g).max()) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(cap=0.0), "`cap`"),
        (dict(level="batch"), "`level`"),
        (dict(mode="clip"), "`mode`"),
    ],
)
def test_bad_options_raise_naming_the_argument(kwargs, name):
  x = np.zeros((2, 3))
  with pytest.raises(ValueError, match=name):
    rollout_correction_weights(x, x, np.ones((2, 3)), **kwargs)


def test_bad_shapes_raise_naming_the_arrays():
  x = np.zeros((2, 3))
  with pytest.raises(ValueError, match="`sampler_logprobs`"):
    rollout_correction_weights(x, np.zeros((2, 4)), np.ones((2, 3)))
  with pytest.raises(ValueError, match="`logprobs`"):
    rollout_correction_weights(np.zeros(3), np.zeros(3), np.ones(3))
