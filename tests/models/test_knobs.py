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
  loss0, grads0 = _loss_and_grads(models.from_pretrained(path, remat="none"), ids, mask)
  assert float(jnp.abs(grads0["decoder"]["layers"]["q"]["kernel"][...]).max()) > 0
  for kwargs in (dict(), dict(remat="full"), dict(remat="layer", scan_layers=False)):
    loss1, grads1 = _loss_and_grads(models.from_pretrained(path, **kwargs), ids, mask)
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-6)
    for g0, g1 in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads1), strict=True):
      np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), atol=1e-6, rtol=1e-5,
                                 err_msg=str(kwargs))


def _grad_scratch_bytes(remat: str, family: str) -> int:
  """Temporary bytes of the compiled loss-and-gradient program of a 2-layer model whose MLP is
  wide next to its vocabulary (batch 8 x 64 tokens), with `remat`."""
  config = models.ModelConfig(
      model_type=family, vocab_size=32, hidden_size=64, intermediate_size=256, num_layers=2,
      num_heads=4, num_kv_heads=4, head_dim=16, max_position_embeddings=64,
      **(dict(norm_type="layer", activation="gelu_new", gated_mlp=False,
              position_embedding="learned", qkv_bias=True, out_bias=True, mlp_bias=True)
         if family == "gpt2" else {}))
  model = models.CausalLM(config, remat=remat, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  ids = jnp.tile(jnp.arange(64) % 32, (8, 1))

  def loss(state):
    logits = nnx.merge(graphdef, state)(ids[:, :-1])
    return -jnp.mean(gather_logprobs(logits, ids[:, 1:]))

  compiled = jax.jit(jax.grad(loss)).lower(state).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_default_remat_keeps_less_for_the_backward_pass(family):
  """The default ("dots") recomputes each layer's elementwise intermediates (GELU/SwiGLU terms,
  norms, softmax) instead of keeping them: less scratch memory than "none", more than "full"."""
  assert models.DEFAULT_REMAT == "dots"
  assert models.CausalLM.__init__.__kwdefaults__["remat"] == models.DEFAULT_REMAT
  dots, none, full = (_grad_scratch_bytes(r, family) for r in ("dots", "none", "full"))
  assert full < dots < 0.75 * none, (full, dots, none)


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
  """Prefill + one decode step agree between `lax.scan` and unrolled layers, and with the
  uncached forward on the concatenated sequence.

  Both variants run under `jax.jit`, as every caller in the library does. Run eagerly (as this
  test once did), the scanned variant is one compiled XLA computation per scan body while the
  unrolled one dispatches op by op, so float32 rounding differs (fusion, FMA contraction,
  reduction order): 1-2 ulp after layer 0, ~1.3e-6 on O(1) keys after layer 1, above the old
  `atol=1e-6, rtol=1e-7`. Comparisons therefore use a tolerance above float32 rounding (1e-5,
  relative and absolute) yet far below what a wrong weight, layer order, position or cache slot
  produces (see the last assertion). The decoded token is fixed rather than each run's own argmax
  of its prefill logits, so a near-tie broken differently by rounding cannot make the two runs
  decode different tokens.
  """
  _, path = hf_checkpoint("llama3_gqa_tied")
  ids, mask = left_padded_batch()
  nxt = np.array([5, 17, 42], np.int32)

  def decode(scan_layers, tokens):
    model = models.from_pretrained(path, scan_layers=scan_layers)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
      m = nnx.merge(graphdef, state)
      cache = m.init_cache(batch_size=ids.shape[0], max_length=ids.shape[1] + 2)
      prefill_logits, cache = m.prefill(ids, mask, cache)
      step_logits, cache = m.decode_step(tokens, cache)
      full = m(jnp.concatenate([ids, tokens[:, None]], axis=1),
               attention_mask=jnp.concatenate([mask, jnp.ones((ids.shape[0], 1), mask.dtype)], 1))
      return prefill_logits, step_logits, cache, full[:, -1]

    return jax.tree.map(np.asarray, run(state, tokens))

  (p0, l0, c0, f0), (p1, l1, c1, f1) = decode(True, nxt), decode(False, nxt)
  tol = dict(atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(p1, p0, **tol)
  np.testing.assert_allclose(l1, l0, **tol)
  np.testing.assert_allclose(c1.k, c0.k, **tol)
  np.testing.assert_allclose(c1.v, c0.v, **tol)
  for name in ("mask", "slot_positions", "positions", "index"):
    np.testing.assert_array_equal(getattr(c1, name), getattr(c0, name), err_msg=name)
  # Both equal the uncached forward pass on prompt + token.
  np.testing.assert_allclose(l0, f0, **tol)
  np.testing.assert_allclose(l1, f1, **tol)
  # The tolerance is meaningful: another decoded token moves the step logits by far more.
  _, l_other, _, _ = decode(True, nxt + 1)
  assert np.abs(l_other - l0).max() > 1e3 * tol["atol"]
