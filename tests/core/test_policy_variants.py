"""Tests of the GRPO-family policy losses of jax_ppo.core.losses: GSPO's sequence-level ratio and
CISPO's clipped stop-gradient weight, against float64 NumPy references, with their gradients."""

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
from hypothesis import assume, given
from hypothesis import strategies as st
from test_losses import REDUCTIONS, ref_aggregate, ref_row_weights

from jax_ppo.core import cispo_policy_loss, gspo_policy_loss, ppo_policy_loss

# ---------------------------------------------------------------- NumPy float64 references


def ref_gspo(logprobs, old, adv, mask, clip_eps, clip_eps_high):
  """`(loss, metrics, d loss / d logprobs, s)` of GSPO in float64."""
  m = np.asarray(mask, np.float64)
  d = np.where(m != 0, np.asarray(logprobs, np.float64) - np.asarray(old, np.float64), 0.0)
  count = m.sum(1)
  rows = count > 0
  seq = np.where(rows, (d * m).sum(1) / np.where(rows, count, 1.0), 0.0)
  s = np.exp(seq)
  a = np.where(rows, np.asarray(adv, np.float64), 0.0)
  unclipped, clipped = -a * s, -a * np.clip(s, 1 - clip_eps, 1 + clip_eps_high)
  n = rows.sum()
  loss = np.maximum(unclipped, clipped)[rows].mean() if n else 0.0
  # d loss / d logprobs[b, t]: the unclipped term's, -A s m_t / |y_b| / n, unless the clipped
  # term (constant in the log-probs) is the larger.
  active = rows & ~(clipped > unclipped)
  per_row = np.where(active, -a * s / np.where(rows, count, 1.0), 0.0) / max(n, 1)
  grad = per_row[:, None] * m
  metrics = {
      "clipfrac": (clipped > unclipped)[rows].mean() if n else 0.0,
      "approx_kl": ref_aggregate(0.5 * d**2, mask, "token-mean"),
      "ratio_mean": s[rows].mean() if n else 0.0,
  }
  return loss, metrics, grad, s[rows]


def ref_cispo(logprobs, old, adv, mask, clip_eps_low, clip_eps_high, reduction):
  """`(loss, clipfrac, d loss / d logprobs)` of CISPO in float64."""
  valid = np.asarray(mask) != 0
  lp = np.where(valid, np.asarray(logprobs, np.float64), 0.0)
  ratio = np.exp(np.where(valid, lp - np.asarray(old, np.float64), 0.0))
  low = -np.inf if clip_eps_low is None else 1 - clip_eps_low
  w = np.clip(ratio, low, 1 + clip_eps_high)
  a = np.where(valid, np.asarray(adv, np.float64), 0.0)
  loss = ref_aggregate(-w * a * lp, mask, reduction)
  grad = -w * a * ref_row_weights(mask, reduction) * valid
  clipfrac = ref_aggregate((w != ratio).astype(np.float64), mask, "token-mean")
  return loss, clipfrac, grad


@st.composite
def variant_inputs(draw, lo=-0.75, hi=0.75):
  shape = draw(batch_shapes())
  old = draw(grid_arrays(shape, lo=-4.0, hi=0.0))
  logprobs = (old + draw(grid_arrays(shape, lo=lo, hi=hi, step=1 / 64))).astype(np.float32)
  return shape, logprobs, old, draw(masks(shape))


def _gspo(logprobs, old, adv, mask, clip_eps, clip_eps_high):
  def loss_fn(lp):
    return gspo_policy_loss(lp, old, adv, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high)

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logprobs)
  return loss, metrics, grad


def _cispo(logprobs, old, adv, mask, clip_eps_low, clip_eps_high, reduction):
  def loss_fn(lp):
    return cispo_policy_loss(lp, old, adv, mask, clip_eps_low=clip_eps_low,
                             clip_eps_high=clip_eps_high, reduction=reduction)

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logprobs)
  return loss, metrics, grad


# ---------------------------------------------------------------- GSPO


