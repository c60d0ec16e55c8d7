"""The architectures of common models, to plan a run without downloading anything.

`COMMON_SHAPES` maps a short name to the architecture fields of the model's public Hugging Face
`config.json` (the fields `jax_ppo.models.config.config_from_hf` reads, with `model_type`,
`architectures` and the token ids); `shape_config(name)` turns one into a `ModelConfig` through
the same reader as `jax_ppo.models.load_config(folder)`. `jax-ppo plan` takes them as the policy:
`--model qwen3-8b`, or `policy_path=shape:qwen3-8b` in the run config (`plan_model_config`).

| name         | Hugging Face repository | parameters    | published (model card, paper)  |
|--------------|-------------------------|---------------|--------------------------------|
| qwen3-0.6b   | Qwen/Qwen3-0.6B         | 596,049,920   | 0.6B, 0.44B non-embedding      |
| qwen3-1.7b   | Qwen/Qwen3-1.7B         | 1,720,574,976 | 1.7B, 1.4B non-embedding       |
| qwen3-4b     | Qwen/Qwen3-4B           | 4,022,468,096 | 4.0B, 3.6B non-embedding       |
| qwen3-8b     | Qwen/Qwen3-8B           | 8,190,735,360 | 8.2B, 6.95B non-embedding      |
| qwen2.5-7b   | Qwen/Qwen2.5-7B         | 7,615,616,512 | 7.61B, 6.53B non-embedding     |
| llama-3.2-1b | meta-llama/Llama-3.2-1B | 1,235,814,400 | 1.23B                          |
| llama-3.2-3b | meta-llama/Llama-3.2-3B | 3,212,749,824 | 3.21B                          |
| llama-3.1-8b | meta-llama/Llama-3.1-8B | 8,030,261,248 | 8.03B                          |
| gemma-2-2b   | google/gemma-2-2b       | 2,614,341,888 | 2,024,517,888 non-embedding    |
| gemma-2-9b   | google/gemma-2-9b       | 9,241,705,984 | 8,324,201,984 non-embedding    |

Parameters count tied embeddings once (every model here but qwen3-8b, qwen2.5-7b and
llama-3.1-8b ties them); the Gemma 2 report's embedding counts use a 256,128-row table, the
checkpoints' is 256,000 rows, so only its non-embedding counts compare.

The values were written from the public config.json files and cross-checked (no download is
possible here) against copies of them in public repositories found with a code search:

* qwen3-4b, qwen3-8b, qwen2.5-7b, llama-3.1-8b, llama-3.2-3b: every field, against verbatim
  config.json copies in citsjtu2020/LLM-Prof `sglang/Model_Config.md`;
* qwen3-0.6b: two verbatim copies of Qwen/Qwen3-0.6B's config.json (a model note, and the
  constants of a Rust port citing huggingface.co/Qwen/Qwen3-0.6B/raw/main/config.json);
* qwen3-1.7b: Lightning-AI litgpt `litgpt/config.py` ("Qwen3-1.7B": 28 layers, 2048, 6144, 16/8
  heads, head 128, 40960 positions, base 1e6), slime `scripts/models/qwen3-1.7B.sh`; its tied
  embeddings from the parameter count (1.72e9 tied, 2.03e9 untied; the model card says 1.7B);
* llama-3.2-1b: litgpt `litgpt/config.py` (16 layers, 2048, 8192, 32/8 heads, base 500000,
  llama3 rope factor 32) and a partial config.json copy (head_dim 64, eps 1e-5); its tied
  embeddings from the count (1.24e9 tied, 1.50e9 untied);
* gemma-2-2b: a verbatim `google/gemma-2-2b` config dict in a public loader (every field);
* gemma-2-9b: a verbatim `google/gemma-2-9b-it` config.json quoted in a vLLM issue (every field;
  `query_pre_attn_scalar` 256: MaxText's `utils/ckpt_conversion/utils/hf_model_configs.py`
  writes 224 there, not the public config.json's value).

The counts are checked in `tests/diagnostics/test_shapes.py`: our model built abstractly and
transformers' built on the meta device from the same dict hold the same number of parameters
(the column above), within 1% of the published figures (Gemma 2's non-embedding counts exactly).
"""

