"""Performance knobs change speed and memory, never values: remat policies and unrolled layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo import models
from jax_ppo.core import gather_logprobs
from tests.models.conftest import left_padded_batch

pytest.importorskip("torch", reason="the tiny checkpoints are built with transformers' PyTorch")


def _loss_and_grads(model, ids, mask):
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state):
    def loss(state):
      logits = nnx.merge(graphdef, state)(ids[:, :-1], attention_mask=mask[:, :-1])
      lp = gather_logprobs(logits, ids[:, 1:])
      return -jnp.sum(lp * mask[:, 1:]) / jnp.sum(mask[:, 1:])

    return jax.value_and_grad(loss)(state)

  return run(state)


def test_gradients_do_not_depend_on_remat_or_unrolling(hf_checkpoint):
  _, path = hf_checkpoint("qwen3")
  ids, mask = left_padded_batch()
  loss0, grads0 = _loss_and_grads(models.from_pretrained(path), ids, mask)
  assert float(jnp.abs(grads0["decoder"]["layers"]["q"]["kernel"][...]).max()) > 0
  for kwargs in (dict(remat="dots"), dict(remat="layer", scan_layers=False)):
    loss1, grads1 = _loss_and_grads(models.from_pretrained(path, **kwargs), ids, mask)
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-6)
    for g0, g1 in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads1), strict=True):
      np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), atol=1e-6, rtol=1e-5,
                                 err_msg=str(kwargs))


def test_bad_remat_policy_is_rejected(hf_checkpoint):
  _, path = hf_checkpoint("qwen3")
  with pytest.raises(ValueError, match="remat"):
    models.from_pretrained(path, remat="sometimes")


def test_layer_loop_switches_split_graphs_and_restores_the_model(hf_checkpoint):
  _, path = hf_checkpoint("qwen3")
  model = models.from_pretrained(path)  # scan_layers=True
  ids, mask = left_padded_batch()
  with models.layer_loop(model, False) as same:
    assert same is model and model.decoder.scan_layers is False
    unrolled_graphdef, state = nnx.split(model)
  assert model.decoder.scan_layers is True
  with models.layer_loop(model, None):
    assert model.decoder.scan_layers is True
  scanned_graphdef, _ = nnx.split(model)
  forward = jax.jit(lambda g, s: nnx.merge(g, s)(ids, attention_mask=mask), static_argnums=0)
  np.testing.assert_allclose(forward(unrolled_graphdef, state), forward(scanned_graphdef, state),
                             atol=1e-5, rtol=1e-5)
  # Restored even when the block raises.
  with pytest.raises(RuntimeError), models.layer_loop(model, False):
    raise RuntimeError
  assert model.decoder.scan_layers is True


def test_cached_decode_is_the_same_scanned_or_unrolled(hf_checkpoint):
  _, path = hf_checkpoint("llama3_gqa_tied")
  ids, mask = left_padded_batch()

  def decode(scan_layers):
    model = models.from_pretrained(path, scan_layers=scan_layers)
    cache = model.init_cache(batch_size=ids.shape[0], max_length=ids.shape[1] + 2)
    logits, cache = model.prefill(ids, mask, cache)
    nxt = jnp.argmax(logits, axis=-1)
    step_logits, cache = model.decode_step(nxt, cache)
    return np.asarray(step_logits), np.asarray(cache.k)

  (l0, k0), (l1, k1) = decode(True), decode(False)
  np.testing.assert_allclose(l1, l0, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(k1, k0, atol=1e-6)