@given(variant_inputs(), st.data())
def test_gspo_matches_numpy_reference(inputs, data):
  shape, logprobs, old, mask = inputs
  adv = data.draw(grid_arrays(shape[:1], lo=-2.0, hi=2.0))
  clip_eps, clip_eps_high = data.draw(st.sampled_from(((3e-4, 4e-4), (0.1, 0.2), (0.2, 0.2))))
  ref_loss, ref_metrics, ref_grad, s = ref_gspo(logprobs, old, adv, mask, clip_eps, clip_eps_high)
  # Which side of a clip bound a ratio lies on is ill-defined within float32 rounding of it.
  assume(np.all(np.abs(s - (1 - clip_eps)) > 1e-5) and np.all(np.abs(s - (1 + clip_eps_high))
                                                                > 1e-5))
  loss, metrics, grad = jit_call(_gspo, logprobs, old, adv, mask, clip_eps=clip_eps,
                                 clip_eps_high=clip_eps_high)
  assert_f32_scalar(loss)
  assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
  for key, value in ref_metrics.items():
    assert_close(metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
  assert_close(metrics["policy_loss"], loss, rtol=0, atol=0)
  assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


@given(variant_inputs(), st.data())
def test_gspo_ignores_padding_even_nan_and_permutes_with_rows(inputs, data):
  shape, logprobs, old, mask = inputs
  adv = data.draw(grid_arrays(shape[:1], lo=-2.0, hi=2.0))
  dirty_lp = fill_masked(logprobs, mask, data.draw(junk(shape)))
  dirty_old = fill_masked(old, mask, data.draw(junk(shape)))
  kwargs = dict(clip_eps=0.1, clip_eps_high=0.2)
  clean = jit_call(gspo_policy_loss, logprobs, old, adv, mask, **kwargs)
  dirty = jit_call(gspo_policy_loss, dirty_lp, dirty_old, adv, mask, **kwargs)
  jax.tree.map(lambda a, b: assert_close(a, b, rtol=0, atol=0), clean, dirty)
  perm = data.draw(permutations(shape[0]))
  permuted = jit_call(gspo_policy_loss, logprobs[perm], old[perm], adv[perm], mask[perm],
                      **kwargs)
  jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-6, atol=1e-6), clean, permuted)


def test_gspo_ratio_is_length_normalised():
  # A response and the same response twice as long, each token's log-ratio the same: one ratio
  # per sequence, exp(mean), not exp(sum), so both get the same clipped loss.
  old = np.full((2, 4), -1.0, np.float32)
  logprobs = old + 0.05
  mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool)
  adv = np.array([1.0, 1.0], np.float32)
  _, metrics = gspo_policy_loss(logprobs, old, adv, mask, clip_eps=0.2, clip_eps_high=0.2)
  assert_close(metrics["ratio_mean"], np.exp(0.05), rtol=1e-6)
  assert_close(metrics["ratio_var"], 0.0, atol=1e-10)


def test_gspo_equals_ppo_on_one_token_sequences():
  # With one valid token per row the sequence ratio is the token ratio: GSPO is PPO with the
  # sequence-mean reduction.
  rng = np.random.default_rng(0)
  old = rng.uniform(-3, -0.1, (5, 3)).astype(np.float32)
  logprobs = (old + rng.uniform(-0.5, 0.5, (5, 3))).astype(np.float32)
  mask = np.zeros((5, 3), bool)
  mask[np.arange(5), rng.integers(0, 3, 5)] = True
  adv = rng.normal(size=5).astype(np.float32)
  gspo, g_metrics = gspo_policy_loss(logprobs, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
  ppo, p_metrics = ppo_policy_loss(logprobs, old, np.repeat(adv[:, None], 3, 1), mask,
                                   clip_eps=0.2, clip_eps_high=0.28,
                                   reduction="seq-mean-token-mean")
  assert_close(gspo, ppo, rtol=1e-6, atol=1e-7)
  assert_close(g_metrics["clipfrac"], p_metrics["clipfrac"], rtol=0, atol=0)


def test_gspo_rows_without_tokens_are_left_out():
  old = np.zeros((2, 3), np.float32)
  mask = np.array([[1, 1, 0], [0, 0, 0]], bool)
  loss, _ = gspo_policy_loss(old, old, np.array([2.0, 100.0], np.float32), mask)
  assert_close(loss, -2.0, rtol=1e-6)  # ratio 1: -A of the one row with tokens


# ---------------------------------------------------------------- CISPO


@given(variant_inputs(lo=-1.25, hi=1.25), st.data())
def test_cispo_matches_numpy_reference(inputs, data):
  shape, logprobs, old, mask = inputs
  adv = data.draw(grid_arrays(shape, lo=-2.0, hi=2.0))
  low = data.draw(st.sampled_from((None, 0.2)))
  high = data.draw(st.sampled_from((0.2, 0.28)))
  for reduction in REDUCTIONS:
    ref_loss, ref_clipfrac, ref_grad = ref_cispo(logprobs, old, adv, mask, low, high, reduction)
    loss, metrics, grad = jit_call(_cispo, logprobs, old, adv, mask, clip_eps_low=low,
                                   clip_eps_high=high, reduction=reduction)
    assert_f32_scalar(loss)
    assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, err_msg=reduction)
    assert_close(metrics["clipfrac"], ref_clipfrac, rtol=1e-6, atol=1e-6, err_msg=reduction)
    assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6, err_msg=reduction)


