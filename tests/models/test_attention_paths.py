"""`layers.attention`'s two paths agree: `jax.nn.dot_product_attention` (full-sequence forward
without soft-capping) and the explicit einsums (soft-capping, the decode cache layout), on
grouped-query heads, padding rows with no visible key and sliding-window masks, values and
gradients. The families' parity with transformers is tests/models/test_parity.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ppo.models import layers
from jax_ppo.models.layers import attention


def _inputs(dtype, b=2, s=7, h=4, k=2, d=8):
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (b, s, h, d), dtype)
  kk = jax.random.normal(keys[1], (b, s, k, d), dtype)
  v = jax.random.normal(keys[2], (b, s, k, d), dtype)
  pos = jnp.arange(s)
  causal = pos[:, None] >= pos[None, :]
  window = (pos[:, None] - pos[None, :]) < 3
  valid = jnp.ones((b, s), bool).at[1, :2].set(False)  # left padding on row 1
  mask = jnp.stack([causal, causal & window])[:, None] & valid[:, None, :]  # [2 kinds, B, S, T]
  mask = mask.at[:, 1, 0].set(False)  # a padding query with no visible key
  return q, kk, v, mask


def _explicit(q, k, v, mask, scale, softcap=None):
  return layers._explicit_attention(q, k, v, mask, scale=scale, softcap=softcap,
                                    heads_first=False)


@pytest.mark.parametrize("kind", [0, 1], ids=["causal+padding", "sliding window"])
def test_fused_equals_explicit_with_gradients(kind):
  q, k, v, masks = _inputs(jnp.float32)
  mask = masks[kind]

  def loss(fn, q, k, v):
    out = fn(q, k, v, mask, 0.35)
    return jnp.sum(out * jnp.cos(out)), out

  fused = lambda q, k, v, m, s: attention(q, k, v, m, scale=s)  # noqa: E731
  (l0, o0), g0 = jax.value_and_grad(lambda *a: loss(_explicit, *a), (0, 1, 2), has_aux=True)(
      q, k, v)
  (l1, o1), g1 = jax.value_and_grad(lambda *a: loss(fused, *a), (0, 1, 2), has_aux=True)(q, k, v)
  np.testing.assert_allclose(o1, o0, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  for a, b in zip(g1, g0, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  # The query with no visible key averages the values uniformly (no NaN).
  np.testing.assert_allclose(o1[1, 0], jnp.repeat(jnp.mean(v[1], axis=0), 2, axis=0),
                             rtol=1e-5, atol=1e-6)


def test_bfloat16_fused_is_close_to_float32():
  q, k, v, masks = _inputs(jnp.float32)
  want = attention(q, k, v, masks[0], scale=0.35)
  got = attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), masks[0], scale=0.35)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2)


def test_softcap_and_decode_layout_take_the_explicit_path():
  q, k, v, masks = _inputs(jnp.float32)
  capped = attention(q, k, v, masks[0], scale=0.35, softcap=0.5)
  np.testing.assert_allclose(capped, _explicit(q, k, v, masks[0], 0.35, softcap=0.5), rtol=1e-6)
  assert not np.allclose(capped, attention(q, k, v, masks[0], scale=0.35), atol=1e-3)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
  got = attention(q, heads_first(k), heads_first(v), masks[0], scale=0.35, heads_first=True)
  np.testing.assert_allclose(got, attention(q, k, v, masks[0], scale=0.35), rtol=1e-5,
                             atol=1e-6)


def test_cudnn_is_chosen_only_for_gpu_half_precision():
  assert layers._fused_implementation(jnp.float32) == "xla"
  expected = "cudnn" if jax.default_backend() == "gpu" else "xla"
  assert layers._fused_implementation(jnp.bfloat16) == expected
