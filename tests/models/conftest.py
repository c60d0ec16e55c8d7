"""Tiny random Hugging Face models, built locally with transformers and CPU torch.

Every family the package supports gets a 2-layer model with hidden size 32-64 and a ~100-300
token vocabulary; its weights are redrawn with larger scales than transformers' init (and norm
scales away from 1, biases away from 0) so that logits have O(1) spread and a wrong mapping shows.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

VOCAB = 160

# name -> (transformers config class name, kwargs)
FAMILIES = {
    "gemma2": (
        "Gemma2Config",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
             query_pre_attn_scalar=12, sliding_window=4, attn_logit_softcapping=3.0,
             final_logit_softcapping=2.0),
    ),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "gpt2_untied": (
        "GPT2Config",
        dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=False),
    ),
    "llama2": (
        "LlamaConfig",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False),
    ),
    "llama3_gqa_tied": (
        "LlamaConfig",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
             rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=16)),
    ),
    "llama_bias": (
        "LlamaConfig",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, max_position_embeddings=64, attention_bias=True,
             mlp_bias=True),
    ),
    "mistral_window": (
        "MistralConfig",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, sliding_window=4,
             tie_word_embeddings=False),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True),
    ),
    "qwen2_window_untied": (
        "Qwen2Config",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
             use_sliding_window=True, sliding_window=3, max_window_layers=1),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
             tie_word_embeddings=True),
    ),
}


def hf_config(name: str, **overrides):
  import transformers

  cls_name, kwargs = FAMILIES[name]
  kwargs = dict(kwargs, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, **overrides)
  return getattr(transformers, cls_name)(**kwargs)


def randomize_(module, *, seed: int = 0, std: float = 0.15) -> None:
  """Redraws every parameter: norm scales ~ N(1, 0.1), everything else ~ N(0, std)."""
  import torch

  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
      if "norm" in name or ".ln_" in name or name.endswith(("ln_f.weight",)):
        p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
      else:
        p.copy_(std * noise)


def build_hf(name: str, *, seq_cls: bool = False, seed: int = 0, **overrides):
  """A tiny random transformers model of family `name` (eval mode, fp32)."""
  torch = pytest.importorskip("torch", reason="torch is needed to build reference HF models")
  import transformers

  torch.manual_seed(seed)
  config = hf_config(name, **overrides)
  if seq_cls:
    config.num_labels = 1
    config.pad_token_id = 0
    model = transformers.AutoModelForSequenceClassification.from_config(config)
  else:
    model = transformers.AutoModelForCausalLM.from_config(config)
  randomize_(model, seed=seed)
  return model.eval()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
  """`hf_checkpoint(name, **kw) -> (hf_model, path)`; cached per (name, kw) for the session."""
  cache = {}

  def make(name: str, *, seq_cls: bool = False, max_shard_size=None, **overrides):
    key = (name, seq_cls, max_shard_size, tuple(sorted(overrides.items())))
    if key not in cache:
      model = build_hf(name, seq_cls=seq_cls, **overrides)
      path = str(tmp_path_factory.mktemp(name))
      kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
      model.save_pretrained(path, **kwargs)
      cache[key] = (model, path)
    return cache[key]

  return make


def left_padded_batch(*, batch: int = 3, seq: int = 9, seed: int = 0, pads=(0, 3, 5)):
  """Random ids `[B, S]` and a left-padding mask with `pads[b]` pad slots on row `b`."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, VOCAB, size=(batch, seq))
  mask = np.ones((batch, seq), np.int32)
  for b, p in enumerate(pads[:batch]):
    mask[b, :p] = 0
    ids[b, :p] = 0
  return ids, mask


def hf_logits(model, ids, mask):
  """Reference logits with explicit `cumsum(mask) - 1` positions (left padding)."""
  import torch

  pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(
        input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
        position_ids=torch.tensor(pos),
    )
  return out.logits.float().numpy()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def jit_logits(model):
  """`f(ids, mask) -> logits` as numpy, through one jitted function (eager NNX calls are slow)."""
  import jax
  from flax import nnx

  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, attention_mask=m))
  return lambda ids, mask: np.asarray(fn(state, ids, mask))
