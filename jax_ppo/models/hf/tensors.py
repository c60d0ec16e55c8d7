"""Hugging Face tensor names <-> our parameters, and the one read plan that loading fills.

The checkpoint format and the model meet here, without any file access: `tensor_specs` lists every
tensor of a model's checkpoint and the parameter(s) it fills; `read_plan` checks a checkpoint's
tensor names and shapes against an abstract model and says, for every parameter (and every layer
of a stacked `[L, ...]` parameter), which file, tensor and columns fill it (a `Source`);
`source_index` turns the bounds of any slice of a parameter into the index of the tensor to read.
`jax_ppo.models.hf.load` fills the plan on the host or straight into shards; both read through
the same sources, so they load the same values.

Layouts: torch `Linear` weights are `[out, in]`, ours `[in, out]` (`TensorSpec.transpose`);
GPT-2's `c_attn` is one `[D, 3 D]` tensor (Conv1D, already `[in, out]`) that fills our `q`, `k`
and `v` side by side on the last axis (`Source.offset`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import jax

from jax_ppo.models.config import ModelConfig
from jax_ppo.models.errors import ModelFileError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCORE_BIAS_KEY = "jax_ppo_score_bias"
"""`config.json` key of a `ScalarModel`'s head bias (e.g. its reward normalisation), which HF
`*ForSequenceClassification` heads lack: transformers keeps the key but does not add it, so its
scores are `load_scalar_model`'s minus this constant."""
REWRITE = "download or save the checkpoint again"
"""The fix that every error about an unreadable checkpoint file names."""

Path = tuple[str, ...]
HEADS = ("lm", "score", "none")


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


def trunk_prefix(config: ModelConfig) -> str:
  """The name prefix of the trunk's tensors in transformers' own checkpoints."""
  return "transformer." if config.model_type == "gpt2" else "model."


def tensor_specs(config: ModelConfig, *, head: str, prefix: str | None = None) -> list[TensorSpec]:
  """Every checkpoint tensor of a model with `head` in ("lm", "score", "none")."""
  prefix = trunk_prefix(config) if prefix is None else prefix
  specs = _trunk_specs(config, prefix)
  if head == "lm" and not config.tie_word_embeddings:
    specs.append(TensorSpec("lm_head.weight", (("lm_head", "kernel"),), None, True))
  elif head == "score":
    specs.append(TensorSpec("score.weight", (("score_head", "kernel"),), None, True))
  return specs


def is_ignorable(name: str, config: ModelConfig, head: str) -> bool:
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


def resolve_prefix(config: ModelConfig, names: Iterable[str]) -> str:
  """The trunk prefix used by a checkpoint with tensors `names` ("model."/"transformer.", or none
  for old GPT-2 files)."""
  names = set(names)
  prefix = trunk_prefix(config)
  probe = "wte.weight" if config.model_type == "gpt2" else "embed_tokens.weight"
  if prefix + probe not in names and probe in names:
    return ""
  return prefix


def format_names(names: Iterable[str]) -> str:
  """Up to 20 sorted names, comma-separated, and how many more there are."""
  names = sorted(names)
  shown = ", ".join(names[:20])
  return shown + (f", ... ({len(names) - 20} more)" if len(names) > 20 else "")


