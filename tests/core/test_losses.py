"""Tests of jax_ppo.core.losses: PPO policy and value losses, entropy bonus, aggregation."""

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
    logits_shapes,
    masks,
    permutations,
    seeds,
)
from hypothesis import given
from hypothesis import strategies as st

from jax_ppo.core import aggregate_loss, entropy_bonus, ppo_policy_loss, ppo_value_loss

REDUCTIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm")


# ---------------------------------------------------------------- NumPy float64 references


def ref_row_weights(mask, reduction):
  """`[B, T]` weights w such that the aggregated loss is sum(w * per_token_loss)."""
  m = np.asarray(mask, np.float64)
  w = np.zeros_like(m)
  if reduction == "token-mean":
    return m / m.sum() if m.sum() else w
  if reduction == "token-sum-norm":  # Dr. GRPO: over B x T whatever the valid counts
    return m / m.size
  rows = [i for i in range(m.shape[0]) if m[i].sum() > 0]
  for i in rows:
    w[i] = m[i] / len(rows)
    if reduction == "seq-mean-token-mean":
      w[i] /= m[i].sum()
  return w


def ref_aggregate(loss, mask, reduction):
  valid = np.asarray(mask) != 0
  return float(np.sum(ref_row_weights(mask, reduction) * np.where(valid, loss, 0.0)))


def ref_token_mean(x, mask):
  return ref_aggregate(np.asarray(x, np.float64), mask, "token-mean")


def ref_policy_per_token(logprobs, old_logprobs, advantages, clip_eps, clip_eps_high, dual_clip):
  """Per-token loss, clipped indicator, dual-clip indicator and ratio, in float64."""
  ratio = np.exp(np.asarray(logprobs, np.float64) - np.asarray(old_logprobs, np.float64))
  adv = np.asarray(advantages, np.float64)
  high = clip_eps if clip_eps_high is None else clip_eps_high
  unclipped = -adv * ratio
  clipped = -adv * np.clip(ratio, 1.0 - clip_eps, 1.0 + high)
  loss = np.maximum(unclipped, clipped)
  capped = np.zeros(loss.shape, bool)
  if dual_clip is not None:
    capped = (adv < 0) & (loss > -dual_clip * adv)
    loss = np.where(capped, -dual_clip * adv, loss)
  return loss, clipped > unclipped, capped, ratio


def ref_policy_loss(logprobs, old, adv, mask, clip_eps, clip_eps_high, dual_clip, reduction):
  valid = np.asarray(mask) != 0
  lp = np.where(valid, logprobs, 0.0)
  old = np.where(valid, old, 0.0)
  adv = np.where(valid, adv, 0.0)
  loss, clip_ind, _, ratio = ref_policy_per_token(lp, old, adv, clip_eps, clip_eps_high, dual_clip)
  log_ratio = lp.astype(np.float64) - old
  metrics = {
      "clipfrac": ref_token_mean(clip_ind, mask),
      "approx_kl": ref_token_mean(0.5 * log_ratio**2, mask),
      "ratio_mean": ref_token_mean(ratio, mask),
  }
  return ref_aggregate(loss, mask, reduction), metrics


def ref_policy_grad(logprobs, old, adv, mask, clip_eps, clip_eps_high, dual_clip, reduction):
  """d loss / d logprobs: -A * ratio where the unclipped term is active, 0 where the ratio is
  clipped (or the token capped by the dual clip), scaled by the reduction's weights."""
  valid = np.asarray(mask) != 0
  lp = np.where(valid, logprobs, 0.0)
  old = np.where(valid, old, 0.0)
  adv = np.where(valid, adv, 0.0)
  _, clip_ind, capped, ratio = ref_policy_per_token(
      lp, old, adv, clip_eps, clip_eps_high, dual_clip
  )
  per_token = np.where(clip_ind | capped, 0.0, -adv * ratio)
  return ref_row_weights(mask, reduction) * np.where(valid, per_token, 0.0)


