"""`core.chunked_logprobs` gives the numbers of `gather_logprobs` / `entropy_from_logits` on the
whole logits, values and gradients, for any chunk size (1, dividing T, not dividing T, >= T)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ppo.core import chunked_logprobs, entropy_from_logits, gather_logprobs

B, T, D, V = 2, 7, 6, 11


def _problem(seed):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  hidden = jax.random.normal(k[0], (B, T, D))
  w = 2.0 * jax.random.normal(k[1], (D, V))
  bias = jax.random.normal(k[2], (V,))
  tokens = jax.random.randint(k[3], (B, T), 0, V)
  return hidden, {"w": w, "b": bias}, tokens


def _head(params):
  return lambda h: jnp.dot(h, params["w"]) + params["b"]


def _loss_full(hidden, params, tokens, temperature, entropy_grad):
  logits = _head(params)(hidden)
  lp = gather_logprobs(logits, tokens, temperature)
  src = logits if entropy_grad else jax.lax.stop_gradient(logits)
  ent = entropy_from_logits(src, temperature)
  return jnp.sum(lp * jnp.arange(1.0, T + 1)) + 0.3 * jnp.sum(ent), (lp, ent)


def _loss_chunked(hidden, params, tokens, temperature, entropy_grad, chunk):
  lp, ent = chunked_logprobs(hidden, _head(params), tokens, temperature, chunk_size=chunk,
                             entropy="grad" if entropy_grad else "no_grad")
  return jnp.sum(lp * jnp.arange(1.0, T + 1)) + 0.3 * jnp.sum(ent), (lp, ent)


def _close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), chunk=st.sampled_from((1, 3, 7, 16)),
       temperature=st.sampled_from((0.7, 1.0)), entropy_grad=st.booleans())
def test_chunked_equals_unchunked_values_and_gradients(seed, chunk, temperature, entropy_grad):
  hidden, params, tokens = _problem(seed)
  grad = jax.jit(jax.value_and_grad(_loss_full, argnums=(0, 1), has_aux=True),
                 static_argnums=(4,))
  grad_c = jax.jit(jax.value_and_grad(_loss_chunked, argnums=(0, 1), has_aux=True),
                   static_argnums=(4, 5))
  (loss, outs), grads = grad(hidden, params, tokens, temperature, entropy_grad)
  (loss_c, outs_c), grads_c = grad_c(hidden, params, tokens, temperature, entropy_grad, chunk)
  _close(outs_c, outs)
  np.testing.assert_allclose(float(loss_c), float(loss), rtol=1e-6)
  _close(grads_c, grads)


def test_without_entropy_and_no_grad_entropy():
  hidden, params, tokens = _problem(0)
  lp, ent = chunked_logprobs(hidden, _head(params), tokens, chunk_size=3, entropy=None)
  assert ent is None
  _close(lp, gather_logprobs(_head(params)(hidden), tokens))
  # "no_grad": the entropy term contributes nothing to the gradient.
  g = jax.grad(lambda p: jnp.sum(chunked_logprobs(hidden, _head(p), tokens, chunk_size=3,
                                                  entropy="no_grad")[1]))(params)
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(g))


def test_chunks_never_hold_the_whole_logits():
  """The compiled program's largest buffer is a chunk's logits, not `[B, T, V]`."""
  b, t, d, v = 2, 64, 8, 4096
  hidden = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
  w = jax.ShapeDtypeStruct((d, v), jnp.float32)
  tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)

  def loss(hidden, w, tokens, chunk):
    if chunk is None:
      logits = jnp.dot(hidden, w)
      return jnp.sum(gather_logprobs(logits, tokens)) + jnp.sum(entropy_from_logits(logits))
    lp, ent = chunked_logprobs(hidden, lambda h: jnp.dot(h, w), tokens, chunk_size=chunk)
    return jnp.sum(lp) + jnp.sum(ent)

  def temp_bytes(chunk):
    fn = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)
    return fn.lower(hidden, w, tokens, chunk).compile().memory_analysis().temp_size_in_bytes

  full, chunked = temp_bytes(None), temp_bytes(8)
  assert full >= b * t * v * 4  # the unchunked program holds the whole float32 logits
  assert chunked < full / 4, (chunked, full)


@pytest.mark.parametrize("bad", [
    dict(chunk_size=0), dict(chunk_size=2.0), dict(chunk_size=2, entropy="yes"),
])
def test_bad_arguments_name_the_argument(bad):
  hidden, params, tokens = _problem(0)
  with pytest.raises(ValueError, match="chunk_size|entropy"):
    chunked_logprobs(hidden, _head(params), tokens, **bad)


def test_mismatched_shapes_are_refused():
  hidden, params, tokens = _problem(0)
  with pytest.raises(ValueError, match="disagree"):
    chunked_logprobs(hidden, _head(params), tokens[:, :3], chunk_size=2)