def hf_shape(spec: TensorSpec, slot_shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
  """The checkpoint shape of `spec`'s tensor for parameter slots of `slot_shapes` (one layer of a
  stacked parameter): fused slots side by side on the last axis, torch layout reversed."""
  if len(slot_shapes) > 1:
    first = slot_shapes[0]
    return (*first[:-1], sum(s[-1] for s in slot_shapes))
  shape = tuple(slot_shapes[0])
  return tuple(reversed(shape)) if spec.transpose else shape


class Source(NamedTuple):
  """Where one parameter (one layer of a stacked parameter) is read from.

  Attributes:
    file: file name of the tensor, relative to the checkpoint folder.
    tensor: tensor name.
    transpose: the tensor is torch's `[out, in]` layout of our `[in, out]` parameter.
    offset: first column (our last axis) of the parameter in the tensor; nonzero for the `k` and
      `v` slots of a fused `c_attn`.
  """

  file: str
  tensor: str
  transpose: bool
  offset: int


@dataclasses.dataclass(frozen=True)
class ReadPlan:
  """Which file, tensor and columns fill each abstract parameter of a model (`read_plan`).

  Attributes:
    sources: `(parameter path, layer)` -> `Source`; layer None for an unstacked parameter, and
      `0 .. L-1` for each layer of a stacked `[L, ...]` one.
  """

  sources: dict[tuple[Path, int | None], Source]

  def stacked(self, path: Path) -> bool:
    """Whether `path` is a stacked parameter, read layer by layer."""
    return (path, None) not in self.sources

  def source(self, path: Path, layer: int | None = None) -> Source:
    """The `Source` of parameter `path` (of its `layer`, for a stacked parameter)."""
    return self.sources[(path, layer)]


def slice_bounds(index: Sequence[slice], shape: Sequence[int]) -> list[tuple[int, int]]:
  """`(start, stop)` per axis of a slice `index` (e.g. a shard's) into an array of `shape`."""
  out = []
  for sl, n in zip(index, shape, strict=True):
    start, stop, step = sl.indices(n)
    if step != 1:
      raise ValueError(f"Unexpected strided shard index {index}.")
    out.append((start, stop))
  return out


def source_index(source: Source, bounds: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
  """The index into `source.tensor` that holds `param[bounds]` (in our layout, transposed back
  with `.T` when `source.transpose`), for `bounds` over one layer of the parameter."""
  bounds = list(bounds)
  lo, hi = bounds[-1]
  bounds[-1] = (lo + source.offset, hi + source.offset)  # fused tensors: our slot's columns
  hf = list(reversed(bounds)) if source.transpose else bounds
  return tuple(slice(a, b) for a, b in hf)


def read_plan(
    flat: Mapping[Path, object],
    config: ModelConfig,
    *,
    head: str,
    index: Mapping[str, str],
    shape_of: Callable[[str], tuple[int, ...]],
    path: str,
) -> ReadPlan:
  """Checks a checkpoint against a model and plans which tensor fills each abstract parameter.

  Args:
    flat: the model's flattened pure-dict state; leaves that are `jax.ShapeDtypeStruct` are to
      be read, concrete arrays are kept (e.g. a freshly initialised head).
    config: the model's config.
    head: "lm", "score" or "none" (`tensor_specs`).
    index: tensor name -> file name of the checkpoint (`load.checkpoint_index`).
    shape_of: tensor name -> its shape in the checkpoint (read from the file's header).
    path: the checkpoint folder, for error messages.

  Returns:
    The `ReadPlan` of every abstract leaf of `flat`.

  Raises:
    ModelFileError: naming the missing and unexpected tensors, the parameters no tensor fills,
      or the tensor whose shape differs from the model's (with both shapes).
  """
  if head not in HEADS:
    raise ValueError(f"head must be one of {HEADS}, got {head!r}.")
  names = set(index)
  specs = tensor_specs(config, head=head, prefix=resolve_prefix(config, names))
  specs = [s for s in specs if any(isinstance(flat[p], jax.ShapeDtypeStruct) for p in s.paths)]
  expected = {s.name for s in specs}
  missing = expected - names
  unexpected = {n for n in names - expected if not is_ignorable(n, config, head)}
  if missing or unexpected:
    parts = []
    if missing:
      parts.append(f"missing tensors: {format_names(missing)}")
    if unexpected:
      parts.append(f"unexpected tensors: {format_names(unexpected)}")
    raise ModelFileError(
        f"Checkpoint {path!r} does not match a {config.model_type} model "
        f"(head={head!r}): " + "; ".join(parts) + "."
    )
  covered = {p for s in specs for p in s.paths}
  abstract_paths = [p for p, v in flat.items() if isinstance(v, jax.ShapeDtypeStruct)]
  uncovered = [p for p in abstract_paths if p not in covered]
  if uncovered:
    raise ModelFileError(f"No tensor of checkpoint {path!r} fills parameters {uncovered}.")
  sources: dict[tuple[Path, int | None], Source] = {}
  for spec in specs:
    slot_shapes = [flat[p].shape if spec.layer is None else flat[p].shape[1:] for p in spec.paths]
    want = hf_shape(spec, slot_shapes)
    have = tuple(shape_of(spec.name))
    if have != want:
      raise ModelFileError(
          f"Shape mismatch for tensor {spec.name!r} of {path!r}: the checkpoint has {have}, the "
          f"{config.model_type} model expects {want}."
      )
    offset = 0
    for p, shape in zip(spec.paths, slot_shapes, strict=True):
      sources[(p, spec.layer)] = Source(index[spec.name], spec.name, spec.transpose, offset)
      offset += shape[-1]
  return ReadPlan(sources)
