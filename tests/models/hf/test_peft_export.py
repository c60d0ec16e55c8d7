"""save_peft_adapter -> `peft.PeftModel.from_pretrained` on the transformers base model gives our
LoRA model's logits, and PEFT's merge equals our merged export (tiny random models, float32)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jax_ppo import models
from jax_ppo.models.hf import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_peft_adapter
from jax_ppo.models.layers import LORA_TARGETS
from tests.models.conftest import hf_logits, jit_logits, left_padded_batch

torch = pytest.importorskip("torch", reason="PEFT runs on transformers' PyTorch models")
peft = pytest.importorskip("peft", reason="the export is checked by loading it with peft")

# family -> (rank, alpha, targets): every projection on the Llama family; on GPT-2 a fused c_attn
# with a gap (q and v, not k: rank 2 r there, a rank_pattern entry) and both c_proj modules.
CASES = {
    "llama2": (4, 8.0, LORA_TARGETS),
    "qwen2": (2, 3.0, ("q", "k", "v", "o")),
    "gemma2": (4, 4.0, ("q", "v", "gate", "down")),
    "gpt2": (3, 5.0, ("q", "v", "o", "up", "down")),
}


def randomize_adapters_(model, *, seed: int) -> None:
  """Non-zero `A` and `B` for every adapter (a fresh `B` is zero: the export would be vacuous)."""
  rng = np.random.default_rng(seed)
  for name in LORA_TARGETS:
    lin = getattr(model.decoder.layers, name, None)
    if lin is None or lin.lora_a is None:
      continue
    for param in (lin.lora_a, lin.lora_b):
      param[...] = jnp.asarray(rng.normal(0.0, 0.3, param.shape), param.dtype)


def _lora_model(path, name):
  rank, alpha, targets = CASES[name]
  model = models.from_pretrained(path)
  models.add_lora(model, models.LoRAConfig(rank=rank, alpha=alpha, targets=targets),
                  rngs=nnx.Rngs(0))
  randomize_adapters_(model, seed=1)
  return model


def _hf_base(path):
  import transformers

  return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("name", list(CASES))
def test_peft_loads_our_adapters_with_our_logits(name, hf_checkpoint, tmp_path):
  _, path = hf_checkpoint(name)
  model = _lora_model(path, name)
  ids, mask = left_padded_batch()
  valid = mask.astype(bool)
  ours = jit_logits(model)(ids, mask)
  graphdef, state = nnx.split(model)
  base = np.asarray(nnx.merge(graphdef, state)(ids, attention_mask=mask, use_lora=False))
  assert np.abs(ours - base)[valid].max() > 0.05  # the adapters change the logits

  out = str(tmp_path / "adapter")
  save_peft_adapter(model, out, base_model=path)
  assert sorted(os.listdir(out)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
  peft_model = peft.PeftModel.from_pretrained(_hf_base(path), out).eval()
  np.testing.assert_allclose(hf_logits(peft_model, ids, mask)[valid], ours[valid], atol=1e-4)

  # PEFT's merge equals our merged export.
  merged_dir = str(tmp_path / "merged")
  models.save_pretrained(model, merged_dir)
  merged = hf_logits(_hf_base(merged_dir), ids, mask)
  np.testing.assert_allclose(merged[valid], ours[valid], atol=1e-4)
  peft_merged = hf_logits(peft_model.merge_and_unload().eval(), ids, mask)
  np.testing.assert_allclose(peft_merged[valid], merged[valid], atol=1e-4)


def test_llama_names_shapes_and_config(hf_checkpoint, tmp_path):
  _, path = hf_checkpoint("llama2")
  model = _lora_model(path, "llama2")
  save_peft_adapter(model, str(tmp_path), base_model=path)
  config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
  assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
  assert (config["r"], config["lora_alpha"], config["bias"]) == (4, 8, "none")
  assert config["fan_in_fan_out"] is False and config["base_model_name_or_path"] == path
  assert sorted(config["target_modules"]) == sorted(
      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
  assert config["rank_pattern"] == {} and config["alpha_pattern"] == {}
  tensors = load_file(str(tmp_path / ADAPTER_WEIGHTS))
  assert len(tensors) == 2 * 7 * model.config.num_layers
  q = model.decoder.layers.q
  a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
  b = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
  assert a.shape == (4, q.in_features) and b.shape == (q.out_features, 4)
  np.testing.assert_array_equal(a, np.asarray(q.lora_a[...])[1].T)
  np.testing.assert_array_equal(b, np.asarray(q.lora_b[...])[1].T)


def test_gpt2_fuses_qkv_into_c_attn(hf_checkpoint, tmp_path):
  _, path = hf_checkpoint("gpt2")
  model = _lora_model(path, "gpt2")  # q and v adapted, rank 3, alpha 5
  save_peft_adapter(model, str(tmp_path))
  config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
  assert config["fan_in_fan_out"] is True and config["base_model_name_or_path"] is None
  assert sorted(config["target_modules"]) == ["attn.c_proj", "c_attn", "c_fc", "mlp.c_proj"]
  assert (config["r"], config["lora_alpha"]) == (3, 5)
  assert config["rank_pattern"] == {"c_attn": 6} and config["alpha_pattern"] == {"c_attn": 10}
  tensors = load_file(str(tmp_path / ADAPTER_WEIGHTS))
  d = model.config.hidden_size
  b = tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"]  # [3 D, 2 r]
  assert b.shape == (3 * d, 6)
  np.testing.assert_array_equal(b[d:2 * d], 0.0)  # no k adapter
  np.testing.assert_array_equal(b[:d, 3:], 0.0)  # q's columns read q's rank only
  np.testing.assert_array_equal(b[:d, :3], np.asarray(model.decoder.layers.q.lora_b[...])[0].T)


def test_refuses_a_model_without_adapters(hf_checkpoint, tmp_path):
  _, path = hf_checkpoint("qwen2")
  with pytest.raises(ValueError, match="has no LoRA adapters"):
    save_peft_adapter(models.from_pretrained(path), str(tmp_path / "a"))
  assert not os.path.exists(tmp_path / "a")


def test_refuses_a_scalar_model(hf_checkpoint, tmp_path):
  _, path = hf_checkpoint("qwen2", seq_cls=True)
  model = models.load_scalar_model(path)
  models.add_lora(model, models.LoRAConfig(rank=2), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="ScalarModel"):
    save_peft_adapter(model, str(tmp_path / "a"))
