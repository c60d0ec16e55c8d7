"""Hugging Face checkpoints: safetensors folders in and out.

Loading reads `config.json` with `transformers.AutoConfig`, builds the model abstractly
(`nnx.eval_shape`), then reads the tensors one by one with `safetensors.safe_open(...,
framework="numpy")` (the file opened for that tensor only: mapped pages do not accumulate), casts
each to the parameter dtype and writes it into its device array (a stacked `[L, ...]` parameter
is allocated once and filled layer by layer in place), so peak host memory stays near one copy of
the weights plus a few tensors (`experiments/benchmarks/load_memory.py` measures it).

Saving writes `model.safetensors` (or shards plus `model.safetensors.index.json`), `config.json`
and `generation_config.json`, which `transformers.AutoModelForCausalLM` (or
`AutoModelForSequenceClassification` for a `ScalarModel`) loads with the same outputs; LoRA
adapters are merged into the written kernels (several processes: process 0 writes).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jax_ppo.models import config as config_lib
from jax_ppo.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from jax_ppo.models.errors import (
    MissingModelFileError,
    ModelFileError,
    UnsupportedModelError,
)
from jax_ppo.models.heads import ScalarHead, ScalarModel
from jax_ppo.models.transformer import DEFAULT_REMAT, CausalLM
from jax_ppo.parallel.distributed import barrier, host_array, is_main_process

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCORE_BIAS_KEY = "jax_ppo_score_bias"
"""`config.json` key of a `ScalarModel`'s head bias (e.g. its reward normalisation), which HF
`*ForSequenceClassification` heads lack: transformers keeps the key but does not add it, so its
scores are `load_scalar_model`'s minus this constant."""

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """How one checkpoint tensor maps onto model parameters.

  Attributes:
    name: tensor name in the checkpoint (with prefix).
    paths: parameter paths it fills (several for GPT-2's fused `c_attn`, split on the last axis).
    layer: index into the leading `[L]` axis of stacked parameters; None for unstacked ones.
    transpose: checkpoint layout is torch `Linear` `[out, in]`; ours is `[in, out]`.
  """

  name: str
  paths: tuple[Path, ...]
  layer: int | None = None
  transpose: bool = False


_LAYERS = ("decoder", "layers")


def _trunk_specs(config: ModelConfig, prefix: str) -> list[TensorSpec]:
  specs = []
  add = lambda name, *paths, layer=None, t=False: specs.append(  # noqa: E731
      TensorSpec(prefix + name, tuple(paths), layer, t)
  )
  lay = lambda *p: _LAYERS + p  # noqa: E731
  c = config
  if c.model_type == "gpt2":
    add("wte.weight", ("decoder", "embed", "embedding"))
    add("wpe.weight", ("decoder", "pos_embed", "embedding"))
    for i in range(c.num_layers):
      h = f"h.{i}."
      for hf, ours in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
        add(h + hf + ".weight", lay(ours, "scale"), layer=i)
        add(h + hf + ".bias", lay(ours, "bias"), layer=i)
      for kind in ("weight", "bias"):
        leaf = "kernel" if kind == "weight" else "bias"
        add(h + "attn.c_attn." + kind, lay("q", leaf), lay("k", leaf), lay("v", leaf), layer=i)
        add(h + "attn.c_proj." + kind, lay("o", leaf), layer=i)
        add(h + "mlp.c_fc." + kind, lay("up", leaf), layer=i)
        add(h + "mlp.c_proj." + kind, lay("down", leaf), layer=i)
    add("ln_f.weight", ("decoder", "final_norm", "scale"))
    add("ln_f.bias", ("decoder", "final_norm", "bias"))
    return specs
  add("embed_tokens.weight", ("decoder", "embed", "embedding"))
  for i in range(c.num_layers):
    h = f"layers.{i}."
    add(h + "input_layernorm.weight", lay("attn_norm", "scale"), layer=i)
    if c.sandwich_norms:  # Gemma 2: post-attention, pre- and post-feedforward norms.
      add(h + "post_attention_layernorm.weight", lay("post_attn_norm", "scale"), layer=i)
      add(h + "pre_feedforward_layernorm.weight", lay("mlp_norm", "scale"), layer=i)
      add(h + "post_feedforward_layernorm.weight", lay("post_mlp_norm", "scale"), layer=i)
    else:
      add(h + "post_attention_layernorm.weight", lay("mlp_norm", "scale"), layer=i)
    for proj, bias in (("q", c.qkv_bias), ("k", c.qkv_bias), ("v", c.qkv_bias), ("o", c.out_bias)):
      add(h + f"self_attn.{proj}_proj.weight", lay(proj, "kernel"), layer=i, t=True)
      if bias:
        add(h + f"self_attn.{proj}_proj.bias", lay(proj, "bias"), layer=i)
    if c.qk_norm:
      add(h + "self_attn.q_norm.weight", lay("q_norm", "scale"), layer=i)
      add(h + "self_attn.k_norm.weight", lay("k_norm", "scale"), layer=i)
    for proj in ("gate", "up", "down"):
      add(h + f"mlp.{proj}_proj.weight", lay(proj, "kernel"), layer=i, t=True)
      if c.mlp_bias:
        add(h + f"mlp.{proj}_proj.bias", lay(proj, "bias"), layer=i)
  add("norm.weight", ("decoder", "final_norm", "scale"))
  return specs