def ref_value_loss(values, old_values, returns, mask, clip_eps, reduction):
  valid = np.asarray(mask) != 0
  v = np.where(valid, values, 0.0).astype(np.float64)
  v_old = np.where(valid, old_values, 0.0).astype(np.float64)
  r = np.where(valid, returns, 0.0).astype(np.float64)
  unclipped = (v - r) ** 2
  if clip_eps is None:
    clipped = unclipped
  else:
    clipped = (np.clip(v, v_old - clip_eps, v_old + clip_eps) - r) ** 2
  loss = 0.5 * np.maximum(unclipped, clipped)
  metrics = {
      "clipfrac": ref_token_mean(clipped > unclipped, mask),
      "value_mean": ref_token_mean(v, mask),
  }
  grad = ref_row_weights(mask, reduction) * np.where(clipped > unclipped, 0.0, v - r)
  return ref_aggregate(loss, mask, reduction), metrics, grad


def ref_entropy(logits, temperature):
  z = np.asarray(logits, np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return -(np.exp(log_p) * log_p).sum(-1)


# ---------------------------------------------------------------- strategies and programs

# Each property test compiles one program per input shape that evaluates both configurations
# (PPO's plain clipping; clip-higher and dual clip) and every reduction, values and gradients,
# so the few shapes drawn are compiled once for all the tests of a loss. `dual_clip=1e30`
# never caps anything and `clip_eps_high=clip_eps` is symmetric clipping: the "full"
# configuration also covers the defaults through the traced code path.
POLICY_CONFIGS = ("plain", "full")
NO_DUAL_CLIP = 1e30


def _config_hparams(hparams, config):
  if config == "plain":
    return {"clip_eps": hparams["clip_eps"], "clip_eps_high": None, "dual_clip": None}
  return dict(hparams)


def _nudge_away(log_ratio, boundaries, margin=2e-3):
  """Moves log-ratios that are within `margin` of a clip boundary to `2 * margin` from it, so
  that float32 and float64 agree on which side of the boundary every token lies."""
  out = np.asarray(log_ratio, np.float64).copy()
  for b in boundaries:
    near = np.abs(out - b) < margin
    out = np.where(near, b + np.where(out >= b, 2 * margin, -2 * margin), out)
  return out


@st.composite
def policy_inputs(draw, inside_clip_range=False):
  shape = draw(batch_shapes())
  clip_eps = draw(st.sampled_from((0.1, 0.2, 0.3)))
  hparams = {
      "clip_eps": clip_eps,
      "clip_eps_high": draw(st.sampled_from((clip_eps, 0.15, 0.28))),
      "dual_clip": draw(st.sampled_from((NO_DUAL_CLIP, 1.5, 3.0))),
  }
  if inside_clip_range:
    log_ratio = draw(grid_arrays(shape, lo=-0.09375, hi=0.09375, step=1 / 64))
  else:
    bounds = [
        np.log(1 - clip_eps),
        np.log(1 + clip_eps),
        np.log(1 + hparams["clip_eps_high"]),
        np.log(hparams["dual_clip"]),
    ]
    log_ratio = _nudge_away(draw(grid_arrays(shape, lo=-1.25, hi=1.25, step=1 / 64)), bounds)
  old = draw(grid_arrays(shape, lo=-4.0, hi=0.0))
  logprobs = (old + log_ratio).astype(np.float32)
  adv = draw(grid_arrays(shape, lo=-2.0, hi=2.0))
  return logprobs, old, adv, draw(masks(shape)), hparams


def _policy_program(logprobs, old, adv, mask, clip_eps, clip_eps_high, dual_clip):
  """`{(config, reduction): (loss, metrics, d loss / d logprobs)}`."""
  hparams = {"clip_eps": clip_eps, "clip_eps_high": clip_eps_high, "dual_clip": dual_clip}
  out = {}
  for config in POLICY_CONFIGS:
    kwargs = _config_hparams(hparams, config)
    for reduction in REDUCTIONS:

      def loss_fn(lp, kwargs=kwargs, reduction=reduction):
        return ppo_policy_loss(lp, old, adv, mask, reduction=reduction, **kwargs)

      (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logprobs)
      out[config, reduction] = (loss, metrics, grad)
  return out


def _policy(logprobs, old, adv, mask, hparams):
  return jit_call(_policy_program, logprobs, old, adv, mask, **hparams)


@st.composite
def value_inputs(draw, inside_clip_range=False):
  shape = draw(batch_shapes())
  clip_eps = draw(st.sampled_from((0.05, 0.1, 0.2, 0.3)))
  values = draw(grid_arrays(shape, lo=-2.0, hi=2.0))
  if inside_clip_range:
    offset = draw(grid_arrays(shape, lo=-clip_eps + 0.01, hi=clip_eps - 0.01, step=1 / 64))
  else:
    # Offsets on a 1/16 grid never equal +-clip_eps, and ties between the clipped and unclipped
    # errors would need 2R - V - V_old = clip_eps, also a multiple of 1/16: neither happens.
    offset = draw(grid_arrays(shape, lo=-0.5, hi=0.5, step=1 / 16))
  old_values = (values + offset).astype(np.float32)
  returns = draw(grid_arrays(shape, lo=-2.0, hi=2.0))
  return values, old_values, returns, draw(masks(shape)), clip_eps


def _value_program(values, old_values, returns, mask, clip_eps):
  """`{(clipped, reduction): (loss, metrics, d loss / d values)}`."""
  out = {}
  for clipped in (True, False):
    for reduction in REDUCTIONS:

      def loss_fn(v, eps=clip_eps if clipped else None, reduction=reduction):
        return ppo_value_loss(v, old_values, returns, mask, clip_eps=eps, reduction=reduction)

      (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(values)
      out[clipped, reduction] = (loss, metrics, grad)
  return out


def _value(values, old_values, returns, mask, clip_eps):
  return jit_call(_value_program, values, old_values, returns, mask, clip_eps=clip_eps)


# ---------------------------------------------------------------- PPO policy loss


@given(policy_inputs())
def test_policy_loss_matches_numpy_reference(data):
  logprobs, old, adv, mask, hparams = data
  out = _policy(logprobs, old, adv, mask, hparams)
  for (config, reduction), (loss, metrics, grad) in out.items():
    kwargs = _config_hparams(hparams, config)
    args = (logprobs, old, adv, mask, *kwargs.values(), reduction)
    msg = f"{config} {reduction}"
    ref_loss, ref_metrics = ref_policy_loss(*args)
    assert_f32_scalar(loss)
    assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, err_msg=msg)
    assert {"clipfrac", "approx_kl", "ratio_mean"} <= set(metrics)
    for value in metrics.values():
      assert_f32_scalar(value)
    for key, value in ref_metrics.items():
      assert_close(metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=f"{msg} {key}")
    assert_close(metrics["policy_loss"], loss, rtol=0, atol=0)
    assert_close(grad, ref_policy_grad(*args), rtol=1e-5, atol=1e-6, err_msg=msg)


@given(policy_inputs(), st.sampled_from(POLICY_CONFIGS))
def test_policy_gradient_is_zero_exactly_where_the_ratio_is_clipped_in_the_advantage_direction(
    data, config
):
  """Zero exactly where the ratio is clipped in the advantage's direction (or the token is
  capped by the dual clip), nonzero on every other valid token with a nonzero advantage."""
  logprobs, old, adv, mask, hparams = data
  out = _policy(logprobs, old, adv, mask, hparams)
  kwargs = _config_hparams(hparams, config)
  low = kwargs["clip_eps"]
  high = low if kwargs["clip_eps_high"] is None else kwargs["clip_eps_high"]
  valid = np.asarray(mask) != 0
  ratio = np.exp(logprobs.astype(np.float64) - old)
  clipped_in_direction = ((adv > 0) & (ratio > 1 + high)) | ((adv < 0) & (ratio < 1 - low))
  capped = np.zeros_like(valid)
  if kwargs["dual_clip"] is not None:
    capped = valid & (adv < 0) & (ratio > kwargs["dual_clip"])
  live = valid & ~clipped_in_direction & ~capped & (adv != 0)
  for reduction in REDUCTIONS:
    grad = np.asarray(out[config, reduction][2])
    assert np.all(grad[valid & (clipped_in_direction | capped)] == 0.0), reduction
    assert np.all(grad[live] != 0.0), reduction
    assert np.all(grad[~valid] == 0.0), reduction
    # The surviving gradient raises the log-probability of tokens with positive advantage.
    assert np.all(np.sign(grad[live]) == -np.sign(adv[live])), reduction
  metrics = out[config, "token-mean"][1]
  assert_close(metrics["dual_clipfrac"], ref_token_mean(capped, mask), atol=1e-6)


@given(policy_inputs())
def test_policy_loss_takes_no_gradient_through_old_logprobs_or_advantages(data):
  """The behaviour log-probs and advantages are data (docstring contract): the gradient with
  respect to them is exactly zero, also when `old_logprobs` is the same traced value as
  `logprobs` (the fused first epoch, where the ratio is 1 but the gradient must not vanish)."""
  logprobs, old, adv, mask, hparams = data
  kwargs = {k: hparams[k] for k in ("clip_eps",)}

  def loss(lp, old_lp, a):
    return ppo_policy_loss(lp, old_lp, a, mask, **kwargs)[0]

  g_old, g_adv = jax.grad(loss, argnums=(1, 2))(logprobs, old, adv)
  assert np.all(np.asarray(g_old) == 0.0)
  assert np.all(np.asarray(g_adv) == 0.0)
  # Same value as both arguments: only the `logprobs` path carries a gradient, which is then
  # -A / N_valid on valid tokens (ratio 1, token-mean), not zero.
  g_same = jax.grad(lambda lp: loss(lp, lp, adv))(logprobs)
  valid = np.asarray(mask) != 0
  expected = np.where(valid, -np.asarray(adv, np.float64) / max(valid.sum(), 1), 0.0)
  assert_close(g_same, expected, rtol=1e-5, atol=1e-7)


@given(policy_inputs(inside_clip_range=True))
def test_policy_loss_is_the_unclipped_surrogate_inside_the_clip_range(data):
  logprobs, old, adv, mask, hparams = data
  out = _policy(logprobs, old, adv, mask, hparams)
  ratio = np.exp(logprobs.astype(np.float64) - old)
  for (config, reduction), (loss, metrics, grad) in out.items():
    msg = f"{config} {reduction}"
    assert_close(loss, ref_aggregate(-adv * ratio, mask, reduction), rtol=1e-5, atol=1e-6)
    assert float(metrics["clipfrac"]) == 0.0, msg
    expected_grad = ref_row_weights(mask, reduction) * np.where(mask != 0, -adv * ratio, 0.0)
    assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7, err_msg=msg)


