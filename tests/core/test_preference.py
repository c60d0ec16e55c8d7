"""Tests of jax_ppo.core.preference: `dpo_loss` in its sigmoid (DPO, cDPO), IPO and hinge forms
against float64 NumPy references, with gradients, TRL's metric names and bad inputs."""

import jax
import numpy as np
import pytest
from core_strategies import assert_close, assert_f32_scalar, grid_arrays, jit_call
from hypothesis import given
from hypothesis import strategies as st

from jax_ppo.core import DPO_LOSS_TYPES, dpo_loss


def _log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


def _sigmoid(x):
  return np.exp(_log_sigmoid(x))


def ref_dpo(pc, pr, rc, rr, beta, loss_type, eps):
  """`(loss, d loss / d pi_c, d loss / d pi_r)` in float64 (d/d pi_r = -d/d pi_c)."""
  pc, pr, rc, rr = (np.asarray(x, np.float64) for x in (pc, pr, rc, rr))
  h = (pc - rc) - (pr - rr)
  n = h.size
  if loss_type == "sigmoid":
    per = -(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h)
    dh = -(1 - eps) * beta * _sigmoid(-beta * h) + eps * beta * _sigmoid(beta * h)
  elif loss_type == "ipo":
    per = (h - 1 / (2 * beta)) ** 2
    dh = 2 * (h - 1 / (2 * beta))
  else:
    per = np.maximum(0.0, 1 - beta * h)
    dh = np.where(1 - beta * h > 0, -beta, 0.0)
  return per.mean(), dh / n, -dh / n


@st.composite
def pairs(draw):
  b = draw(st.sampled_from((1, 3, 8)))
  arrays = [draw(grid_arrays((b,), lo=-40.0, hi=-1.0, step=0.25)) for _ in range(4)]
  return arrays


def _program(pc, pr, rc, rr, beta, loss_type, label_smoothing):
  def loss_fn(pc, pr):
    return dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type,
                    label_smoothing=label_smoothing)

  (loss, metrics), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(pc, pr)
  return loss, metrics, grads


@given(pairs(), st.sampled_from(DPO_LOSS_TYPES), st.sampled_from((0.05, 0.1, 0.5)),
       st.sampled_from((0.0, 0.1, 0.3)))
def test_dpo_loss_matches_numpy_reference(arrays, loss_type, beta, eps):
  pc, pr, rc, rr = arrays
  eps = eps if loss_type == "sigmoid" else 0.0
  loss, metrics, (g_c, g_r) = jit_call(_program, pc, pr, rc, rr, beta=beta, loss_type=loss_type,
                                       label_smoothing=eps)
  ref_loss, ref_gc, ref_gr = ref_dpo(pc, pr, rc, rr, beta, loss_type, eps)
  assert_f32_scalar(loss)
  assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
  # The hinge's kink: no gradient check where 1 - beta h is within rounding of 0.
  h = (np.float64(pc) - rc) - (np.float64(pr) - rr)
  ok = np.abs(1 - beta * h) > 1e-4 if loss_type == "hinge" else np.ones_like(h, bool)
  assert_close(np.asarray(g_c)[ok], ref_gc[ok], rtol=1e-4, atol=1e-6)
  assert_close(np.asarray(g_r)[ok], ref_gr[ok], rtol=1e-4, atol=1e-6)
  reward_c = beta * (np.float64(pc) - rc)
  reward_r = beta * (np.float64(pr) - rr)
  assert_close(metrics["rewards/chosen"], reward_c.mean(), rtol=1e-5, atol=1e-5)
  assert_close(metrics["rewards/rejected"], reward_r.mean(), rtol=1e-5, atol=1e-5)
  assert_close(metrics["rewards/margins"], (reward_c - reward_r).mean(), rtol=1e-5, atol=1e-5)
  assert_close(metrics["rewards/accuracies"], (reward_c > reward_r).mean(), rtol=1e-6, atol=0)
  assert_close(metrics["logps/chosen"], np.mean(pc), rtol=1e-6)
  assert_close(metrics["logps/rejected"], np.mean(pr), rtol=1e-6)
  for value in metrics.values():
    assert_f32_scalar(value)


def test_no_gradient_reaches_the_reference():
  pc, pr = np.array([-3.0, -5.0], np.float32), np.array([-4.0, -2.0], np.float32)
  rc, rr = np.array([-3.5, -4.0], np.float32), np.array([-4.5, -2.5], np.float32)
  for loss_type in DPO_LOSS_TYPES:
    grads = jax.grad(lambda rc, rr, t=loss_type: dpo_loss(pc, pr, rc, rr, loss_type=t)[0],
                     argnums=(0, 1))(rc, rr)
    assert all(float(np.abs(g).max()) == 0.0 for g in grads)


def test_known_values():
  z = np.zeros(4, np.float32)
  # Policy = reference: margin 0, DPO's loss log 2, IPO's (1 / (2 beta))^2, the hinge's 1.
  assert_close(dpo_loss(z, z, z, z, beta=0.1)[0], np.log(2.0), rtol=1e-6)
  assert_close(dpo_loss(z, z, z, z, beta=0.1, loss_type="ipo")[0], 25.0, rtol=1e-6)
  assert_close(dpo_loss(z, z, z, z, beta=0.1, loss_type="hinge")[0], 1.0, rtol=1e-6)
  # cDPO at a margin far in favour of the chosen response still pays for the flipped label.
  big = np.full(4, 100.0, np.float32)
  loss, metrics = dpo_loss(big, z, z, z, beta=1.0, label_smoothing=0.1)
  assert_close(loss, 0.1 * 100.0, rtol=1e-4)
  assert float(metrics["rewards/accuracies"]) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(beta=0.0), "`beta`"),
        (dict(beta=-1.0), "`beta`"),
        (dict(loss_type="kto"), "`loss_type`"),
        (dict(label_smoothing=0.5), "`label_smoothing`"),
        (dict(label_smoothing=-0.1), "`label_smoothing`"),
        (dict(loss_type="ipo", label_smoothing=0.1), "`label_smoothing`"),
    ],
)
def test_bad_options_raise_naming_the_argument(kwargs, name):
  z = np.zeros(3)
  with pytest.raises(ValueError, match=name):
    dpo_loss(z, z, z, z, **kwargs)


def test_bad_shapes_raise_naming_the_arrays():
  z = np.zeros(3)
  with pytest.raises(ValueError, match="`ref_rejected_logps`"):
    dpo_loss(z, z, z, np.zeros(4))
  with pytest.raises(ValueError, match="`policy_chosen_logps`"):
    dpo_loss(np.zeros((3, 2)), z, z, z)
