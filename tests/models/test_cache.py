"""Prefill + cached single-step decoding reproduces the full forward pass."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo import models
from tests.models.conftest import jit_logits, left_padded_batch

pytest.importorskip("torch", reason="the tiny checkpoints are built with transformers' PyTorch")

FAMILIES = ["gemma2", "gpt2", "llama3_gqa_tied", "mistral_window", "qwen2_window_untied", "qwen3"]


def _continuations(batch, steps, seed=1):
  return np.random.default_rng(seed).integers(3, 100, size=(batch, steps))


@pytest.mark.parametrize(
    ("name", "scan_layers"), [(n, True) for n in FAMILIES] + [("qwen3", False)]
)
def test_cached_decode_equals_full_forward(name, scan_layers, hf_checkpoint):
  _, path = hf_checkpoint(name)
  model = models.from_pretrained(path, scan_layers=scan_layers)
  prompt, prompt_mask = left_padded_batch(seq=6, pads=(0, 2, 4))
  steps = 5
  new = _continuations(3, steps)
  # Row 2 finishes after its second new token: later tokens are padding (valid=False).
  new_valid = np.ones((3, steps), bool)
  new_valid[2, 2:] = False

  full_ids = np.concatenate([prompt, new], axis=1)
  full_mask = np.concatenate([prompt_mask, new_valid.astype(np.int32)], axis=1)
  full = jit_logits(model)(full_ids, full_mask)

  graphdef, state = nnx.split(model)

  @jax.jit
  def run_prefill(state, ids, mask):
    m = nnx.merge(graphdef, state)
    cache = m.init_cache(batch_size=3, max_length=16)
    return m.prefill(ids, mask, cache, all_logits=True)

  @functools.partial(jax.jit, donate_argnums=(2,))
  def run_step(state, tok, cache, valid):
    return nnx.merge(graphdef, state).decode_step(tok, cache, valid=valid)

  logits, cache = run_prefill(state, prompt, prompt_mask)
  np.testing.assert_allclose(
      np.asarray(logits)[prompt_mask.astype(bool)], full[:, :6][prompt_mask.astype(bool)],
      atol=1e-5,
  )
  assert int(cache.index) == 6
  np.testing.assert_array_equal(np.asarray(cache.positions), prompt_mask.sum(1))
  for t in range(steps):
    step_logits, cache = run_step(state, new[:, t], cache, new_valid[:, t])
    rows = new_valid[:, t]
    np.testing.assert_allclose(
        np.asarray(step_logits)[rows], full[:, 6 + t][rows], atol=1e-5,
        err_msg=f"decode step {t}",
    )
  assert int(cache.index) == 6 + steps
  np.testing.assert_array_equal(np.asarray(cache.positions), full_mask.sum(1))


def test_last_token_prefill_logits(hf_checkpoint):
  _, path = hf_checkpoint("qwen2")
  model = models.from_pretrained(path)
  ids, mask = left_padded_batch()
  full = jit_logits(model)(ids, mask)
  logits, cache = model.prefill(ids, mask, model.init_cache(batch_size=3, max_length=12))
  assert logits.shape == (3, models.load_config(path).vocab_size)
  np.testing.assert_allclose(np.asarray(logits), full[:, -1], atol=1e-5)
  assert cache.k.shape == (2, 3, 2, 12, 8)  # [L, B, K, T, Dh]


def test_greedy_generation_in_one_jitted_while_loop(hf_checkpoint):
  """The sampler's pattern: prefill + lax.while_loop over decode steps, cache donated."""
  _, path = hf_checkpoint("llama3_gqa_tied")
  model = models.from_pretrained(path)
  graphdef, state = nnx.split(model)
  prompt, mask = left_padded_batch(seq=6, pads=(0, 2, 4))
  steps = 6

  @functools.partial(jax.jit, donate_argnums=(1,))
  def generate(state, cache, prompt, mask):
    m = nnx.merge(graphdef, state)
    logits, cache = m.prefill(prompt, mask, cache)
    out = jnp.zeros((prompt.shape[0], steps), jnp.int32)

    def body(carry):
      i, logits, cache, out = carry
      tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      out = out.at[:, i].set(tok)
      logits, cache = m.decode_step(tok, cache)
      return i + 1, logits, cache, out

    _, _, cache, out = jax.lax.while_loop(
        lambda c: c[0] < steps, body, (jnp.int32(0), logits, cache, out)
    )
    return out, cache

  cache = models.init_cache(model.config, batch_size=3, max_length=6 + steps)
  out, cache = generate(state, cache, prompt, mask)
  out = np.asarray(out)
  # Reference: one teacher-forced full forward over prompt + generated tokens; greedy decoding
  # means each generated token is the argmax of the full-forward logits one slot earlier.
  ids = np.concatenate([prompt, out], axis=1)
  m = np.concatenate([mask, np.ones_like(out)], axis=1)
  logits = jit_logits(model)(ids, m)
  np.testing.assert_array_equal(logits[:, 5:-1].argmax(-1), out)


def test_cache_rejects_a_prompt_longer_than_itself(hf_checkpoint):
  _, path = hf_checkpoint("qwen2")
  model = models.from_pretrained(path)
  ids, mask = left_padded_batch()
  with pytest.raises(ValueError, match="cannot hold"):
    model.prefill(ids, mask, model.init_cache(batch_size=3, max_length=4))


@pytest.mark.parametrize("name", ["gemma2", "mistral_window"])
def test_decode_over_the_live_prefix_equals_the_full_cache(name, hf_checkpoint):
  """`attend_length = index + 1` (the fewest slots a step may read) gives the logits of the
  full-length read, sliding windows included; a length outside the cache is refused."""
  _, path = hf_checkpoint(name)
  model = models.from_pretrained(path)
  prompt, mask = left_padded_batch(seq=6, pads=(0, 2, 4))
  new = _continuations(3, 5)
  graphdef, state = nnx.split(model)

  @functools.partial(jax.jit, static_argnames=("attend_length",))
  def step(state, tok, cache, attend_length=None):
    return nnx.merge(graphdef, state).decode_step(tok, cache, attend_length=attend_length)

  _, cache = model.prefill(prompt, mask, model.init_cache(batch_size=3, max_length=16))
  for t in range(new.shape[1]):
    full, next_cache = step(state, new[:, t], cache)
    prefix, prefix_cache = step(state, new[:, t], cache, attend_length=7 + t)
    np.testing.assert_allclose(np.asarray(prefix), np.asarray(full), atol=1e-5, rtol=0)
    # Layer 1's keys and values follow layer 0's output: equal but for the summation order.
    for a, b in zip(jax.tree.leaves(prefix_cache), jax.tree.leaves(next_cache), strict=True):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    cache = next_cache
  for bad in (0, 17, 8.0):
    with pytest.raises(ValueError, match="attend_length"):
      model.decode_step(new[:, 0], cache, attend_length=bad)