def _trunk_prefix(config: ModelConfig) -> str:
  return "transformer." if config.model_type == "gpt2" else "model."


def tensor_specs(config: ModelConfig, *, head: str, prefix: str | None = None) -> list[TensorSpec]:
  """Every checkpoint tensor of a model with `head` in ("lm", "score", "none")."""
  prefix = _trunk_prefix(config) if prefix is None else prefix
  specs = _trunk_specs(config, prefix)
  if head == "lm" and not config.tie_word_embeddings:
    specs.append(TensorSpec("lm_head.weight", (("lm_head", "kernel"),), None, True))
  elif head == "score":
    specs.append(TensorSpec("score.weight", (("score_head", "kernel"),), None, True))
  return specs


def _ignorable(name: str, config: ModelConfig, head: str) -> bool:
  """Checkpoint entries that carry no parameter of ours (buffers, tied or unused heads)."""
  if re.search(r"\.attn\.(masked_)?bias$", name) and config.model_type == "gpt2":
    return True  # GPT-2's causal-mask buffers in older checkpoints.
  if name.endswith("rotary_emb.inv_freq"):
    return True  # Recomputed from the config.
  if name == "lm_head.weight" and (head != "lm" or config.tie_word_embeddings):
    return True  # Tied copy, or a CausalLM checkpoint read as a trunk for a scalar model.
  if name == "score.weight" and head != "score":
    return True  # A reward model's head, replaced by a new one.
  return False


_REWRITE = "download or save the checkpoint again"


def _safetensors_keys(file: str) -> list[str]:
  """Tensor names in one safetensors file; a `ModelFileError` naming the file when it is missing,
  truncated or corrupt (safetensors checks that the header covers the whole file)."""
  if not os.path.isfile(file):
    raise MissingModelFileError(f"Weights file {file} does not exist; {_REWRITE}.")
  try:
    with safe_open(file, framework="numpy") as f:
      return list(f.keys())
  except (SafetensorError, OSError) as e:
    raise ModelFileError(
        f"Weights file {file} is not a readable safetensors file ({e}): it is truncated or "
        f"corrupt; {_REWRITE}."
    ) from e


def checkpoint_index(path: str) -> dict[str, str]:
  """Tensor name -> file name of a safetensors checkpoint folder (single file or sharded).

  Every file is opened once here (its header only), so a missing, truncated or corrupt file is
  reported before any tensor is loaded.

  Raises:
    MissingModelFileError: no weights in `path`, or a shard named by the index does not exist.
    ModelFileError: an unreadable index or safetensors file, or a shard that lacks a tensor the
      index assigns to it (each naming the file).
  """
  index_path = os.path.join(path, INDEX_FILE)
  if os.path.exists(index_path):
    try:
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
      index = {str(k): str(v) for k, v in dict(weight_map).items()}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
      raise ModelFileError(
          f"Shard index {index_path} is unreadable ({type(e).__name__}: {e}); it needs a "
          f'"weight_map" object of tensor name -> file; {_REWRITE}.'
      ) from e
    for file in sorted(set(index.values())):
      full = os.path.join(path, file)
      keys = set(_safetensors_keys(full))
      absent = [name for name, f in index.items() if f == file and name not in keys]
      if absent:
        raise ModelFileError(
            f"Weights file {full} lacks tensors that {index_path} assigns to it: "
            f"{_format_names(absent)}; {_REWRITE}."
        )
    return index
  single = os.path.join(path, SINGLE_FILE)
  if os.path.exists(single):
    return {name: SINGLE_FILE for name in _safetensors_keys(single)}
  raise MissingModelFileError(
      f"No {SINGLE_FILE} or {INDEX_FILE} in {path!r}; give a folder written by save_pretrained "
      "(or transformers' save_pretrained with safetensors)."
  )


