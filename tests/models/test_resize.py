"""resize_token_embeddings: new rows are the mean, old tokens keep their logits, tied heads stay
tied, and the resized model round-trips through save_pretrained, from_pretrained and
transformers."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo import models
from tests.models.conftest import VOCAB, hf_logits, jit_logits, left_padded_batch

torch = pytest.importorskip("torch", reason="round trips are checked with transformers' PyTorch")

NEW = VOCAB + 3


@pytest.mark.parametrize("name", ["gpt2", "llama2"])  # tied and untied heads
def test_new_rows_are_the_mean_and_old_logits_are_unchanged(name, hf_checkpoint):
  _, path = hf_checkpoint(name)
  model = models.from_pretrained(path)
  ids, mask = left_padded_batch()
  before = jit_logits(model)(ids, mask)
  emb0 = np.asarray(model.decoder.embed.embedding[...])
  tied = model.config.tie_word_embeddings
  head0 = None if tied else np.asarray(model.lm_head.kernel[...])

  assert models.resize_token_embeddings(model, NEW) is model
  emb = np.asarray(model.decoder.embed.embedding[...])
  assert emb.shape == (NEW, emb0.shape[1]) and emb.dtype == emb0.dtype
  np.testing.assert_array_equal(emb[:VOCAB], emb0)
  np.testing.assert_allclose(emb[VOCAB:], np.broadcast_to(emb0.mean(0), (3, emb0.shape[1])),
                             rtol=1e-6, atol=1e-7)
  assert (model.lm_head is None) == tied
  if not tied:
    head = np.asarray(model.lm_head.kernel[...])
    assert head.shape == (head0.shape[0], NEW)
    np.testing.assert_array_equal(head[:, :VOCAB], head0)
    np.testing.assert_allclose(head[:, VOCAB:], np.repeat(head0.mean(1, keepdims=True), 3, 1),
                               rtol=1e-6, atol=1e-7)
  assert model.config.vocab_size == NEW and model.decoder.config.vocab_size == NEW
  assert json.loads(model.config.source_config)["vocab_size"] == NEW

  after = jit_logits(model)(ids, mask)
  assert after.shape == (*before.shape[:2], NEW)
  valid = mask.astype(bool)
  np.testing.assert_allclose(after[..., :VOCAB][valid], before[valid], atol=1e-6, rtol=1e-6)
  # A new token's logit is the mean of the old logits (h . mean(W)).
  np.testing.assert_allclose(after[..., VOCAB][valid], before[valid].mean(-1), atol=1e-5)
  # The new ids are valid inputs now: finite logits, and prompts using them run.
  with_new = ids.copy()
  with_new[:, -1] = VOCAB + 2
  assert np.isfinite(jit_logits(model)(with_new, mask)).all()


def test_resized_model_round_trips_through_save_and_transformers(hf_checkpoint, tmp_path):
  import transformers

  _, path = hf_checkpoint("llama2")  # untied head
  model = models.resize_token_embeddings(models.from_pretrained(path), NEW)
  out = str(tmp_path / "resized")
  models.save_pretrained(model, out)
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["vocab_size"] == NEW
  ids, mask = left_padded_batch()
  ids[0, -1] = NEW - 1  # a new token inside the batch
  valid = mask.astype(bool)
  ours = jit_logits(model)(ids, mask)
  again = models.from_pretrained(out)
  assert again.config.vocab_size == NEW
  np.testing.assert_array_equal(jit_logits(again)(ids, mask), ours)
  hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert hf.get_input_embeddings().weight.shape[0] == NEW
  np.testing.assert_allclose(hf_logits(hf, ids, mask)[valid], ours[valid], atol=1e-4)


def test_tied_model_stays_tied_through_transformers(hf_checkpoint, tmp_path):
  import transformers

  _, path = hf_checkpoint("gpt2")
  model = models.resize_token_embeddings(models.from_pretrained(path), NEW)
  models.save_pretrained(model, str(tmp_path))
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  assert hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
  ids, mask = left_padded_batch()
  ids[1, -1] = NEW - 2
  valid = mask.astype(bool)
  np.testing.assert_allclose(hf_logits(hf, ids, mask)[valid], jit_logits(model)(ids, mask)[valid],
                             atol=1e-4)


def test_scalar_model_and_bad_sizes(hf_checkpoint):
  _, path = hf_checkpoint("qwen2")
  rm = models.load_scalar_model(path)
  graphdef, state = nnx.split(rm)
  ids, mask = left_padded_batch()
  score = jax.jit(lambda s, i, m: nnx.merge(graphdef, s).score(i, m))
  before = np.asarray(score(state, ids, mask))
  models.resize_token_embeddings(rm, NEW)
  assert rm.decoder.embed.embedding.shape == (NEW, rm.config.hidden_size)
  graphdef, state = nnx.split(rm)
  score = jax.jit(lambda s, i, m: nnx.merge(graphdef, s).score(i, m))
  np.testing.assert_allclose(np.asarray(score(state, ids, mask)), before, rtol=1e-6, atol=1e-6)
  models.resize_token_embeddings(rm, NEW)  # same size: nothing changes
  assert rm.config.vocab_size == NEW
  with pytest.raises(ValueError, match="only grows"):
    models.resize_token_embeddings(rm, VOCAB)
  with pytest.raises(ValueError, match="must be an int"):
    models.resize_token_embeddings(rm, float(NEW + 1))


def test_resize_keeps_parameter_dtype(hf_checkpoint):
  _, path = hf_checkpoint("qwen3")
  model = models.from_pretrained(path, dtype=jnp.bfloat16)
  models.resize_token_embeddings(model, NEW)
  assert model.decoder.embed.embedding[...].dtype == jnp.bfloat16