from __future__ import annotations

from typing import Any

from jax_ppo.models import load_config
from jax_ppo.models.config import ModelConfig, config_from_hf

SHAPE_PREFIX = "shape:"
"""A `policy_path` starting with this names a `COMMON_SHAPES` entry instead of a folder."""

_QWEN3_COMMON = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"], bos_token_id=151643,
    eos_token_id=151645, vocab_size=151936, head_dim=128, hidden_act="silu",
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
    attention_bias=False, sliding_window=None, use_sliding_window=False,
)
_LLAMA3_COMMON = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], bos_token_id=128000,
    eos_token_id=128001, vocab_size=128256, hidden_act="silu", max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False,
)
_GEMMA2_COMMON = dict(
    model_type="gemma2", architectures=["Gemma2ForCausalLM"], bos_token_id=2, eos_token_id=1,
    pad_token_id=0, vocab_size=256000, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
    query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0, tie_word_embeddings=True,
)


def _llama3_rope(factor: float) -> dict[str, Any]:
  """The `rope_scaling` of Llama 3.1 / 3.2 (`rope_type` "llama3", original context 8192)."""
  return {"factor": factor, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
          "original_max_position_embeddings": 8192, "rope_type": "llama3"}


COMMON_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3_COMMON, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     tie_word_embeddings=False),
    "qwen2.5-7b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], bos_token_id=151643,
        eos_token_id=151643, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
        sliding_window=131072, use_sliding_window=False,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(_LLAMA3_COMMON, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, rope_scaling=_llama3_rope(32.0), tie_word_embeddings=True),
    "llama-3.2-3b": dict(_LLAMA3_COMMON, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         head_dim=128, rope_scaling=_llama3_rope(32.0), tie_word_embeddings=True),
    "llama-3.1-8b": dict(_LLAMA3_COMMON, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, rope_scaling=_llama3_rope(8.0), tie_word_embeddings=False),
    "gemma-2-2b": dict(_GEMMA2_COMMON, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4),
    "gemma-2-9b": dict(_GEMMA2_COMMON, hidden_size=3584, intermediate_size=14336,
                       num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8),
}
"""Short name -> the architecture fields of the model's Hugging Face config.json (module
docstring: which repository, where each value was checked)."""


def hf_shape_config(name: str) -> Any:
  """The transformers `PretrainedConfig` of `COMMON_SHAPES[name]` (`AutoConfig.for_model`).

  Raises:
    ValueError: an unknown `name` (the message lists the known ones).
  """
  import transformers

  if name not in COMMON_SHAPES:
    raise ValueError(
        f"Unknown model shape {name!r}; known shapes: {', '.join(COMMON_SHAPES)} "
        "(jax_ppo.diagnostics.shapes.COMMON_SHAPES), or give a Hugging Face model folder.")
  fields = dict(COMMON_SHAPES[name])
  return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def shape_config(name: str) -> ModelConfig:
  """The `ModelConfig` of the common model `name` (a `COMMON_SHAPES` key, e.g. "qwen3-8b"), read
  as `jax_ppo.models.load_config` reads a folder's config.json.

  Raises:
    ValueError: an unknown `name` (the message lists the known ones).
  """
  return config_from_hf(hf_shape_config(name))


def plan_model_config(path_or_name: str) -> ModelConfig:
  """The policy architecture a plan uses: `shape_config(NAME)` for `"shape:NAME"`, otherwise
  `load_config(path_or_name)` (the folder's config.json, no weights).

  Raises:
    ValueError: an unknown shape name, or a folder `load_config` cannot read.
  """
  if path_or_name.startswith(SHAPE_PREFIX):
    return shape_config(path_or_name[len(SHAPE_PREFIX):])
  return load_config(path_or_name)


__all__ = [
    "COMMON_SHAPES",
    "SHAPE_PREFIX",
    "hf_shape_config",
    "plan_model_config",
    "shape_config",
]
