"""LoRA adapters: zero-initialised B is the base, the reference is use_lora=False, merging."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo import models
from tests.models.conftest import hf_logits, jit_logits, left_padded_batch

pytest.importorskip("torch", reason="the tiny checkpoints are built with transformers' PyTorch")

ALL = ("q", "k", "v", "o", "gate", "up", "down")


def _forward(graphdef):
  """`fwd(lora, base, ids, mask, use_lora=True) -> logits` through one jitted function."""
  fn = jax.jit(
      lambda lora, base, ids, mask, use_lora: nnx.merge(graphdef, lora, base)(
          ids, attention_mask=mask, use_lora=use_lora),
      static_argnames="use_lora",
  )
  return lambda lora, base, ids, mask, use_lora=True: np.asarray(
      fn(lora, base, ids, mask, use_lora=use_lora)
  )


def _perturb_b(lora_state, seed=0):
  """Random adapters (B != 0) so that the update is visible."""
  leaves, treedef = jax.tree.flatten(lora_state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
      treedef,
      [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)],
  )


def test_zero_b_equals_base_and_reference_switch(hf_checkpoint, tmp_path):
  hf, path = hf_checkpoint("qwen3")
  model = models.from_pretrained(path)
  targets = ALL
  models.add_lora(model, models.LoRAConfig(rank=4, alpha=8.0, targets=targets),
                  rngs=nnx.Rngs(0))
  assert models.has_lora(model)
  graphdef, lora, base = models.split_lora(model)
  lora_leaves = jax.tree.leaves(lora)
  assert len(lora_leaves) == 2 * len(targets)
  assert not any(isinstance(v, nnx.LoRAParam) for v in jax.tree.leaves(
      base, is_leaf=lambda x: isinstance(x, nnx.Variable)))
  assert model.decoder.layers.q.lora_a.shape == (2, 32, 4)
  ids, mask = left_padded_batch()
  valid = mask.astype(bool)
  fwd = _forward(graphdef)
  ref = hf_logits(hf, ids, mask)
  np.testing.assert_allclose(fwd(lora, base, ids, mask)[valid], ref[valid], atol=1e-4)

  trained = _perturb_b(lora)
  adapted = fwd(trained, base, ids, mask)
  reference = fwd(trained, base, ids, mask, use_lora=False)
  assert np.abs(adapted - ref)[valid].max() > 1e-2
  np.testing.assert_allclose(reference[valid], ref[valid], atol=1e-4)

  # Merging folds the adapters in; save_pretrained writes merged weights transformers loads.
  model_trained = nnx.merge(graphdef, trained, base)
  merged = models.merge_lora(model_trained)
  assert not models.has_lora(merged) and models.has_lora(model_trained)
  merged_logits = jit_logits(merged)(ids, mask)
  np.testing.assert_allclose(merged_logits[valid], adapted[valid], atol=1e-4)
  models.save_pretrained(model_trained, str(tmp_path))
  import transformers

  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  np.testing.assert_allclose(hf_logits(reloaded, ids, mask)[valid], adapted[valid], atol=1e-4)


def test_gradients_reach_only_the_adapters(hf_checkpoint):
  _, path = hf_checkpoint("llama3_gqa_tied")
  model = models.from_pretrained(path)
  models.add_lora(model, models.LoRAConfig(rank=2, alpha=2.0, targets=("q", "v", "down")),
                  rngs=nnx.Rngs(1))
  graphdef, lora, base = models.split_lora(model)
  ids, mask = left_padded_batch()

  @jax.jit
  def grads(lora, base):
    def loss(lora):
      logits = nnx.merge(graphdef, lora, base)(ids, attention_mask=mask)
      return jnp.mean(jnp.where(mask[..., None] > 0, logits, 0.0) ** 2)

    return jax.grad(loss)(lora)

  g = grads(lora, base)
  b_grad = g["decoder"]["layers"]["q"]["lora_b"][...]
  a_grad = g["decoder"]["layers"]["q"]["lora_a"][...]
  assert b_grad.shape == (2, 2, 32) and float(jnp.abs(b_grad).max()) > 0
  assert float(jnp.abs(a_grad).max()) == 0  # B = 0 blocks the gradient of A at init.


def test_lora_config_validation(hf_checkpoint):
  with pytest.raises(ValueError, match="targets"):
    models.LoRAConfig(targets=("qkv",))
  with pytest.raises(ValueError, match="rank"):
    models.LoRAConfig(rank=0)
  _, path = hf_checkpoint("gpt2")
  model = models.from_pretrained(path)
  with pytest.raises(ValueError, match="gate"):
    models.add_lora(model, models.LoRAConfig(targets=("gate",)), rngs=nnx.Rngs(0))
  models.add_lora(model, models.LoRAConfig(targets=("q",)), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="already"):
    models.add_lora(model, models.LoRAConfig(targets=("q",)), rngs=nnx.Rngs(0))
