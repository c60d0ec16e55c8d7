r"""PEFT adapter folders: a LoRA model's adapters in the format the `peft` library loads.

`save_peft_adapter(model, path, base_model=...)` writes `adapter_config.json` and
`adapter_model.safetensors`; `peft.PeftModel.from_pretrained(hf_base, path)` on the Hugging Face
base model (the checkpoint the adapters were trained on) then computes what our model computes
with its adapters on, and `merge_and_unload()` gives the weights `save_pretrained` writes.

The mapping is exact. Ours, per layer (`jax_ppo.models.layers.Linear`):

.. math::  y = x W + s\, (x A) B,\qquad A \in \mathbb{R}^{d_{in} \times r},\;
   B \in \mathbb{R}^{r \times d_{out}},\; s = \alpha / r

PEFT's LoRA layer is `y = base(x) + scaling * lora_B(lora_A(x))` with torch `Linear` weights
`lora_A.weight` `[r, in]` and `lora_B.weight` `[out, r]` and `scaling = lora_alpha / r`
(`use_rslora` false), so `lora_A.weight = A^T`, `lora_B.weight = B^T` and
`lora_alpha = s * r = alpha`. Tensor names are PEFT's:
`base_model.model.<HF module>.lora_A.weight`, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.

GPT-2 computes `q`, `k` and `v` with one Conv1D, `attn.c_attn` (`[D, 3 D]`), which PEFT adapts as
one module. The adapters of the adapted slots `S` of `(q, k, v)` become one adapter of rank
`|S| r`: `A_c = [A_q | A_k | A_v]` (the slots of `S`) and a block-diagonal `B_c` whose rows for
slot `s` hold `B_s` in `s`'s columns of `c_attn` and zeros elsewhere, so that
`x A_c B_c = [x A_q B_q, x A_k B_k, x A_v B_v]` (zero for a slot without adapter); its
`lora_alpha` is `|S| alpha`, which keeps the scaling `alpha / r` (`rank_pattern` and
`alpha_pattern` entries when it differs from the other modules). GPT-2's Conv1D layers need
`fan_in_fan_out: true` (PEFT's own setting for them); `lora_A` and `lora_B` stay torch `Linear`s.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jax_ppo.models.config import ModelConfig
from jax_ppo.models.heads import ScalarModel
from jax_ppo.models.hf.tensors import trunk_prefix
from jax_ppo.models.layers import LORA_TARGETS
from jax_ppo.models.lora import has_lora
from jax_ppo.parallel.distributed import barrier, host_array, is_main_process

ADAPTER_CONFIG = "adapter_config.json"
"""PEFT's adapter config file (`peft.PeftConfig.from_pretrained` reads it)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""PEFT's adapter weights file."""
PEFT_PREFIX = "base_model.model."
"""Prefix of every tensor name in a PEFT adapter of a causal LM (`PeftModel.base_model.model`)."""

_LLAMA_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
    "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
_GPT2_MODULES = {
    "q": "attn.c_attn", "k": "attn.c_attn", "v": "attn.c_attn", "o": "attn.c_proj",
    "up": "mlp.c_fc", "down": "mlp.c_proj",
}
_FUSED_QKV = ("q", "k", "v")
"""The slots of GPT-2's `c_attn`, in its column order."""


def hf_modules(config: ModelConfig) -> dict[str, str]:
  """Our projection name -> the Hugging Face module inside one decoder layer that holds it
  (`"self_attn.q_proj"`, GPT-2's `"attn.c_attn"` for each of `q`, `k`, `v`)."""
  if config.model_type == "gpt2":
    return dict(_GPT2_MODULES)
  return dict(_LLAMA_MODULES)


def target_names(config: ModelConfig) -> dict[str, str]:
  """HF module inside a layer -> its name in PEFT's `target_modules` (which matches module names
  by suffix): the last part (`"q_proj"`, `"c_attn"`) where that is unique within the family, else
  the qualified name (GPT-2's `"attn.c_proj"` and `"mlp.c_proj"`)."""
  paths = sorted(set(hf_modules(config).values()))
  last = collections.Counter(p.rsplit(".", 1)[-1] for p in paths)
  return {p: p.rsplit(".", 1)[-1] if last[p.rsplit(".", 1)[-1]] == 1 else p for p in paths}


