"""Reading Hugging Face checkpoint folders: safetensors files into a model, on the host or sharded.

Loading reads `config.json` with `transformers.AutoConfig`, builds the model abstractly
(`nnx.eval_shape`), checks the checkpoint's tensor names and shapes against it and plans which
tensor fills each parameter (`tensors.read_plan`, from the files' headers), then fills the plan:

* on the host (no mesh): each parameter is read with `read_slice` (the file opened for that
  tensor only: mapped pages do not accumulate), cast to the parameter dtype and written into its
  device array; a stacked `[L, ...]` parameter is allocated once and filled layer by layer in
  place. Peak host memory stays near one copy of the weights plus one tensor
  (`experiments/benchmarks/load_memory.py` measures it).
* straight into shards (`mesh=...`): every parameter is created with
  `jax.make_array_from_callback` and its `NamedSharding` (`jax_ppo.parallel.rules`); the callback
  of one device reads only that device's slice with `read_slice` (`get_slice(name)[...]`,
  memory-mapped, so the rest of the tensor is never copied). Host memory peaks near one device's
  shard of one parameter, whatever the model size, and on a multi-host mesh each process reads
  only the shards of its own devices.

Both paths read the same plan through the same `read_slice`, so they load the same values.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding
from safetensors import SafetensorError, safe_open

from jax_ppo.models import config as config_lib
from jax_ppo.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from jax_ppo.models.errors import MissingModelFileError, ModelFileError, UnsupportedModelError
from jax_ppo.models.heads import ScalarModel
from jax_ppo.models.hf.hub import is_hub_id
from jax_ppo.models.hf.tensors import (
    INDEX_FILE,
    REWRITE,
    SCORE_BIAS_KEY,
    SINGLE_FILE,
    Path,
    ReadPlan,
    format_names,
    read_plan,
    slice_bounds,
    source_index,
)
from jax_ppo.models.layers import ScalarHead
from jax_ppo.models.transformer import DEFAULT_REMAT, CausalLM
from jax_ppo.parallel.rules import partition_spec


def _safetensors_keys(file: str) -> list[str]:
  """Tensor names in one safetensors file; a `ModelFileError` naming the file when it is missing,
  truncated or corrupt (safetensors checks that the header covers the whole file)."""
  if not os.path.isfile(file):
    raise MissingModelFileError(f"Weights file {file} does not exist; {REWRITE}.")
  try:
    with safe_open(file, framework="numpy") as f:
      return list(f.keys())
  except (SafetensorError, OSError) as e:
    raise ModelFileError(
        f"Weights file {file} is not a readable safetensors file ({e}): it is truncated or "
        f"corrupt; {REWRITE}."
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
          f'"weight_map" object of tensor name -> file; {REWRITE}.'
      ) from e
    for file in sorted(set(index.values())):
      full = os.path.join(path, file)
      keys = set(_safetensors_keys(full))
      absent = [name for name, f in index.items() if f == file and name not in keys]
      if absent:
        raise ModelFileError(
            f"Weights file {full} lacks tensors that {index_path} assigns to it: "
            f"{format_names(absent)}; {REWRITE}."
        )
    return index
  single = os.path.join(path, SINGLE_FILE)
  if os.path.exists(single):
    return {name: SINGLE_FILE for name in _safetensors_keys(single)}
  raise MissingModelFileError(
      f"No {SINGLE_FILE} or {INDEX_FILE} in {path!r}; give a folder written by save_pretrained "
      "(or transformers' save_pretrained with safetensors)."
  )


def tensor_shape(path: str, index: dict[str, str], name: str) -> tuple[int, ...]:
  """Shape of tensor `name` of the checkpoint folder `path` (from its file's header)."""
  file = os.path.join(path, index[name])
  try:
    with safe_open(file, framework="numpy") as f:
      return tuple(f.get_slice(name).get_shape())
  except (SafetensorError, OSError) as e:
    raise ModelFileError(f"Cannot read tensor {name!r} from {file} ({e}); {REWRITE}.") from e


def read_slice(file: str, name: str, index: tuple[slice, ...], *, transpose: bool,
               dtype) -> np.ndarray:
  """`tensor[index]` of tensor `name` in `file`, transposed to our layout when `transpose`, as a
  contiguous host array of `dtype`. The file is opened for this slice only (memory-mapped), so
  none of the checkpoint's pages stay resident after it is copied."""
  try:
    with safe_open(file, framework="numpy") as f:
      part = f.get_slice(name)[index]
  except (SafetensorError, OSError) as e:
    raise ModelFileError(
        f"Cannot read tensor {name!r} from {file} ({e}); the file is corrupt; {REWRITE}."
    ) from e
  part = np.asarray(part)
  if transpose:
    part = part.T
  return np.ascontiguousarray(part, dtype=np.dtype(dtype))


def read_param(path: str, plan: ReadPlan, param: Path, layer: int | None,
               bounds: Sequence[tuple[int, int]], dtype) -> np.ndarray:
  """`param[bounds]` (of its `layer`, for a stacked parameter) read from the checkpoint folder
  `path` as `plan` says, as a host array of `dtype`."""
  source = plan.source(param, layer)
  return read_slice(os.path.join(path, source.file), source.tensor, source_index(source, bounds),
                    transpose=source.transpose, dtype=dtype)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked: jax.Array, value: jax.Array, layer: int) -> jax.Array:
  """`stacked[layer] = value` in place (the stacked buffer is donated)."""
  return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), layer, 0)


def _whole(shape: Sequence[int]) -> list[tuple[int, int]]:
  return [(0, n) for n in shape]


