"""save_pretrained -> transformers round trips (single file, shards, bf16)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo import models
from tests.models.conftest import hf_config, hf_logits, jit_logits, left_padded_batch

torch = pytest.importorskip("torch", reason="round trips are checked with transformers' PyTorch")


def _hf_load(path):
  import transformers

  return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("name", ["gpt2", "llama3_gqa_tied", "qwen2_window_untied", "qwen3"])
def test_save_then_transformers_loads_same_logits(name, hf_checkpoint, tmp_path):
  hf, path = hf_checkpoint(name)
  model = models.from_pretrained(path)
  out_dir = str(tmp_path / "saved")
  models.save_pretrained(model, out_dir)
  assert {"config.json", "generation_config.json", "model.safetensors"} <= set(os.listdir(out_dir))
  reloaded = _hf_load(out_dir)
  ids, mask = left_padded_batch()
  valid = mask.astype(bool)
  ours = jit_logits(model)(ids, mask)
  np.testing.assert_allclose(hf_logits(reloaded, ids, mask)[valid], ours[valid], atol=1e-4)
  np.testing.assert_allclose(hf_logits(hf, ids, mask)[valid], ours[valid], atol=1e-4)


def test_randomly_initialised_model_round_trips_sharded(tmp_path):
  import transformers

  config = models.config.config_from_hf(hf_config("llama2"))
  model = models.CausalLM(config, rngs=nnx.Rngs(3))
  out_dir = str(tmp_path / "sharded")
  models.save_pretrained(model, out_dir, max_shard_size="30KB")
  files = os.listdir(out_dir)
  assert "model.safetensors.index.json" in files and "model.safetensors" not in files
  ids, mask = left_padded_batch()
  valid = mask.astype(bool)
  ours = jit_logits(model)(ids, mask)
  hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
  np.testing.assert_allclose(hf_logits(hf, ids, mask)[valid], ours[valid], atol=1e-4)
  again = jit_logits(models.from_pretrained(out_dir))(ids, mask)
  np.testing.assert_array_equal(again, ours)


def test_bf16_save_writes_bf16(hf_checkpoint, tmp_path):
  _, path = hf_checkpoint("qwen2")
  model = models.from_pretrained(path, dtype=jnp.bfloat16)
  models.save_pretrained(model, str(tmp_path))
  hf = _hf_load(str(tmp_path))
  assert next(hf.parameters()).dtype == torch.bfloat16
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["architectures"] == ["Qwen2ForCausalLM"]