def test_cispo_keeps_the_gradient_of_tokens_ppo_clips():
  # A token whose ratio left the trust region in the advantage's direction: PPO's gradient is 0
  # there, CISPO's is the clipped weight times the advantage.
  old = np.array([[-1.0, -1.0]], np.float32)
  logprobs = np.array([[-0.5, -1.0]], np.float32)  # ratio e^0.5 ~ 1.65 on the first token
  adv = np.ones((1, 2), np.float32)
  mask = np.ones((1, 2), bool)
  ppo_grad = jax.grad(lambda lp: ppo_policy_loss(lp, old, adv, mask)[0])(logprobs)
  cispo_grad = jax.grad(lambda lp: cispo_policy_loss(lp, old, adv, mask)[0])(logprobs)
  assert float(ppo_grad[0, 0]) == 0.0
  assert_close(cispo_grad, [[-1.2 / 2, -1.0 / 2]], rtol=1e-6)


def test_cispo_lower_bound_only_when_asked():
  old = np.zeros((1, 1), np.float32)
  logprobs = np.full((1, 1), np.log(0.5), np.float32)  # ratio 0.5
  adv, mask = np.ones((1, 1), np.float32), np.ones((1, 1), bool)
  g = lambda low: jax.grad(  # noqa: E731
      lambda lp: cispo_policy_loss(lp, old, adv, mask, clip_eps_low=low)[0])(logprobs)
  assert_close(g(None), [[-0.5]], rtol=1e-6)  # unbounded below: the weight is the ratio
  assert_close(g(0.2), [[-0.8]], rtol=1e-6)  # clipped up to 1 - 0.2


def test_jit_and_vmap_match_eager():
  rng = np.random.default_rng(1)
  lp = rng.normal(size=(2, 3, 4)).astype(np.float32) - 2
  old = lp + rng.normal(scale=0.1, size=lp.shape).astype(np.float32)
  mask = rng.random((2, 3, 4)) < 0.7
  adv_seq = rng.normal(size=(2, 3)).astype(np.float32)
  adv_tok = np.repeat(adv_seq[..., None], 4, -1)
  for fn, adv in ((gspo_policy_loss, adv_seq), (cispo_policy_loss, adv_tok)):
    batched = jax.jit(jax.vmap(fn))(lp, old, adv, mask)
    for i in range(2):
      eager = fn(lp[i], old[i], adv[i], mask[i])
      jax.tree.map(lambda a, b, i=i: assert_close(a[i], b, rtol=1e-6, atol=1e-6), batched, eager)


_X, _M, _A = np.zeros((2, 3)), np.ones((2, 3)), np.zeros(2)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: gspo_policy_loss(_X, _X, _X, _M), "`advantages`"),
        (lambda: gspo_policy_loss(_X, _X, np.zeros(3), _M), "`advantages`"),
        (lambda: gspo_policy_loss(_X, _X, _A, _M, clip_eps=0.0), "`clip_eps`"),
        (lambda: gspo_policy_loss(_X, _X, _A, _M, clip_eps_high=-1.0), "`clip_eps_high`"),
        (lambda: gspo_policy_loss(_X, np.zeros((2, 4)), _A, _M), "`old_logprobs`"),
        (lambda: gspo_policy_loss(np.zeros(3), np.zeros(3), _A, np.ones(3)), "`logprobs`"),
        (lambda: cispo_policy_loss(_X, _X, _A, _M), "`advantages`"),
        (lambda: cispo_policy_loss(_X, _X, _X, _M, clip_eps_low=0.0), "`clip_eps_low`"),
        (lambda: cispo_policy_loss(_X, _X, _X, _M, clip_eps_high=0.0), "`clip_eps_high`"),
        (lambda: cispo_policy_loss(_X, _X, _X, _M, reduction="sum"), "`reduction`"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, name):
  with pytest.raises(ValueError, match=name):
    call()


def test_float_mask_weights_and_bfloat16_inputs():
  # bfloat16 inputs give float32 outputs equal to the float32 computation on the same values.
  rng = np.random.default_rng(2)
  old = jnp.asarray(rng.uniform(-3, -0.5, (2, 4)), jnp.bfloat16)
  lp = jnp.asarray(np.asarray(old, np.float32) + 0.125, jnp.bfloat16)
  mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], np.float32)
  for fn, adv in ((gspo_policy_loss, np.ones(2, np.float32)),
                  (cispo_policy_loss, np.ones((2, 4), np.float32))):
    loss, _ = fn(lp, old, adv, mask)
    want, _ = fn(np.asarray(lp, np.float32), np.asarray(old, np.float32), adv, mask)
    assert loss.dtype == jnp.float32
    assert_close(loss, want, rtol=1e-6, atol=1e-7)