def fill_on_host(flat: dict[Path, object], path: str, plan: ReadPlan) -> dict[Path, object]:
  """The abstract leaves of `flat` read from `path` as `plan` says into (unsharded) device arrays,
  one parameter (one layer of a stacked one) at a time; concrete leaves are kept."""
  out = dict(flat)
  for p, leaf in flat.items():
    if not isinstance(leaf, jax.ShapeDtypeStruct):
      continue
    if not plan.stacked(p):
      out[p] = jnp.asarray(read_param(path, plan, p, None, _whole(leaf.shape), leaf.dtype))
      continue
    stacked = jnp.zeros(leaf.shape, leaf.dtype)
    for layer in range(leaf.shape[0]):
      part = jnp.asarray(read_param(path, plan, p, layer, _whole(leaf.shape[1:]), leaf.dtype))
      stacked = _set_layer(stacked, part, layer)
      del part
    out[p] = stacked
  return out


def fill_sharded(flat: dict[Path, object], path: str, plan: ReadPlan,
                 mesh: Mesh) -> dict[Path, jax.Array]:
  """The leaves of `flat` as arrays sharded on `mesh` (`rules.partition_spec`): abstract ones read
  from `path` as `plan` says, each device's shard slice by slice; concrete ones placed."""
  out = {}
  for p, leaf in flat.items():
    sharding = NamedSharding(mesh, partition_spec(p, leaf.shape, mesh))
    if not isinstance(leaf, jax.ShapeDtypeStruct):
      out[p] = jax.device_put(leaf, sharding)
      continue

    def callback(idx, p=p, leaf=leaf):
      bounds = slice_bounds(idx, leaf.shape)
      if not plan.stacked(p):
        return read_param(path, plan, p, None, bounds, leaf.dtype)
      return np.stack([read_param(path, plan, p, layer, bounds[1:], leaf.dtype)
                       for layer in range(*bounds[0])])

    out[p] = jax.make_array_from_callback(leaf.shape, sharding, callback)
  return out


def load_params(model_abstract: nnx.Module, path: str, config: ModelConfig, *, head: str,
                mesh: Mesh | None = None):
  """Fills the abstract (`jax.ShapeDtypeStruct`) parameters of `model_abstract` from `path`.

  Parameters that are already concrete arrays are kept (e.g. a freshly initialised head). With
  a `mesh`, every parameter is read slice by slice straight into its shards (`fill_sharded`);
  without, into single-device arrays (`fill_on_host`). Both fill the same `tensors.read_plan`.

  Raises:
    ModelFileError: naming the missing and unexpected tensors, the tensor whose shape differs
      from the model's (with both shapes), or an unreadable file.
  """
  graphdef, state = nnx.split(model_abstract)
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
  index = checkpoint_index(path)
  plan = read_plan(flat, config, head=head, index=index, path=path,
                   shape_of=lambda name: tensor_shape(path, index, name))
  if mesh is not None:
    flat = fill_sharded(flat, path, plan, mesh)
  else:
    flat = fill_on_host(flat, path, plan)
  nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(flat))
  return nnx.merge(graphdef, state)


def _read_model_type(path: str) -> str:
  """`model_type` of `path/config.json`, checked against `SUPPORTED_MODEL_TYPES`.

  Raises:
    MissingModelFileError: no config.json.
    ModelFileError: config.json is not a JSON object (naming the line).
    UnsupportedModelError: a missing or unsupported `model_type` (listing the supported ones).
  """
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    hub = (f" (as a Hugging Face Hub id, pass `hub_model_folder({str(path)!r}, field=...)`, "
           "its snapshot in the local cache; run configs do that themselves)"
           if is_hub_id(str(path)) and not os.path.exists(path) else "")
    raise MissingModelFileError(
        f"No config.json in {path!r}; give a Hugging Face model folder written by "
        f"save_pretrained{hub}."
    )
  try:
    with open(config_path, encoding="utf-8") as f:
      raw = json.load(f)
  except json.JSONDecodeError as e:
    raise ModelFileError(
        f"{config_path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
        f"{REWRITE}."
    ) from e
  except UnicodeDecodeError as e:
    raise ModelFileError(f"{config_path} is not UTF-8 text ({e}); {REWRITE}.") from e
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


def has_score_head(path: str) -> bool:
  """Whether the checkpoint folder `path` holds a scalar head (`score.weight`: a
  `*ForSequenceClassification` checkpoint, or a reward model of ours), read from the files'
  headers only (no tensor is loaded). A causal-LM checkpoint has none: `load_scalar_model` gives
  it a new, randomly initialised head.

  Raises:
    ModelFileError: no weights in `path`, or an unreadable index or safetensors file
      (`checkpoint_index`).
  """
  return "score.weight" in checkpoint_index(path)


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
    mesh: Mesh | None = None,
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
    mesh: Mesh | None = None,
) -> ScalarModel:
  """Loads a reward or value model from a local checkpoint folder.

  A `*ForSequenceClassification` checkpoint (one label) brings its `score.weight` as the head
  (and `config.json`'s `SCORE_BIAS_KEY`, e.g. a reward normalisation, as its bias; 0 without);
  a causal-LM checkpoint (e.g. the SFT policy) brings the trunk only, and the head is new:
  `head_init="reward"` (N(0, 1/sqrt(D + 1)), the default) or `"zeros"`. The loader does not
  refuse a folder without a head (the reward-model stage starts from one on purpose): callers
  that need a trained head check `has_score_head` first (`jax_ppo.runs.ppo` does).

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
    rows = tensor_shape(path, index, "score.weight")[0]
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