@given(policy_inputs(), st.data())
def test_policy_loss_ignores_padding_even_nan_and_permutes_with_rows(data, draw):
  logprobs, old, adv, mask, hparams = data
  clean = _policy(logprobs, old, adv, mask, hparams)
  dirty = _policy(
      fill_masked(logprobs, mask, draw.draw(junk(mask.shape))),
      fill_masked(old, mask, draw.draw(junk(mask.shape))),
      fill_masked(adv, mask, draw.draw(junk(mask.shape))),
      mask,
      hparams,
  )
  chex.assert_trees_all_equal(dirty, clean)
  chex.assert_tree_all_finite(clean)
  perm = draw.draw(permutations(mask.shape[0]))
  permuted = _policy(logprobs[perm], old[perm], adv[perm], mask[perm], hparams)
  for key, (loss, metrics, grad) in clean.items():
    p_loss, p_metrics, p_grad = permuted[key]
    assert_close(p_loss, loss, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(p_metrics, metrics, rtol=1e-6, atol=1e-6)
    assert_close(p_grad, np.asarray(grad)[perm], rtol=1e-6, atol=1e-7)


def test_dual_clip_caps_negative_advantage_tokens():
  # A = -1, ratio = e^2 (about 7.4): the PPO term is 7.4, the dual clip caps it at 3.
  lp, old, mask = np.array([[2.0]], np.float32), np.zeros((1, 1), np.float32), np.ones((1, 1))
  adv = np.array([[-1.0]], np.float32)
  loss, metrics = ppo_policy_loss(lp, old, adv, mask, dual_clip=3.0)
  assert_close(loss, 3.0)
  assert_close(metrics["dual_clipfrac"], 1.0)
  assert_close(ppo_policy_loss(lp, old, adv, mask)[0], np.exp(2.0), rtol=1e-6)
  grad = jax.grad(lambda x: ppo_policy_loss(x, old, adv, mask, dual_clip=3.0)[0])(lp)
  assert float(grad[0, 0]) == 0.0
  # Positive advantages are never capped; a ratio below c is not capped either.
  assert_close(ppo_policy_loss(lp, old, -adv, mask, dual_clip=3.0)[0], -1.2)
  assert_close(ppo_policy_loss(lp * 0.5, old, adv, mask, dual_clip=3.0)[0], np.exp(1.0))


def test_clip_eps_high_moves_only_the_upper_bound():
  old, mask = np.zeros((1, 2), np.float32), np.ones((1, 2))
  lp = np.log(np.array([[1.25, 0.75]], np.float32))
  adv = np.array([[1.0, -1.0]], np.float32)
  # Symmetric 0.2: token 0 is clipped at 1.2 (loss -1.2), token 1 at 0.8 (loss 0.8).
  loss, metrics = ppo_policy_loss(lp, old, adv, mask, clip_eps=0.2)
  assert_close(loss, (-1.2 + 0.8) / 2)
  assert_close(metrics["clipfrac"], 1.0)
  # Clip-higher 0.28: token 0 is no longer clipped (-1.25); the lower bound stays at 0.8.
  loss, metrics = ppo_policy_loss(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
  assert_close(loss, (-1.25 + 0.8) / 2)
  assert_close(metrics["clipfrac"], 0.5)


def test_ratio_is_one_and_loss_is_minus_mean_advantage_on_the_first_minibatch():
  rng = np.random.default_rng(0)
  lp = -rng.random((3, 4)).astype(np.float32)
  adv = rng.standard_normal((3, 4)).astype(np.float32)
  mask = np.ones((3, 4), bool)
  loss, metrics = ppo_policy_loss(lp, lp, adv, mask)
  assert_close(loss, -adv.mean(), atol=1e-6)
  assert_close(metrics["ratio_mean"], 1.0)
  assert_close(metrics["approx_kl"], 0.0)
  assert_close(metrics["clipfrac"], 0.0)


# ---------------------------------------------------------------- PPO value loss


@given(value_inputs())
def test_value_loss_matches_numpy_reference(data):
  values, old_values, returns, mask, clip_eps = data
  out = _value(values, old_values, returns, mask, clip_eps)
  valid = np.asarray(mask) != 0
  for (clipped, reduction), (loss, metrics, grad) in out.items():
    eps = clip_eps if clipped else None
    msg = f"clip_eps={eps} {reduction}"
    ref_loss, ref_metrics, ref_grad = ref_value_loss(
        values, old_values, returns, mask, eps, reduction
    )
    assert_f32_scalar(loss)
    assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, err_msg=msg)
    for value in metrics.values():
      assert_f32_scalar(value)
    for key, value in ref_metrics.items():
      assert_close(metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=f"{msg} {key}")
    assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6, err_msg=msg)
    assert np.all(np.asarray(grad)[~valid] == 0.0)
    if clipped:  # The gradient vanishes exactly on the clipped tokens and nowhere else.
      clipped_values = np.clip(values, old_values - clip_eps, old_values + clip_eps)
      is_clipped = valid & ((clipped_values - returns) ** 2 > (values - returns) ** 2)
      assert np.all(np.asarray(grad)[is_clipped] == 0.0)
      assert np.all(np.asarray(grad)[valid & ~is_clipped & (values != returns)] != 0.0)


