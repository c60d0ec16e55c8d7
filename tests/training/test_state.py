"""Tests of jax_ppo.training.state: the guarded optimizer step, the accumulation scan and the
batch order every stage shares, and of the optimizer block (jax_ppo.training.optim)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ppo.training.optim import OptimizerConfig, make_optimizer
from jax_ppo.training.state import (
    accumulate_gradients,
    apply_gradients,
    batch_rows,
    guarded_update,
    init_stage_state,
    microbatches,
)


def _params():
  key = jax.random.PRNGKey(0)
  return {"w": jax.random.normal(key, (3, 4)), "b": jnp.array([0.5, -0.0, 1.0, 2.0])}


def _loss(params, x, y):
  pred = x @ params["w"] + params["b"]
  return jnp.mean((pred - y) ** 2)


def test_guarded_update_equals_the_optax_step_when_finite():
  params = _params()
  tx, _ = make_optimizer(OptimizerConfig(learning_rate=0.1, lr_schedule="constant"), 10)
  opt_state = tx.init(params)
  x, y = jnp.ones((2, 3)), jnp.zeros((2, 4))
  loss, grads = jax.value_and_grad(_loss)(params, x, y)
  new, new_opt, finite, norm = guarded_update(tx, params, opt_state, grads, loss=loss,
                                              lr_scale=jnp.float32(0.5))
  updates, want_opt = tx.update(grads, opt_state, params)
  want = optax.apply_updates(params, jax.tree.map(lambda u: 0.5 * u, updates))
  assert bool(finite) and float(norm) == pytest.approx(float(optax.tree.norm(grads)))
  for a, b in zip(jax.tree.leaves((new, new_opt)), jax.tree.leaves((want, want_opt)),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("bad", ["loss", "grad_nan", "grad_inf"])
def test_guarded_update_skips_a_non_finite_step_bit_for_bit(bad):
  params = _params()
  tx, _ = make_optimizer(OptimizerConfig(learning_rate=0.1), 10)
  grads = jax.tree.map(jnp.ones_like, params)
  loss = jnp.float32(1.0)
  if bad == "loss":
    loss = jnp.float32(jnp.nan)
  else:
    grads["w"] = grads["w"].at[1, 2].set(jnp.nan if bad == "grad_nan" else jnp.inf)
  state = init_stage_state(tx, params)
  new, finite, _ = jax.jit(apply_gradients, static_argnums=1)(state, tx, grads, loss=loss)
  assert not bool(finite) and int(new.step) == 1  # the data clock still advances
  for a, b in zip(jax.tree.leaves((new.params, new.opt_state)),
                  jax.tree.leaves((state.params, state.opt_state)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert str(np.asarray(new.params["b"])[1]) == "-0.0"  # no `x + 0` that would turn -0 into 0


def test_guarded_update_is_a_conditional_not_a_select():
  params = _params()
  tx, _ = make_optimizer(OptimizerConfig(), 10)
  opt_state = tx.init(params)
  fn = lambda p, s, g: guarded_update(tx, p, s, g, loss=jnp.float32(1), lr_scale=jnp.float32(1))
  text = jax.jit(fn).lower(params, opt_state, params).as_text()
  assert "stablehlo.case" in text or "stablehlo.if" in text


@pytest.mark.parametrize("num", [1, 2, 4])
def test_accumulated_gradients_equal_the_whole_batch_gradient(num):
  params = _params()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
  mask = jnp.asarray(rng.random((8, 4)) < 0.7)
  total = jnp.sum(mask)

  def loss(p, xb, yb, mb, n):  # token-sum over the whole batch's token count
    return jnp.sum(jnp.where(mb, (xb @ p["w"] + p["b"] - yb) ** 2, 0.0)) / n

  want_loss, want = jax.value_and_grad(loss)(params, x, y, mask, total)
  grad_fn = lambda p, mb: jax.value_and_grad(loss)(p, *mb, total)
  got_loss, got = accumulate_gradients(grad_fn, params, microbatches((x, y, mask), num))
  assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_microbatches_keep_row_order_and_refuse_uneven_splits():
  x = jnp.arange(24).reshape(6, 4)
  micro = microbatches({"x": x, "none": None}, 3)
  assert micro["x"].shape == (3, 2, 4) and micro["none"] is None
  np.testing.assert_array_equal(micro["x"].reshape(6, 4), x)
  cols = microbatches(x, 2, axis=1)
  assert cols.shape == (2, 6, 2)
  np.testing.assert_array_equal(cols[1], x[:, 2:])
  with pytest.raises(ValueError, match="6 rows cannot be split into 4"):
    microbatches(x, 4)


@settings(max_examples=40, deadline=None)
@given(num_rows=st.integers(1, 23), batch_size=st.integers(1, 9), seed=st.integers(0, 3))
def test_batch_rows_visit_every_row_once_per_epoch(num_rows, batch_size, seed):
  per_epoch = -(-num_rows // batch_size)
  padded = np.concatenate([batch_rows(seed, s, batch_size, num_rows, epoch_end="pad")
                           for s in range(2 * per_epoch)])
  for epoch in (0, 1):
    rows = padded[epoch * per_epoch * batch_size:(epoch + 1) * per_epoch * batch_size]
    assert sorted(rows[rows >= 0].tolist()) == list(range(num_rows))
    assert np.all(rows[num_rows:] == -1)
  steps = -(-2 * num_rows // batch_size)
  stream = np.concatenate([batch_rows(seed, s, batch_size, num_rows) for s in range(steps)])
  for epoch in (0, 1):
    assert sorted(stream[epoch * num_rows:(epoch + 1) * num_rows].tolist()) == list(
        range(num_rows))
    np.testing.assert_array_equal(stream[epoch * num_rows:(epoch + 1) * num_rows],
                                  np.random.default_rng([seed, epoch]).permutation(num_rows))
  if num_rows % batch_size == 0:
    np.testing.assert_array_equal(padded[:len(stream)], stream[:len(padded)])


def test_batch_rows_refuses_an_unknown_epoch_end():
  with pytest.raises(ValueError, match="epoch_end='drop' is invalid"):
    batch_rows(0, 0, 2, 4, epoch_end="drop")


@pytest.mark.parametrize("field,value,fix", [
    ("learning_rate", 0.0, "use a value > 0"),
    ("learning_rate", float("nan"), "use a finite number"),
    ("lr_schedule", "step", "choose one of"),
    ("warmup_steps", -1, "use an int >= 0"),
    ("adam_b2", 1.0, r"use a value in \[0, 1\)"),
    ("adam_eps", 0.0, "use a value > 0"),
    ("weight_decay", -0.1, "use a value >= 0"),
    ("max_grad_norm", 0.0, "use a value > 0 or None"),
])
def test_optimizer_config_names_the_bad_field(field, value, fix):
  with pytest.raises(ValueError, match=f"OptimizerConfig.{field}=.* is invalid: {fix}"):
    OptimizerConfig(**{field: value})


def test_make_optimizer_warms_up_then_decays_to_zero():
  _, linear = make_optimizer(OptimizerConfig(learning_rate=1.0, warmup_steps=2), 6)
  assert [float(linear(s)) for s in range(7)] == pytest.approx(
      [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0])
  _, cosine = make_optimizer(OptimizerConfig(learning_rate=1.0, lr_schedule="cosine"), 4)
  assert float(cosine(2)) == pytest.approx(0.5) and float(cosine(4)) == pytest.approx(0.0)
  _, constant = make_optimizer(OptimizerConfig(learning_rate=0.3, lr_schedule="constant"), 4)
  assert float(constant(3)) == pytest.approx(0.3)
