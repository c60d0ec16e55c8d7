"""The HF-name <-> parameter mapping and the read plan (`jax_ppo.models.hf.tensors`), no files."""

from __future__ import annotations

import pytest
from flax import nnx, traverse_util

from jax_ppo import models
from jax_ppo.models import errors
from jax_ppo.models.hf import tensors
from tests.models.conftest import hf_config


def _abstract(family):
  config = models.config.config_from_hf(hf_config(family))
  model = nnx.eval_shape(lambda: models.CausalLM(config, rngs=nnx.Rngs(0)))
  return config, traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model)))


def _shapes(config, flat):
  """Tensor name -> checkpoint shape, as `save_pretrained` writes them."""
  out = {}
  for spec in tensors.tensor_specs(config, head="lm"):
    slots = [flat[p].shape if spec.layer is None else flat[p].shape[1:] for p in spec.paths]
    out[spec.name] = tensors.hf_shape(spec, slots)
  return out


def _plan(config, flat, shapes, **kw):
  index = dict.fromkeys(shapes, tensors.SINGLE_FILE)
  return tensors.read_plan(flat, config, head="lm", index=index, shape_of=shapes.__getitem__,
                           path="ckpt", **kw)


def test_gpt2_fused_c_attn_splits_into_q_k_v_columns():
  config, flat = _abstract("gpt2")
  plan = _plan(config, flat, _shapes(config, flat))
  q_dim = config.num_heads * config.head_dim
  kv_dim = config.num_kv_heads * config.head_dim
  layer = ("decoder", "layers")
  sources = [plan.source(layer + (n, "kernel"), 1) for n in ("q", "k", "v")]
  assert {s.tensor for s in sources} == {"transformer.h.1.attn.c_attn.weight"}
  assert [s.offset for s in sources] == [0, q_dim, q_dim + kv_dim]
  assert plan.stacked(layer + ("q", "kernel"))
  assert not plan.stacked(("decoder", "embed", "embedding"))
  # Rows [0, 4), columns [2, 5) of v are columns [q + k + 2, q + k + 5) of the fused tensor.
  assert tensors.source_index(sources[2], [(0, 4), (2, 5)]) == (
      slice(0, 4), slice(q_dim + kv_dim + 2, q_dim + kv_dim + 5))


def test_torch_layout_reverses_the_index():
  config, flat = _abstract("llama2")
  plan = _plan(config, flat, _shapes(config, flat))
  source = plan.source(("decoder", "layers", "up", "kernel"), 0)
  assert source == tensors.Source(tensors.SINGLE_FILE, "model.layers.0.mlp.up_proj.weight",
                                  True, 0)
  # ours [in, out][0:3, 8:16] is torch's [out, in][8:16, 0:3]
  assert tensors.source_index(source, [(0, 3), (8, 16)]) == (slice(8, 16), slice(0, 3))


def test_plan_checks_names_and_shapes_before_any_read():
  config, flat = _abstract("llama2")
  shapes = _shapes(config, flat)
  name = "model.layers.1.mlp.up_proj.weight"
  bad = dict(shapes, **{name: (shapes[name][0] + 1, shapes[name][1])})
  with pytest.raises(errors.ModelFileError, match=r"up_proj\.weight.*checkpoint has"):
    _plan(config, flat, bad)
  missing = {k: v for k, v in shapes.items() if k != name}
  with pytest.raises(errors.ModelFileError, match=f"missing tensors: {name}"):
    _plan(config, flat, missing)
  extra = dict(shapes, **{"model.layers.0.mlp.extra.weight": (2, 2)})
  with pytest.raises(errors.ModelFileError, match="unexpected tensors"):
    _plan(config, flat, extra)
