"""Writing Hugging Face checkpoint folders: `save_pretrained` and the HF config it writes.

`save_pretrained` writes `model.safetensors` (or shards plus `model.safetensors.index.json`),
`config.json` and `generation_config.json`, which `transformers.AutoModelForCausalLM` (or
`AutoModelForSequenceClassification` for a `ScalarModel`) loads with the same outputs; LoRA
adapters are merged into the written kernels. Tensors are named and laid out by the same
`tensors.tensor_specs` that loading reads. One tensor (one layer of a stacked parameter) is copied
to the host at a time, so a sharded model is gathered tensor by tensor (several processes: each
tensor is gathered in turn and process 0 writes).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from safetensors.numpy import save_file

from jax_ppo.models import config as config_lib
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.heads import ScalarModel
from jax_ppo.models.hf.tensors import (
    INDEX_FILE,
    SCORE_BIAS_KEY,
    SINGLE_FILE,
    Path,
    TensorSpec,
    tensor_specs,
)
from jax_ppo.models.lora import merge_lora
from jax_ppo.models.transformer import CausalLM
from jax_ppo.parallel.distributed import barrier, host_array, is_main_process


def _export_arrays(model: nnx.Module) -> dict[Path, np.ndarray]:
  """Flat parameter arrays of `model` with LoRA adapters merged into their kernels."""
  model = merge_lora(model)
  _, state = nnx.split(model)
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
  return flat


def _parse_size(size: int | str | None) -> int | None:
  if size is None or isinstance(size, int):
    return size
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)\s*", size.upper())
  if not match:
    raise ValueError(f"max_shard_size must be an int or like '2GB', got {size!r}.")
  scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[match.group(2)]
  return int(float(match.group(1)) * scale)


def _hf_tensors(
    flat: dict[Path, np.ndarray], specs: list[TensorSpec], dtype
) -> Iterator[tuple[str, np.ndarray]]:
  for spec in specs:
    parts = []
    for p in spec.paths:
      x = flat[p] if spec.layer is None else flat[p][spec.layer]
      parts.append(host_array(x))  # (several processes: gathered, this tensor only)
    tensor = np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    if spec.transpose:
      tensor = tensor.T
    yield spec.name, np.ascontiguousarray(tensor, dtype=dtype)


def save_pretrained(
    model: CausalLM | ScalarModel,
    path: str,
    *,
    max_shard_size: int | str | None = "5GB",
    dtype=None,
    pad_token_id: int | None = None,
) -> None:
  """Writes a Hugging Face checkpoint folder for `model` (LoRA adapters merged).

  A `CausalLM` becomes a `*ForCausalLM` checkpoint; a `ScalarModel` a one-label
  `*ForSequenceClassification` checkpoint; HF heads have no bias, so the head's bias goes into
  `config.json` as `SCORE_BIAS_KEY` (read back by `load_scalar_model`, ignored by transformers).
  A value head added on a `CausalLM` is not part of the HF format and is not written.

  Args:
    model: the model to write.
    path: output folder (created).
    max_shard_size: bytes (or a string like "2GB") per safetensors file; the model is sharded
      with a `model.safetensors.index.json` when it is larger. None writes one file.
    dtype: dtype of the written tensors; None keeps the parameter dtype.
    pad_token_id: the pad id written into `config.json` and `generation_config.json` (the
      tokenizer's, so that transformers' `generate` pads with it); None: the model config's.

  Several processes: every one must call it; each tensor is gathered in turn (`host_array`),
  only process 0 keeps a file's tensors and writes, and all return once the folder is complete.
  """
  main = is_main_process()
  config: ModelConfig = model.config
  is_scalar = isinstance(model, ScalarModel)
  head = "score" if is_scalar else "lm"
  flat = _export_arrays(model)
  specs = tensor_specs(config, head=head)
  if dtype is None:
    dtype = flat[("decoder", "embed", "embedding")].dtype
  np_dtype = np.dtype(jnp.dtype(dtype))
  limit = _parse_size(max_shard_size)
  if main:
    os.makedirs(path, exist_ok=True)

  shards: list[list[TensorSpec]] = [[]]
  size = 0
  for spec in specs:
    n = sum(
        int(np.prod(flat[p].shape[1:] if spec.layer is not None else flat[p].shape))
        for p in spec.paths
    ) * np_dtype.itemsize
    if limit is not None and shards[-1] and size + n > limit:
      shards.append([])
      size = 0
    shards[-1].append(spec)
    size += n
  weight_map = {}
  total = 0
  for i, shard in enumerate(shards):
    file = (SINGLE_FILE if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
    tensors = {}
    for name, tensor in _hf_tensors(flat, shard, np_dtype):
      total += tensor.nbytes
      weight_map[name] = file
      if main:  # (the other processes only took part in the gather)
        tensors[name] = tensor
    if main:
      save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
  bias = float(host_array(flat[("score_head", "bias")])[0]) if is_scalar else None
  if not main:
    barrier(f"save_pretrained {path}")
    return
  if len(shards) > 1:
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  elif os.path.exists(os.path.join(path, INDEX_FILE)):
    os.remove(os.path.join(path, INDEX_FILE))

  import transformers

  hf = config_lib.config_to_hf(config, sequence_classification=is_scalar)
  if pad_token_id is not None:
    hf.pad_token_id = int(pad_token_id)
  if is_scalar:
    hf.num_labels = 1
    setattr(hf, SCORE_BIAS_KEY, bias)
  elif hasattr(hf, SCORE_BIAS_KEY):
    delattr(hf, SCORE_BIAS_KEY)
  hf.dtype = str(np_dtype) if np_dtype != np.dtype(jnp.bfloat16) else "bfloat16"
  hf.save_pretrained(path)
  generation = transformers.GenerationConfig.from_model_config(hf)
  generation.save_pretrained(path)
  barrier(f"save_pretrained {path}")