def _resolve_prefix(config: ModelConfig, names: set[str]) -> str:
  """The trunk prefix used by this file ("model."/"transformer.", or none for old GPT-2 files)."""
  prefix = _trunk_prefix(config)
  probe = "wte.weight" if config.model_type == "gpt2" else "embed_tokens.weight"
  if prefix + probe not in names and probe in names:
    return ""
  return prefix


def _format_names(names) -> str:
  names = sorted(names)
  shown = ", ".join(names[:20])
  return shown + (f", ... ({len(names) - 20} more)" if len(names) > 20 else "")


def _hf_shape(spec: TensorSpec, slice_shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
  if len(slice_shapes) > 1:
    first = slice_shapes[0]
    return (*first[:-1], sum(s[-1] for s in slice_shapes))
  shape = slice_shapes[0]
  return tuple(reversed(shape)) if spec.transpose else shape


def _np_dtype(dtype) -> np.dtype:
  return np.dtype(jnp.dtype(dtype))


def load_params(model_abstract: nnx.Module, path: str, config: ModelConfig, *, head: str,
                mesh=None):
  """Fills the abstract (`jax.ShapeDtypeStruct`) parameters of `model_abstract` from `path`.

  Parameters that are already concrete arrays are kept (e.g. a freshly initialised head). With
  a `mesh`, every parameter is read slice by slice straight into its shards
  (`jax_ppo.parallel.loading.read_sharded`).

  Raises:
    ModelFileError: naming the missing and unexpected tensors, the tensor whose shape differs
      from the model's (with both shapes), or an unreadable file.
  """
  graphdef, state = nnx.split(model_abstract)
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
  index = checkpoint_index(path)
  names = set(index)
  prefix = _resolve_prefix(config, names)
  specs = tensor_specs(config, head=head, prefix=prefix)
  specs = [s for s in specs if any(isinstance(flat[p], jax.ShapeDtypeStruct) for p in s.paths)]
  expected = {s.name for s in specs}
  missing = expected - names
  unexpected = {n for n in names - expected if not _ignorable(n, config, head)}
  if missing or unexpected:
    parts = []
    if missing:
      parts.append(f"missing tensors: {_format_names(missing)}")
    if unexpected:
      parts.append(f"unexpected tensors: {_format_names(unexpected)}")
    raise ModelFileError(
        f"Checkpoint {path!r} does not match a {config.model_type} model "
        f"(head={head!r}): " + "; ".join(parts) + "."
    )
  covered = {p for s in specs for p in s.paths}
  abstract_paths = [p for p, v in flat.items() if isinstance(v, jax.ShapeDtypeStruct)]
  uncovered = [p for p in abstract_paths if p not in covered]
  if uncovered:
    raise ModelFileError(f"No tensor of checkpoint {path!r} fills parameters {uncovered}.")
  if mesh is not None:
    from jax_ppo.parallel.loading import read_sharded

    flat = read_sharded(flat, path, index, specs, mesh, model_type=config.model_type)
    specs = []
  for spec in specs:
    slot_shapes = [flat[p].shape if spec.layer is None else flat[p].shape[1:] for p in spec.paths]
    tensor = _read_tensor(os.path.join(path, index[spec.name]), spec.name)
    want = _hf_shape(spec, slot_shapes)
    if tuple(tensor.shape) != want:
      raise ModelFileError(
          f"Shape mismatch for tensor {spec.name!r} of {path!r}: the checkpoint has "
          f"{tuple(tensor.shape)}, "
          f"the {config.model_type} model expects {want}."
      )
    if spec.transpose:
      tensor = tensor.T
    offset = 0
    for p, shape in zip(spec.paths, slot_shapes, strict=True):
      part = tensor[..., offset:offset + shape[-1]] if len(spec.paths) > 1 else tensor
      offset += shape[-1]
      part = jnp.asarray(np.ascontiguousarray(part, dtype=_np_dtype(flat[p].dtype)))
      if spec.layer is None:
        flat[p] = part
      else:
        if isinstance(flat[p], jax.ShapeDtypeStruct):
          flat[p] = jnp.zeros(flat[p].shape, flat[p].dtype)
        flat[p] = _set_layer(flat[p], part, spec.layer)
      del part
    del tensor
  nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(flat))
  return nnx.merge(graphdef, state)


