"""Architecture hyperparameters of the supported decoder families, read from transformers' configs.

One frozen `ModelConfig` describes every supported family (GPT-2, Llama 2/3.x, Mistral, Qwen2/2.5,
Qwen3, Gemma 2): the differences between them are a handful of switches (norm type, gated MLP,
learned or rotary positions, biases, q/k norms, tied embeddings, sliding windows, and Gemma 2's
scaled embeddings, `1 + w` norms, sandwich norms and logit soft-capping). `config_from_hf` reads a
`transformers.PretrainedConfig` (from `AutoConfig.from_pretrained(path)`, never with
`trust_remote_code`) and `config_to_hf` writes one back for `save_pretrained`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from jax_ppo.models.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("gemma2", "gpt2", "llama", "mistral", "qwen2", "qwen3")

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu", "swish")

_ARCHITECTURES = {
    "gemma2": ("Gemma2ForCausalLM", "Gemma2ForSequenceClassification"),
    "gpt2": ("GPT2LMHeadModel", "GPT2ForSequenceClassification"),
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "mistral": ("MistralForCausalLM", "MistralForSequenceClassification"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
}


def supported_architectures() -> tuple[str, ...]:
  """The transformers architecture names (`config.json` "architectures") that load here."""
  return tuple(a for model_type in SUPPORTED_MODEL_TYPES for a in _ARCHITECTURES[model_type])


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Rotary-frequency rescaling (transformers' `rope_parameters` / `rope_scaling`).

  Supported `rope_type`s: `"linear"` (every inverse frequency divided by `factor`) and `"llama3"`
  (Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth interpolation in
  between, with `low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings`).
  """

  rope_type: str
  factor: float = 1.0
  low_freq_factor: float = 1.0  # llama3 only.
  high_freq_factor: float = 4.0  # llama3 only.
  original_max_position_embeddings: int = 8192  # llama3 only.

  def __post_init__(self):
    if self.rope_type not in ("linear", "llama3"):
      raise UnsupportedModelError(
          f"Unsupported rope_type {self.rope_type!r}; supported: 'default', 'linear', 'llama3'."
      )
    if self.factor <= 0:
      raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}.")
    if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(
          "llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
          f"{self.high_freq_factor} and {self.low_freq_factor}."
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Hyperparameters of a decoder-only transformer (every supported family).

  Shapes below use `D = hidden_size`, `H = num_heads`, `K = num_kv_heads`, `Dh = head_dim`,
  `F = intermediate_size`, `V = vocab_size`, `L = num_layers`.
  """

  model_type: str  # transformers' model_type, one of SUPPORTED_MODEL_TYPES.
  vocab_size: int  # V, rows of the embedding table.
  hidden_size: int  # D, width of the residual stream.
  intermediate_size: int  # F, hidden width of the MLP.
  num_layers: int  # L.
  num_heads: int  # H, query heads.
  num_kv_heads: int  # K, key/value heads (grouped-query attention when K < H).
  head_dim: int  # Dh; Qwen3 and Mistral may have H * Dh != D.
  max_position_embeddings: int  # Rows of the learned position table (GPT-2); informative for RoPE.
  norm_type: str = "rms"  # "rms" (RMSNorm, scale only) or "layer" (LayerNorm, scale and bias).
  norm_eps: float = 1e-6  # Epsilon inside the norms.
  activation: str = "silu"  # MLP nonlinearity, transformers' name (ACTIVATIONS).
  gated_mlp: bool = True  # down(act(gate(x)) * up(x)) if True, down(act(up(x))) otherwise.
  position_embedding: str = "rope"  # "rope" (rotary, rotate-half layout) or "learned" (GPT-2).
  rope_theta: float = 10000.0  # Rotary base.
  rope_scaling: RopeScaling | None = None  # Frequency rescaling; None for the default rotary.
  qkv_bias: bool = False  # Biases on the q, k and v projections (Qwen2, GPT-2).
  out_bias: bool = False  # Bias on the attention output projection (GPT-2).
  mlp_bias: bool = False  # Biases on the MLP projections (GPT-2).
  qk_norm: bool = False  # RMSNorm over Dh on every query and key head before RoPE (Qwen3).
  attention_scale: float | None = None  # Query scaling; None means Dh ** -0.5.
  tie_word_embeddings: bool = True  # lm_head shares the embedding table.
  sliding_window: int | None = None  # Keys with position <= query position - window are hidden.
  sliding_layers: tuple[bool, ...] | None = None  # Per layer: uses the window; None means all.
  embed_scale: float | None = None  # Embeddings multiplied by this (Gemma: sqrt(D)); None: 1.
  norm_offset: float = 0.0  # RMSNorm scale is `offset + w` (Gemma: 1, with w initialised at 0).
  sandwich_norms: bool = False  # Extra norms on the attention and MLP outputs (Gemma 2).
  attn_softcap: float | None = None  # Scores become `c * tanh(scores / c)` (Gemma 2).
  final_softcap: float | None = None  # Logits become `c * tanh(logits / c)` (Gemma 2).
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()  # Every EOS id (Llama 3 instruct models list several).
  pad_token_id: int | None = None
  source_config: str = ""  # JSON of the transformers config this was read from (for saving).

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise UnsupportedModelError(
          f"Unsupported model_type {self.model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}."
      )
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})."
      )
    if self.norm_type not in ("rms", "layer"):
      raise ValueError(f"norm_type must be 'rms' or 'layer', got {self.norm_type!r}.")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}.")
    if self.position_embedding not in ("rope", "learned"):
      raise ValueError(
          f"position_embedding must be 'rope' or 'learned', got {self.position_embedding!r}."
      )
    if self.position_embedding == "rope" and self.head_dim % 2:
      raise ValueError(f"Rotary embeddings need an even head_dim, got {self.head_dim}.")
    if not self.norm_eps > 0:
      raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}.")
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window}.")
    for name in ("attn_softcap", "final_softcap", "embed_scale"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value}.")
    if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
      raise ValueError(
          f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers."
      )

  @property
  def q_size(self) -> int:
    """H * Dh, width of the concatenated query heads."""
    return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int:
    """K * Dh, width of the concatenated key (or value) heads."""
    return self.num_kv_heads * self.head_dim

  @property
  def query_scale(self) -> float:
    """Factor applied to queries before q.k: Dh ** -0.5 unless `attention_scale` is set."""
    return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

  @property
  def window_per_layer(self) -> tuple[int, ...] | None:
    """Sliding window of each layer (a huge value where attention is global); None if none."""
    if self.sliding_window is None:
      return None
    layers = self.sliding_layers or (True,) * self.num_layers
    if not any(layers):
      return None
    big = np.iinfo(np.int32).max
    return tuple(self.sliding_window if s else big for s in layers)

  def inv_frequencies(self) -> np.ndarray:
    r"""Rotary inverse frequencies `[Dh / 2]` float32: :math:`\theta^{-2i/D_h}`, then rescaled.

    Llama 3.1 ("llama3") rescaling, with wavelength :math:`\lambda_i = 2\pi / f_i`, original
    context :math:`C`, :math:`\lambda_{lo} = C / \text{low\_freq\_factor}` and
    :math:`\lambda_{hi} = C / \text{high\_freq\_factor}`: :math:`f_i / s` where
    :math:`\lambda_i > \lambda_{lo}`, :math:`f_i` where :math:`\lambda_i < \lambda_{hi}`, and in
    between :math:`(1 - a) f_i / s + a f_i` with
    :math:`a = (C / \lambda_i - \text{low}) / (\text{high} - \text{low})`.
    """
    exponents = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32) / self.head_dim
    inv = 1.0 / (self.rope_theta**exponents)
    scaling = self.rope_scaling
    if scaling is None:
      return inv.astype(np.float32)
    if scaling.rope_type == "linear":
      return (inv / scaling.factor).astype(np.float32)
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    low_wavelen = context / scaling.low_freq_factor
    high_wavelen = context / scaling.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    a = (context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - a) * scaled / scaling.factor + a * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _rope_from_hf(hf) -> tuple[float, RopeScaling | None]:
  """(theta, scaling) from `rope_parameters` (transformers >= 5) or `rope_theta`/`rope_scaling`."""
  params = dict(getattr(hf, "rope_parameters", None) or {})
  legacy = getattr(hf, "rope_scaling", None)
  if not params and legacy:
    params = dict(legacy)
  theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type in (None, "default"):
    return float(theta), None
  if rope_type not in ("linear", "llama3"):
    raise UnsupportedModelError(
        f"Unsupported rope_type {rope_type!r}; supported: 'default', 'linear', 'llama3'."
    )
  keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  kwargs = {k: params[k] for k in keys if params.get(k) is not None}
  return float(theta), RopeScaling(rope_type=rope_type, **kwargs)


def _eos_tuple(eos) -> tuple[int, ...]:
  if eos is None:
    return ()
  if isinstance(eos, (list, tuple)):
    return tuple(int(e) for e in eos)
  return (int(eos),)


def config_from_hf(hf: Any) -> ModelConfig:
  """Reads a transformers `PretrainedConfig` into a `ModelConfig`.

  Raises:
    UnsupportedModelError: (a ValueError) for an unsupported `model_type` (the message lists the
      supported ones) or an option of a supported family that this implementation does not
      reproduce.
  """
  model_type = getattr(hf, "model_type", None)
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise UnsupportedModelError(
        f"Unsupported model_type {model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}."
    )
  common = dict(
      model_type=model_type,
      vocab_size=int(hf.vocab_size),
      bos_token_id=getattr(hf, "bos_token_id", None),
      eos_token_ids=_eos_tuple(getattr(hf, "eos_token_id", None)),
      pad_token_id=getattr(hf, "pad_token_id", None),
      tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", model_type == "gpt2")),
      source_config=hf.to_json_string(use_diff=False),
  )
  if model_type == "gpt2":
    if getattr(hf, "scale_attn_by_inverse_layer_idx", False):
      raise UnsupportedModelError(
          "GPT-2 option scale_attn_by_inverse_layer_idx=True is not supported.")
    if getattr(hf, "add_cross_attention", False):
      raise UnsupportedModelError("GPT-2 option add_cross_attention=True is not supported.")
    head_dim = hf.n_embd // hf.n_head
    return ModelConfig(
        **common,
        hidden_size=hf.n_embd,
        intermediate_size=hf.n_inner or 4 * hf.n_embd,
        num_layers=hf.n_layer,
        num_heads=hf.n_head,
        num_kv_heads=hf.n_head,
        head_dim=head_dim,
        max_position_embeddings=hf.n_positions,
        norm_type="layer",
        norm_eps=hf.layer_norm_epsilon,
        activation=hf.activation_function,
        gated_mlp=False,
        position_embedding="learned",
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        attention_scale=None if getattr(hf, "scale_attn_weights", True) else 1.0,
    )
  theta, scaling = _rope_from_hf(hf)
  heads = hf.num_attention_heads
  # The fields every rotary family (Llama, Mistral, Qwen2/3, Gemma 2) reads the same way.
  rotary = dict(
      common,
      hidden_size=hf.hidden_size,
      intermediate_size=hf.intermediate_size,
      num_layers=hf.num_hidden_layers,
      num_heads=heads,
      num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
      max_position_embeddings=hf.max_position_embeddings,
      norm_type="rms",
      norm_eps=hf.rms_norm_eps,
      rope_theta=theta,
      rope_scaling=scaling,
  )
  if model_type == "gemma2":
    layer_types = getattr(hf, "layer_types", None)
    return ModelConfig(
        **rotary,
        head_dim=hf.head_dim,
        activation=hf.hidden_activation,
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        out_bias=bool(getattr(hf, "attention_bias", False)),
        attention_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        sliding_window=getattr(hf, "sliding_window", None),
        sliding_layers=(None if layer_types is None
                        else tuple(t == "sliding_attention" for t in layer_types)),
        embed_scale=float(hf.hidden_size) ** 0.5,
        norm_offset=1.0,
        sandwich_norms=True,
        attn_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_softcap=getattr(hf, "final_logit_softcapping", None),
    )
  head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
  attention_bias = bool(getattr(hf, "attention_bias", False))
  sliding_window = getattr(hf, "sliding_window", None)
  sliding_layers = None
  layer_types = getattr(hf, "layer_types", None)
  if model_type in ("qwen2", "qwen3"):
    if not getattr(hf, "use_sliding_window", False):
      sliding_window = None
    elif layer_types is not None:
      sliding_layers = tuple(t == "sliding_attention" for t in layer_types)
  if sliding_window is not None and model_type == "llama":
    sliding_window = None  # Llama has no sliding window; the field would be a stray key.
  return ModelConfig(
      **rotary,
      head_dim=head_dim,
      activation=hf.hidden_act,
      gated_mlp=True,
      position_embedding="rope",
      qkv_bias=attention_bias or model_type == "qwen2",
      out_bias=attention_bias and model_type != "qwen2",
      mlp_bias=bool(getattr(hf, "mlp_bias", False)),
      qk_norm=model_type == "qwen3",
      sliding_window=sliding_window,
      sliding_layers=sliding_layers,
  )


def load_hf_config(path: str) -> Any:
  """`transformers.AutoConfig.from_pretrained(path)` from a local folder (no remote code)."""
  import transformers

  return transformers.AutoConfig.from_pretrained(
      path, local_files_only=True, trust_remote_code=False
  )


def _maybe_int(x: float) -> float | int:
  return round(x) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x


def config_to_hf(config: ModelConfig, *, sequence_classification: bool = False) -> Any:
  """A transformers config that rebuilds `config` (for `save_pretrained`).

  Starts from `config.source_config` when the config was read from a checkpoint (keeping keys
  such as `bos_token_id`), then overwrites every architecture field from `config`.
  """
  import transformers

  base = json.loads(config.source_config) if config.source_config else {}
  for key in ("transformers_version", "architectures", "model_type", "_name_or_path"):
    base.pop(key, None)
  eos = list(config.eos_token_ids)
  fields = dict(
      vocab_size=config.vocab_size,
      bos_token_id=config.bos_token_id,
      eos_token_id=(eos[0] if len(eos) == 1 else eos) if eos else None,
      pad_token_id=config.pad_token_id,
      tie_word_embeddings=config.tie_word_embeddings,
  )
  if config.model_type == "gpt2":
    fields.update(
        n_embd=config.hidden_size,
        n_inner=config.intermediate_size,
        n_layer=config.num_layers,
        n_head=config.num_heads,
        n_positions=config.max_position_embeddings,
        layer_norm_epsilon=config.norm_eps,
        activation_function=config.activation,
        scale_attn_weights=config.attention_scale is None,
    )
  else:  # The rotary families share their architecture fields.
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
      rope.update(dataclasses.asdict(config.rope_scaling))
    activation_key = "hidden_activation" if config.model_type == "gemma2" else "hidden_act"
    fields.update(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_eps,
        rope_parameters=rope,
        **{activation_key: config.activation},
    )
    base.pop("rope_scaling", None)
    base.pop("rope_theta", None)
    if config.model_type == "gemma2":
      fields.update(
          attention_bias=config.qkv_bias,
          query_pre_attn_scalar=_maybe_int(config.query_scale**-2),
          sliding_window=config.sliding_window,
          layer_types=(None if config.sliding_layers is None else [
              "sliding_attention" if s else "full_attention" for s in config.sliding_layers]),
          attn_logit_softcapping=config.attn_softcap,
          final_logit_softcapping=config.final_softcap,
      )
    if config.model_type in ("llama", "qwen3"):
      fields["attention_bias"] = config.qkv_bias
    if config.model_type == "llama":
      fields["mlp_bias"] = config.mlp_bias
    if config.model_type == "mistral":
      fields["sliding_window"] = config.sliding_window
    if config.model_type in ("qwen2", "qwen3"):
      fields["use_sliding_window"] = config.sliding_window is not None
      fields["sliding_window"] = config.sliding_window
      if config.sliding_layers is not None:
        fields["layer_types"] = [
            "sliding_attention" if s else "full_attention" for s in config.sliding_layers
        ]
      else:
        base.pop("layer_types", None)
  base.update(fields)
  cls = transformers.CONFIG_MAPPING[config.model_type]
  hf = cls(**base)
  hf.architectures = [_ARCHITECTURES[config.model_type][int(sequence_classification)]]
  return hf
