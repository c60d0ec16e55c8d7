"""Logit parity with Hugging Face PyTorch on tiny random models of every supported family."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo import models
from tests.models.conftest import FAMILIES, hf_logits, jit_logits, left_padded_batch

pytest.importorskip("torch", reason="parity tests compare against transformers' PyTorch models")

ATOL = 1e-4


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_match_hf_with_left_padding(name, hf_checkpoint):
  hf, path = hf_checkpoint(name)
  model = models.from_pretrained(path)
  ids, mask = left_padded_batch()
  ref = hf_logits(hf, ids, mask)
  out = np.asarray(jax.jit(lambda i, m: model(i, attention_mask=m))(ids, mask))
  assert out.shape == ref.shape and out.dtype == np.float32
  valid = mask.astype(bool)
  diff = np.abs(out - ref)[valid].max()
  print(f"{name}: max |logit diff| = {diff:.2e} (logit std {ref[valid].std():.2f})")
  assert diff < ATOL
  assert ref[valid].std() > 0.3  # The reference is not degenerate.


def test_config_fields_reach_the_model(hf_checkpoint):
  _, path = hf_checkpoint("llama3_gqa_tied")
  config = models.load_config(path)
  assert config.num_kv_heads == 2 and config.num_heads == 4
  assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
  assert config.tie_word_embeddings
  _, path = hf_checkpoint("qwen3")
  config = models.load_config(path)
  assert config.head_dim == 16 and config.q_size == 64 and config.hidden_size == 32
  assert config.qk_norm
  _, path = hf_checkpoint("qwen2_window_untied")
  config = models.load_config(path)
  assert config.sliding_layers == (False, True) and config.sliding_window == 3


def test_sharded_checkpoint_loads(hf_checkpoint):
  hf, path = hf_checkpoint("qwen2", max_shard_size="20KB")
  import os

  files = os.listdir(path)
  assert "model.safetensors.index.json" in files
  assert sum(f.endswith(".safetensors") for f in files) > 1
  model = models.from_pretrained(path)
  ids, mask = left_padded_batch()
  ref = hf_logits(hf, ids, mask)
  out = jit_logits(model)(ids, mask)
  assert np.abs(out - ref)[mask.astype(bool)].max() < ATOL


def test_unrolled_layers_and_remat_match_scan(hf_checkpoint):
  _, path = hf_checkpoint("llama2")
  ids, mask = left_padded_batch()
  base = jit_logits(models.from_pretrained(path))(ids, mask)
  variants = (dict(scan_layers=False), dict(remat="layer"), dict(remat="dots", scan_layers=False))
  for kwargs in variants:
    out = jit_logits(models.from_pretrained(path, **kwargs))(ids, mask)
    np.testing.assert_allclose(out, base, atol=1e-5)


def test_bfloat16_load_is_close_and_typed(hf_checkpoint):
  hf, path = hf_checkpoint("qwen3")
  model = models.from_pretrained(path, dtype=jnp.bfloat16)
  assert model.decoder.layers.q.kernel.dtype == jnp.bfloat16
  mixed = models.from_pretrained(path, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  assert mixed.decoder.layers.q.kernel.dtype == jnp.float32
  ids, mask = left_padded_batch()
  ref = hf_logits(hf, ids, mask)
  for m in (model, mixed):
    out = jax.jit(lambda i, k, m=m: m(i, attention_mask=k))(ids, mask)
    assert out.dtype == jnp.bfloat16
    err = np.abs(np.asarray(out, np.float32) - ref)[mask.astype(bool)].max()
    assert err < 0.1 * np.abs(ref).max()


def test_padding_does_not_change_valid_logits(hf_checkpoint):
  """The same sequence with more left padding gives the same logits on its tokens."""
  _, path = hf_checkpoint("gpt2")
  model = models.from_pretrained(path)
  ids, mask = left_padded_batch(batch=1, pads=(0,))
  padded = np.concatenate([np.zeros((1, 4), ids.dtype), ids], axis=1)
  padded_mask = np.concatenate([np.zeros((1, 4), mask.dtype), mask], axis=1)
  fwd = jit_logits(model)
  a = fwd(ids, mask)
  b = fwd(padded, padded_mask)[:, 4:]
  np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("name, dropout", [
    ("gpt2", dict(resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)),
    ("llama2", dict(attention_dropout=0.2)),
])
def test_dropout_in_config_json_is_ignored_even_in_a_jitted_grad(name, dropout, hf_checkpoint):
  """docs/rlhf_details.md item 14: a config.json with nonzero dropout probabilities loads, and
  the forward pass of training (inside a jitted `jax.grad`) has no dropout: repeated calls give
  identical logits and gradients, equal to Hugging Face's logits in evaluation mode."""
  import torch

  hf, path = hf_checkpoint(name, **dropout)
  saved = json.loads(pathlib.Path(path, "config.json").read_text())
  assert {k: saved[k] for k in dropout} == dropout
  model = models.from_pretrained(path)
  assert not any(isinstance(node, nnx.Dropout) for _, node in nnx.iter_graph(model))
  assert not jax.tree.leaves(nnx.state(model, nnx.RngState))  # no RNG stream to drop with

  ids, mask = left_padded_batch()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  weights = np.random.default_rng(1).normal(size=(*ids.shape, hf.config.vocab_size))
  weights = jnp.asarray(weights * mask[..., None], jnp.float32)

  def loss(p, ids, mask):
    logits = nnx.merge(graphdef, p, rest)(ids, attention_mask=mask)
    return jnp.sum(logits * weights), logits

  grad_fn = jax.jit(jax.grad(loss, has_aux=True))
  grads, logits = grad_fn(params, ids, mask)
  grads2, logits2 = grad_fn(params, ids, mask)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits2))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), grads,
               grads2)
  valid = mask.astype(bool)
  ref = hf_logits(hf, ids, mask)  # evaluation mode: no dropout
  assert np.abs(np.asarray(logits) - ref)[valid].max() < ATOL
  # The probabilities are live in transformers: its training mode drops and changes the logits.
  hf.train()
  try:
    torch.manual_seed(0)
    dropped = hf_logits(hf, ids, mask)
  finally:
    hf.eval()
  assert np.abs(dropped - ref)[valid].max() > 1e-2