def _read_tensor(file: str, name: str) -> np.ndarray:
  """One tensor as a host array; the file is opened for this tensor only, so that none of the
  checkpoint's memory-mapped pages stay resident after it is copied."""
  try:
    with safe_open(file, framework="numpy") as f:
      return f.get_tensor(name)
  except (SafetensorError, OSError) as e:
    raise ModelFileError(
        f"Cannot read tensor {name!r} from {file} ({e}); the file is corrupt; {_REWRITE}."
    ) from e


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked: jax.Array, value: jax.Array, layer: int) -> jax.Array:
  """`stacked[layer] = value` in place (the stacked buffer is donated)."""
  return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), layer, 0)


def _read_model_type(path: str) -> str:
  """`model_type` of `path/config.json`, checked against `SUPPORTED_MODEL_TYPES`.

  Raises:
    MissingModelFileError: no config.json.
    ModelFileError: config.json is not a JSON object (naming the line).
    UnsupportedModelError: a missing or unsupported `model_type` (listing the supported ones).
  """
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise MissingModelFileError(
        f"No config.json in {path!r}; give a Hugging Face model folder written by "
        "save_pretrained."
    )
  try:
    with open(config_path, encoding="utf-8") as f:
      raw = json.load(f)
  except json.JSONDecodeError as e:
    raise ModelFileError(
        f"{config_path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
        f"{_REWRITE}."
    ) from e
  except UnicodeDecodeError as e:
    raise ModelFileError(f"{config_path} is not UTF-8 text ({e}); {_REWRITE}.") from e
  if not isinstance(raw, dict):
    raise ModelFileError(f"{config_path} holds a JSON {type(raw).__name__}, not an object.")
  model_type = raw.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    architectures = raw.get("architectures")
    declared = f" (architectures {architectures})" if architectures else ""
    raise UnsupportedModelError(
        f"Unsupported model_type {model_type!r}{declared} in {config_path}; supported model "
        f"types: {', '.join(SUPPORTED_MODEL_TYPES)} (architectures: "
        f"{', '.join(config_lib.supported_architectures())})."
    )
  return model_type


def load_config(path: str) -> ModelConfig:
  """`ModelConfig` of a local checkpoint folder (`AutoConfig`, local files only)."""
  _read_model_type(path)
  return config_lib.config_from_hf(config_lib.load_hf_config(path))


def _dtypes(dtype, param_dtype):
  dtype = jnp.float32 if dtype is None else dtype
  return dtype, dtype if param_dtype is None else param_dtype