@given(value_inputs(inside_clip_range=True))
def test_value_loss_is_plain_squared_error_inside_the_clip_range(data):
  values, old_values, returns, mask, clip_eps = data
  out = _value(values, old_values, returns, mask, clip_eps)
  for reduction in REDUCTIONS:
    expected = ref_aggregate(0.5 * (values.astype(np.float64) - returns) ** 2, mask, reduction)
    assert_close(out[True, reduction][0], expected, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(out[True, reduction][0], out[False, reduction][0])
    chex.assert_trees_all_close(out[True, reduction][2], out[False, reduction][2])
    assert float(out[True, reduction][1]["clipfrac"]) == 0.0


@given(value_inputs(), st.data())
def test_value_loss_ignores_padding_even_nan_and_permutes_with_rows(data, draw):
  values, old_values, returns, mask, clip_eps = data
  clean = _value(values, old_values, returns, mask, clip_eps)
  dirty = _value(
      fill_masked(values, mask, draw.draw(junk(mask.shape))),
      fill_masked(old_values, mask, draw.draw(junk(mask.shape))),
      fill_masked(returns, mask, draw.draw(junk(mask.shape))),
      mask,
      clip_eps,
  )
  chex.assert_trees_all_equal(dirty, clean)
  chex.assert_tree_all_finite(clean)
  perm = draw.draw(permutations(mask.shape[0]))
  permuted = _value(values[perm], old_values[perm], returns[perm], mask[perm], clip_eps)
  for key, (loss, metrics, grad) in clean.items():
    assert_close(permuted[key][0], loss, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(permuted[key][1], metrics, rtol=1e-6, atol=1e-6)
    assert_close(permuted[key][2], np.asarray(grad)[perm], rtol=1e-6, atol=1e-7)


def test_value_clipping_known_values():
  old = np.zeros((1, 2), np.float32)
  values = np.array([[1.0, 0.1]], np.float32)
  returns = np.array([[0.0, 1.0]], np.float32)
  mask = np.ones((1, 2))
  # Token 0 moved away from its target (R = 0): the unclipped error 1 exceeds the clipped
  # (0.2 - 0)^2 = 0.04, so it counts. Token 1 stays inside [-0.2, 0.2]: both terms are 0.81.
  loss, metrics = ppo_value_loss(values, old, returns, mask, clip_eps=0.2)
  assert_close(loss, 0.5 * (1.0 + 0.81) / 2)
  assert_close(metrics["clipfrac"], 0.0)
  # A value that moved far towards its target: V_old = 0, V = 0.9, R = 1. The clipped
  # prediction 0.2 is worse, (0.2 - 1)^2 = 0.64 > 0.01, so the loss keeps it (and no gradient).
  args = (np.array([[0.9]]), np.zeros((1, 1)), np.array([[1.0]]), np.ones((1, 1)))
  loss, metrics = ppo_value_loss(*args, clip_eps=0.2)
  assert_close(loss, 0.5 * 0.64)
  assert_close(metrics["clipfrac"], 1.0)
  grad = jax.grad(lambda v: ppo_value_loss(v, *args[1:], clip_eps=0.2)[0])(args[0])
  assert float(grad[0, 0]) == 0.0
  assert_close(ppo_value_loss(*args, clip_eps=None)[0], 0.5 * 0.01)


# ---------------------------------------------------------------- entropy bonus


@st.composite
def entropy_inputs(draw):
  b, t, v = draw(logits_shapes())
  rng = np.random.default_rng(draw(seeds()))
  logits = (3.0 * rng.standard_normal((b, t, v))).astype(np.float32)
  return logits, draw(masks((b, t))), draw(st.sampled_from((0.7, 1.0)))


def _entropy_program(logits, mask, temperature):
  """`{reduction: (entropy, metrics, d entropy / d logits)}`."""
  out = {}
  for reduction in REDUCTIONS:

    def fn(x, reduction=reduction):
      return entropy_bonus(x, mask, temperature=temperature, reduction=reduction)

    (value, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logits)
    out[reduction] = (value, metrics, grad)
  return out


@given(entropy_inputs(), st.data())
def test_entropy_bonus_matches_reference_and_ignores_padding(data, draw):
  logits, mask, temperature = data
  valid = np.asarray(mask) != 0
  out = jit_call(_entropy_program, logits, mask, temperature)
  per_token = ref_entropy(logits, temperature)
  for reduction, (value, metrics, grad) in out.items():
    assert_f32_scalar(value)
    assert_close(value, ref_aggregate(per_token, mask, reduction), rtol=1e-5, atol=1e-5)
    assert_close(metrics["entropy"], value, rtol=0, atol=0)
    assert np.all(np.asarray(grad)[~valid] == 0.0)
    assert float(value) >= 0.0
  # Padding logits never change the value, not even NaN ones; finite ones get no gradient.
  nan_logits = fill_masked(logits, mask, draw.draw(junk(logits.shape)))
  dirty = jit_call(_entropy_program, nan_logits, mask, temperature)
  for reduction, (value, metrics, grad) in out.items():
    chex.assert_trees_all_equal(dirty[reduction][:2], (value, metrics))
    np.testing.assert_array_equal(np.asarray(dirty[reduction][2])[valid], np.asarray(grad)[valid])
  big_logits = fill_masked(logits, mask, draw.draw(junk(logits.shape, nonfinite=False)))
  chex.assert_trees_all_equal(jit_call(_entropy_program, big_logits, mask, temperature), out)
  perm = draw.draw(permutations(mask.shape[0]))
  permuted = jit_call(_entropy_program, logits[perm], mask[perm], temperature)
  for reduction, (value, _, grad) in out.items():
    assert_close(permuted[reduction][0], value, rtol=1e-6, atol=1e-6)
    assert_close(permuted[reduction][2], np.asarray(grad)[perm], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- aggregate_loss


@given(st.data())
def test_aggregate_loss_matches_reference_ignores_padding_and_row_order(draw):
  shape = draw.draw(batch_shapes())
  loss = draw.draw(grid_arrays(shape))
  mask = draw.draw(masks(shape))
  dirty = fill_masked(loss, mask, draw.draw(junk(shape)))
  perm = draw.draw(permutations(shape[0]))
  for reduction in REDUCTIONS:
    out = jit_call(aggregate_loss, loss, mask, reduction=reduction)
    assert_f32_scalar(out)
    assert_close(out, ref_aggregate(loss, mask, reduction), rtol=1e-6, atol=1e-6)
    assert_close(jit_call(aggregate_loss, dirty, mask, reduction=reduction), out, rtol=0, atol=0)
    permuted = jit_call(aggregate_loss, loss[perm], mask[perm], reduction=reduction)
    assert_close(permuted, out, rtol=1e-6, atol=1e-6)


def test_aggregate_loss_known_values_and_empty_rows():
  loss = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], np.float32)
  mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)
  assert_close(aggregate_loss(loss, mask), 7.0 / 3)
  assert_close(aggregate_loss(loss, mask, "token-mean"), 7.0 / 3)
  # The empty third row is left out of the sequence means (not counted as a zero).
  assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean"), (1.5 + 4.0) / 2)
  assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum"), (3.0 + 4.0) / 2)
  # Dr. GRPO: the valid sum over B x T = 9 slots, so a longer response weighs no less per token.
  assert_close(aggregate_loss(loss, mask, "token-sum-norm"), (1.0 + 2.0 + 4.0) / 9)
  for reduction in REDUCTIONS:
    assert_close(aggregate_loss(loss, np.zeros_like(mask), reduction), 0.0)


