"""Mesh configuration and logical-axis rules (in the pytest process: no devices needed, the
specs are computed against an `AbstractMesh`)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from jax_ppo.models.config import ModelConfig
from jax_ppo.models.lora import LoRAConfig, add_lora
from jax_ppo.models.transformer import CausalLM
from jax_ppo.parallel import (
    MeshConfig,
    batch_spec,
    logical_axes,
    make_mesh,
    partition_spec,
)

MESH = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
MODEL = ModelConfig(
    model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
    tie_word_embeddings=False,
)


def test_mesh_config_resolves_the_rest():
  assert MeshConfig().shape(8) == (8, 1, 1)
  assert MeshConfig(fsdp=2, tensor=2).shape(8) == (2, 2, 2)
  assert MeshConfig(data=1, fsdp=-1).shape(8) == (1, 8, 1)
  assert MeshConfig(data=2, fsdp=2, tensor=2).shape(8) == (2, 2, 2)


@pytest.mark.parametrize("kwargs, devices, message", [
    (dict(fsdp=0), 8, "MeshConfig.fsdp must be a positive int or -1"),
    (dict(data=-1, fsdp=-1), 8, "at most one axis may be -1"),
    (dict(data=2, fsdp=2, tensor=1), 8, "needs 4 devices but 8 are available"),
    (dict(fsdp=3), 8, "do not divide the 8 devices"),
])
def test_mesh_config_errors_name_the_field(kwargs, devices, message):
  with pytest.raises(ValueError, match=message):
    MeshConfig(**kwargs).shape(devices)


def test_make_mesh_on_one_device():
  mesh = make_mesh()
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize("path, shape, spec", [
    (("decoder", "embed", "embedding"), (64, 32), PartitionSpec("tensor", "fsdp")),
    (("decoder", "layers", "q", "kernel"), (2, 32, 32), PartitionSpec(None, "fsdp", "tensor")),
    (("decoder", "layers", "k", "kernel"), (2, 32, 16), PartitionSpec(None, "fsdp", "tensor")),
    (("decoder", "layers", "o", "kernel"), (2, 32, 32), PartitionSpec(None, "tensor", "fsdp")),
    (("decoder", "layers", "gate", "kernel"), (2, 32, 64), PartitionSpec(None, "fsdp", "tensor")),
    (("decoder", "layers", "down", "kernel"), (2, 64, 32), PartitionSpec(None, "tensor", "fsdp")),
    (("decoder", "layers", "q", "bias"), (2, 32), PartitionSpec(None, "tensor")),
    (("decoder", "layers", "o", "bias"), (2, 32), PartitionSpec(None, None)),
    (("decoder", "layers", "attn_norm", "scale"), (2, 32), PartitionSpec(None, None)),
    (("decoder", "final_norm", "scale"), (32,), PartitionSpec(None)),
    (("lm_head", "kernel"), (32, 64), PartitionSpec("fsdp", "tensor")),
    (("value_head", "kernel"), (32, 1), PartitionSpec(None, None)),
    # LoRA adapters follow the kernel they adapt; the rank is replicated.
    (("decoder", "layers", "q", "lora_a"), (2, 32, 4), PartitionSpec(None, "fsdp", None)),
    (("decoder", "layers", "q", "lora_b"), (2, 4, 32), PartitionSpec(None, None, "tensor")),
    # A dimension the mesh axis does not divide is replicated.
    (("decoder", "embed", "embedding"), (63, 32), PartitionSpec(None, "fsdp")),
    # Scalars and unknown leaves (keys, counters) are replicated.
    (("rng",), (2,), PartitionSpec(None)),
    (("step",), (), PartitionSpec()),
])
def test_partition_spec_by_parameter_kind(path, shape, spec):
  assert partition_spec(path, shape, MESH) == spec


def test_rules_cover_every_parameter_and_optimizer_moment():
  """Every kernel and embedding of a LoRA model, and its Adam moments, get a split spec."""
  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  add_lora(model, LoRAConfig(rank=4, targets=("q", "k", "v", "o", "gate", "up", "down")),
           rngs=nnx.Rngs(1))
  _, lora, base = nnx.split(model, nnx.LoRAParam, ...)
  opt = optax.adamw(1e-3).init({"policy": lora})
  for tree in (base, lora, opt):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      names = jax.tree_util.keystr(path)
      spec = partition_spec(path, x.shape, MESH)
      if any(k in names for k in ("'kernel'", "'embedding'", "'lora_a'", "'lora_b'")):
        assert any(a is not None for a in spec), names
        assert len(logical_axes(path, x.shape)) == x.ndim


def test_batch_spec_splits_rows_over_data_and_fsdp():
  assert batch_spec((8, 5), MESH) == PartitionSpec(("data", "fsdp"), None)
  assert batch_spec((6, 5), MESH) == PartitionSpec(None, None)  # 6 rows do not split 4 ways
  assert batch_spec((), MESH) == PartitionSpec()
  assert batch_spec(jnp.zeros((4,)).shape, MESH) == PartitionSpec(("data", "fsdp"))


def test_the_decode_steps_activations_split_on_the_width_like_the_weights():
  from jax_ppo.parallel.rules import stationary_spec

  # [B, 1, D]: D over fsdp (as the kernels' `embed` axis), the rows over data.
  assert stationary_spec((8, 1, 32), MESH) == PartitionSpec("data", None, "fsdp")
  assert partition_spec(("decoder", "layers", "q", "kernel"), (2, 32, 32), MESH) == (
      PartitionSpec(None, "fsdp", "tensor"))
  fsdp_only = AbstractMesh((1, 8, 1), ("data", "fsdp", "tensor"))
  assert stationary_spec((64, 1, 4096), fsdp_only) == PartitionSpec(None, None, "fsdp")
  # A width fsdp does not divide stays whole; the rows then take every batch axis.
  assert stationary_spec((8, 1, 33), MESH) == PartitionSpec(("data", "fsdp"), None, None)
  assert stationary_spec((5, 1, 32), MESH) == PartitionSpec(None, None, "fsdp")  # 5 rows: whole


def test_rows_per_device_follow_the_batch_split():
  from jax_ppo.parallel.rules import gather_layers, rows_per_device

  assert rows_per_device(8) == 8  # no mesh: one device holds every row
  with gather_layers(MESH):
    assert rows_per_device(8) == 2  # split over data x fsdp = 4, as batch_spec splits them
    assert rows_per_device(6) == 6  # 6 rows do not split 4 ways: replicated
  with gather_layers(AbstractMesh((1, 8, 1), ("data", "fsdp", "tensor"))):
    assert rows_per_device(64) == 8