def _layer_prefix(config: ModelConfig, layer: int) -> str:
  block = "h" if config.model_type == "gpt2" else "layers"
  return f"{PEFT_PREFIX}{trunk_prefix(config)}{block}.{layer}."


def _adapted(model: nnx.Module) -> dict[str, Any]:
  """Our adapted projections, name -> `Linear`, in `LORA_TARGETS` order."""
  layers = model.decoder.layers
  out = {}
  for name in LORA_TARGETS:
    lin = getattr(layers, name, None)
    if lin is not None and lin.lora_a is not None:
      out[name] = lin
  return out


def peft_adapter(model: nnx.Module) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """The PEFT adapter of `model`'s LoRA adapters: `(config fields, tensors)`.

  Args:
    model: a `CausalLM` with adapters (`jax_ppo.models.add_lora`); a value head on it is not
      part of the adapter.

  Returns:
    `(fields, tensors)`: `fields` holds `r`, `lora_alpha`, `target_modules` (HF module names
    inside a layer, e.g. `"self_attn.q_proj"`), `rank_pattern`, `alpha_pattern` and
    `fan_in_fan_out`; `tensors` maps PEFT's tensor names to float32 host arrays, `lora_A.weight`
    `[r, in]` and `lora_B.weight` `[out, r]` for every layer and adapted module. Several
    processes: every process must call it (each adapter is gathered in turn).

  Raises:
    ValueError: `model` is a `ScalarModel` or has no adapters.
  """
  if isinstance(model, ScalarModel):
    raise ValueError("A PEFT adapter export takes a causal LM; this is a ScalarModel (a reward "
                     "or value model), whose trained score head a LoRA adapter cannot carry: "
                     "export it merged with save_pretrained.")
  if not has_lora(model):
    raise ValueError("The model has no LoRA adapters to export as a PEFT adapter; add them "
                     "with add_lora (a run's `lora` block), or export the model with "
                     "save_pretrained.")
  config: ModelConfig = model.config
  modules = hf_modules(config)
  adapted = _adapted(model)
  # Host copies, float32, stacked [L, ...]; gathered in the same order on every process.
  a = {n: host_array(lin.lora_a[...]).astype(np.float32) for n, lin in adapted.items()}
  b = {n: host_array(lin.lora_b[...]).astype(np.float32) for n, lin in adapted.items()}
  scale = {n: float(lin.lora_scale) for n, lin in adapted.items()}

  # HF module -> (rank, alpha, A_c [L, in, r_c], B_c [L, r_c, out_c]).
  groups: dict[str, list[str]] = collections.defaultdict(list)
  for name in adapted:
    groups[modules[name]].append(name)
  built: dict[str, tuple[int, float, np.ndarray, np.ndarray]] = {}
  layers = model.decoder.layers
  for module, names in groups.items():
    first = names[0]
    if module == _GPT2_MODULES["q"]:
      # Block-diagonal fusion over c_attn's columns [q | k | v]; other slots' scales folded
      # into their B so that one scaling (the first slot's) holds for the whole module.
      widths = [getattr(layers, s).out_features for s in _FUSED_QKV]
      offsets = dict(zip(_FUSED_QKV, np.cumsum([0, *widths[:-1]]).tolist(), strict=True))
      ranks = [a[n].shape[-1] for n in names]
      fused_a = np.concatenate([a[n] for n in names], axis=-1)
      fused_b = np.zeros((*b[first].shape[:-2], sum(ranks), sum(widths)), np.float32)
      row = 0
      for n, r in zip(names, ranks, strict=True):
        col = offsets[n]
        fused_b[..., row:row + r, col:col + b[n].shape[-1]] = b[n] * (scale[n] / scale[first])
        row += r
      rank = sum(ranks)
      built[module] = (rank, scale[first] * rank, fused_a, fused_b)
    else:
      rank = a[first].shape[-1]
      built[module] = (rank, scale[first] * rank, a[first], b[first])

  # The most common (rank, alpha) is the config's default; other modules get pattern entries.
  counts = collections.Counter((r, alpha) for r, alpha, _, _ in built.values())
  rank, alpha = counts.most_common(1)[0][0]
  target = target_names(config)
  rank_pattern = {target[m]: r for m, (r, _, _, _) in built.items() if r != rank}
  alpha_pattern = {target[m]: al for m, (_, al, _, _) in built.items() if al != alpha}
  tensors = {}
  for layer in range(config.num_layers):
    prefix = _layer_prefix(config, layer)
    for module, (_, _, fa, fb) in built.items():
      tensors[f"{prefix}{module}.lora_A.weight"] = np.ascontiguousarray(fa[layer].T)
      tensors[f"{prefix}{module}.lora_B.weight"] = np.ascontiguousarray(fb[layer].T)
  fields = {
      "r": int(rank),
      "lora_alpha": _number(alpha),
      "target_modules": sorted(target[m] for m in built),
      "rank_pattern": {m: int(r) for m, r in rank_pattern.items()},
      "alpha_pattern": {m: _number(al) for m, al in alpha_pattern.items()},
      "fan_in_fan_out": config.model_type == "gpt2",
  }
  return fields, tensors