# ---------------------------------------------------------------- jit and vmap


def _batched_inputs(seed=0, n=2, b=2, t=5, v=4):
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  mask = np.arange(t)[None, None, :] < rng.integers(0, t + 1, size=(n, b, 1))
  mask[-1, -1] = False  # An empty row.
  return f(n, b, t), f(n, b, t), f(n, b, t), mask, f(n, b, t, v)


def test_jit_and_vmap_match_eager():
  """Every loss under `jax.jit` and `jax.vmap` over an extra leading axis, with the
  reductions and options spread over the cases."""
  x, y, z, mask, logits = _batched_inputs()
  lp, old = -np.abs(x), -np.abs(x + 0.3 * y)
  partial = functools.partial
  cases = {
      "policy": (ppo_policy_loss, (lp, old, z, mask)),
      "policy_dual_high": (
          partial(
              ppo_policy_loss, clip_eps=0.1, clip_eps_high=0.28, dual_clip=1.5,
              reduction="seq-mean-token-mean",
          ),
          (lp, old, z, mask),
      ),
      "policy_seq_sum": (
          partial(ppo_policy_loss, reduction="seq-mean-token-sum"), (lp, old, z, mask)
      ),
      "value": (
          partial(ppo_value_loss, clip_eps=0.2, reduction="seq-mean-token-sum"), (x, y, z, mask)
      ),
      "value_unclipped": (partial(ppo_value_loss, clip_eps=None), (x, y, z, mask)),
      "entropy": (
          partial(entropy_bonus, temperature=0.7, reduction="seq-mean-token-mean"),
          (logits, mask),
      ),
      "entropy_default": (entropy_bonus, (logits, mask)),
  }
  for reduction in REDUCTIONS:
    cases[f"aggregate {reduction}"] = (partial(aggregate_loss, reduction=reduction), (x, mask))
  for name, (fn, args) in cases.items():
    eager = [fn(*(a[i] for a in args)) for i in range(len(mask))]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *eager)
    chex.assert_trees_all_close(
        jax.jit(fn)(*(a[0] for a in args)), eager[0], atol=1e-6, custom_message=name
    )
    chex.assert_trees_all_close(
        jax.jit(jax.vmap(fn))(*args), stacked, atol=1e-6, custom_message=name
    )