def from_pretrained(
    path: str,
    *,
    dtype=None,
    param_dtype=None,
    remat: str = DEFAULT_REMAT,
    scan_layers: bool = True,
    mesh=None,
) -> CausalLM:
  """Loads a local Hugging Face causal-LM checkpoint folder as a `CausalLM`.

  Args:
    path: folder with `config.json` and `model.safetensors` (or shards with
      `model.safetensors.index.json`).
    dtype: compute dtype (activations, logits); None means float32 whatever the checkpoint.
    param_dtype: storage dtype of the parameters; None means `dtype`. Tensors are cast one by one
      while loading (e.g. a bf16 checkpoint into float32 master weights).
    remat: rematerialisation policy (`"dots"` by default, `"none"`, `"layer"`, `"dots_all"`).
    scan_layers: `jax.lax.scan` over the stacked layers (True) or an unrolled loop.
    mesh: a `jax.sharding.Mesh` (`jax_ppo.parallel.make_mesh`): each parameter is created with
      its `NamedSharding` (`jax_ppo.parallel.param_shardings`) and each device's shard is read
      from the safetensors file slice by slice, so no host holds a full copy of the model.

  Returns:
    `model`, with `model(input_ids, attention_mask=mask)` -> logits `[B, S, V]`.

  Raises:
    UnsupportedModelError: unsupported `model_type` or option (listing the supported ones).
    ModelFileError: a missing, truncated or corrupt file (naming it; `MissingModelFileError`,
      also a `FileNotFoundError`, when absent), missing/unexpected tensor names (naming them),
      or a shape mismatch (naming the tensor and both shapes).
  """
  config = load_config(path)
  dtype, param_dtype = _dtypes(dtype, param_dtype)
  abstract = nnx.eval_shape(
      lambda: CausalLM(config, dtype=dtype, param_dtype=param_dtype, remat=remat,
                       scan_layers=scan_layers, rngs=nnx.Rngs(0))
  )
  return load_params(abstract, path, config, head="lm", mesh=mesh)


def load_scalar_model(
    path: str,
    *,
    head_init: str | None = None,
    seed: int = 0,
    dtype=None,
    param_dtype=None,
    remat: str = DEFAULT_REMAT,
    scan_layers: bool = True,
    mesh=None,
) -> ScalarModel:
  """Loads a reward or value model from a local checkpoint folder.

  A `*ForSequenceClassification` checkpoint (one label) brings its `score.weight` as the head
  (and `config.json`'s `SCORE_BIAS_KEY`, e.g. a reward normalisation, as its bias; 0 without);
  a causal-LM checkpoint (e.g. the SFT policy) brings the trunk only, and the head is new:
  `head_init="reward"` (N(0, 1/sqrt(D + 1)), the default) or `"zeros"`.

  Args:
    path: checkpoint folder.
    head_init: force a new head even when the checkpoint has `score.weight`
      (which is then ignored); None uses the checkpoint's head when present.
    seed: seed of a new head.
    dtype, param_dtype, remat, scan_layers, mesh: as in `from_pretrained`.
  """
  config = load_config(path)
  dtype, param_dtype = _dtypes(dtype, param_dtype)
  index = checkpoint_index(path)
  has_score = "score.weight" in index
  if has_score and head_init is None:
    rows = _tensor_shape(path, index, "score.weight")[0]
    if rows != 1:
      raise ValueError(
          f"score.weight of {path!r} has {rows} labels; a reward/value head needs exactly 1."
      )
  abstract = nnx.eval_shape(
      lambda: ScalarModel(config, dtype=dtype, param_dtype=param_dtype, remat=remat,
                          scan_layers=scan_layers, rngs=nnx.Rngs(0))
  )
  if has_score and head_init is None:
    bias = json.loads(config.source_config or "{}").get(SCORE_BIAS_KEY, 0.0)
    if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not np.isfinite(bias):
      raise ValueError(
          f"{SCORE_BIAS_KEY} in {os.path.join(path, 'config.json')} must be a finite number, got "
          f"{bias!r}; fix or remove the key (it is the reward head's bias)."
      )
    abstract.score_head.bias = nnx.Param(jnp.full((1,), bias, param_dtype))
    return load_params(abstract, path, config, head="score", mesh=mesh)
  abstract.score_head = ScalarHead(
      config.hidden_size, init=head_init or "reward", param_dtype=param_dtype,
      rngs=nnx.Rngs(seed),
  )
  return load_params(abstract, path, config, head="none", mesh=mesh)


def _tensor_shape(path: str, index: dict[str, str], name: str) -> tuple[int, ...]:
  file = os.path.join(path, index[name])
  try:
    with safe_open(file, framework="numpy") as f:
      return tuple(f.get_slice(name).get_shape())
  except (SafetensorError, OSError) as e:
    raise ModelFileError(f"Cannot read tensor {name!r} from {file} ({e}); {_REWRITE}.") from e


# -- saving -----------------------------------------------------------------------------------


def _export_arrays(model: nnx.Module) -> dict[Path, np.ndarray]:
  """Flat parameter arrays of `model` with LoRA adapters merged into their kernels."""
  from jax_ppo.models.lora import merge_lora

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
  np_dtype = _np_dtype(dtype)
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