def _number(x: float) -> int | float:
  """`x` as an int when it is one (PEFT documents `lora_alpha` as an int), else the float."""
  return int(x) if float(x).is_integer() else float(x)


def save_peft_adapter(
    model: nnx.Module,
    path: str,
    *,
    base_model: str | None = None,
    dtype: Any = None,
) -> None:
  """Writes `model`'s LoRA adapters as a PEFT adapter folder at `path`.

  `adapter_config.json` (peft_type "LORA", task_type "CAUSAL_LM", `r`, `lora_alpha`,
  `target_modules`, lora_dropout 0, bias "none", `fan_in_fan_out`, `base_model_name_or_path`)
  and `adapter_model.safetensors` (`peft_adapter`). Load it with
  `peft.PeftModel.from_pretrained(base, path)` where `base` is the Hugging Face model the
  adapters were trained on.

  Args:
    model: a `CausalLM` with LoRA adapters.
    path: output folder (created).
    base_model: the base model's name or folder, written as `base_model_name_or_path` (what
      `peft.AutoPeftModelForCausalLM` loads); None writes null.
    dtype: dtype of the written tensors; None: the adapters' parameter dtype.

  Raises:
    ValueError: `model` has no adapters or is a `ScalarModel` (`peft_adapter`).

  Several processes: every one must call it; process 0 writes, and all return once the folder
  is complete.
  """
  if dtype is None and has_lora(model):
    dtype = next(iter(_adapted(model).values())).lora_a[...].dtype
  fields, tensors = peft_adapter(model)
  if not is_main_process():
    barrier(f"save_peft_adapter {path}")
    return
  np_dtype = np.dtype(jnp.dtype(dtype if dtype is not None else jnp.float32))
  os.makedirs(path, exist_ok=True)
  save_file({k: v.astype(np_dtype) for k, v in tensors.items()},
            os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
  config = {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model,
      "revision": None,
      "inference_mode": True,
      "r": fields["r"],
      "lora_alpha": fields["lora_alpha"],
      "lora_dropout": 0.0,
      "target_modules": fields["target_modules"],
      "rank_pattern": fields["rank_pattern"],
      "alpha_pattern": fields["alpha_pattern"],
      "fan_in_fan_out": fields["fan_in_fan_out"],
      "bias": "none",
      "use_rslora": False,
      "use_dora": False,
      "init_lora_weights": True,
      "modules_to_save": None,
      "layers_to_transform": None,
      "layers_pattern": None,
  }
  with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
    json.dump(config, f, indent=2)
  barrier(f"save_peft_adapter {path}")


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "PEFT_PREFIX",
    "hf_modules",
    "peft_adapter",
    "save_peft_adapter",
    "target_names",
]