def test_jitted_policy_update_compiles_once():
  """A jitted loss-and-gradient step called with new data and a traced clip range of the same
  shapes is traced and compiled exactly once."""
  traces = []

  def step(lp, old, adv, mask, clip_eps):
    traces.append(None)
    return jax.value_and_grad(
        lambda x: ppo_policy_loss(x, old, adv, mask, clip_eps=clip_eps), has_aux=True
    )(lp)

  jitted = jax.jit(step)
  for seed, clip_eps in enumerate((0.2, 0.1, 0.3, 0.2)):
    x, y, z, mask, _ = _batched_inputs(seed, n=1)
    lp, old = -np.abs(x[0]), -np.abs(x[0] + 0.1 * y[0])
    (loss, _), _ = jitted(lp, old, z[0], mask[0], clip_eps)
    assert_close(loss, ppo_policy_loss(lp, old, z[0], mask[0], clip_eps=clip_eps)[0], atol=1e-6)
  assert len(traces) == 1
  assert jitted._cache_size() == 1


def test_reductions_are_the_core_tuple():
  from jax_ppo.core import REDUCTIONS as CORE_REDUCTIONS

  assert CORE_REDUCTIONS == REDUCTIONS


# ---------------------------------------------------------------- bad input

_X, _M = np.zeros((2, 3)), np.ones((2, 3))
_LOGITS = np.zeros((2, 3, 4))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: ppo_policy_loss(_X, _X, _X, _M, clip_eps=0.0), "`clip_eps`"),
        (lambda: ppo_policy_loss(_X, _X, _X, _M, clip_eps=-0.2), "`clip_eps`"),
        (lambda: ppo_policy_loss(_X, _X, _X, _M, clip_eps_high=0.0), "`clip_eps_high`"),
        (lambda: ppo_policy_loss(_X, _X, _X, _M, dual_clip=1.0), "`dual_clip`"),
        (lambda: ppo_policy_loss(_X, _X, _X, _M, dual_clip=0.5), "`dual_clip`"),
        (lambda: ppo_policy_loss(_X, _X, _X, _M, reduction="mean"), "`reduction`"),
        (lambda: ppo_policy_loss(_X, _X, np.zeros(2), _M), "`advantages`"),
        (lambda: ppo_policy_loss(_X, np.zeros((2, 4)), _X, _M), "`old_logprobs`"),
        (lambda: ppo_policy_loss(_X, _X, _X, np.ones((3, 2))), "`mask`"),
        (lambda: ppo_policy_loss(np.zeros(3), np.zeros(3), np.zeros(3), np.ones(3)), "`logprobs`"),
        (lambda: ppo_value_loss(_X, _X, _X, _M, clip_eps=0.0), "`clip_eps`"),
        (lambda: ppo_value_loss(_X, _X, _X, _M, clip_eps=-1.0), "`clip_eps`"),
        (lambda: ppo_value_loss(_X, _X, _X, _M, reduction="sum"), "`reduction`"),
        (lambda: ppo_value_loss(_X, _X, np.zeros((2, 4)), _M), "`returns`"),
        (lambda: ppo_value_loss(np.zeros(3), np.zeros(3), np.zeros(3), np.ones(3)), "`values`"),
        (lambda: entropy_bonus(_X, _M), "`logits`"),
        (lambda: entropy_bonus(_LOGITS, np.ones((2, 4))), "`mask`"),
        (lambda: entropy_bonus(_LOGITS, np.ones(2)), "`mask`"),
        (lambda: entropy_bonus(_LOGITS, _M, reduction="token-sum"), "`reduction`"),
        (lambda: entropy_bonus(_LOGITS, _M, temperature=0.0), "`temperature`"),
        (lambda: aggregate_loss(_X, _M, "seq-mean"), "`reduction`"),
        (lambda: aggregate_loss(np.zeros(3), np.ones(3)), "`loss`"),
        (lambda: aggregate_loss(_X, np.ones((2, 4))), "`mask`"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, name):
  with pytest.raises(ValueError, match=name):
    call()
