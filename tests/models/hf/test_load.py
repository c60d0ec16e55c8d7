"""Loading checkpoint folders (`jax_ppo.models.hf.load`).

The host and the sharded path fill one read plan with the same reads and values; bad checkpoint
folders give one clear error naming the file: missing, truncated or corrupt safetensors files and
shard indexes, a broken config.json, an unsupported architecture, missing, unexpected or
mis-shaped tensors."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx, traverse_util
from safetensors.numpy import load_file, save_file

from jax_ppo import models
from jax_ppo.models import errors
from jax_ppo.models.hf import load
from jax_ppo.parallel import MeshConfig, make_mesh
from tests.models.conftest import hf_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """`saved(sharded) -> folder` of a tiny random Llama written by `save_pretrained`."""
  config = models.config.config_from_hf(hf_config("llama2"))
  model = models.CausalLM(config, rngs=nnx.Rngs(0))
  single = str(tmp_path_factory.mktemp("single"))
  sharded = str(tmp_path_factory.mktemp("sharded"))
  models.save_pretrained(model, single)
  models.save_pretrained(model, sharded, max_shard_size="30KB")
  return {False: single, True: sharded}


def _copy(src, dst):
  import shutil

  shutil.copytree(src, dst)
  return str(dst)


def _truncate(file, keep):
  with open(file, "rb") as f:
    data = f.read()
  with open(file, "wb") as f:
    f.write(data[: keep if keep >= 0 else len(data) + keep])


def _flat(model):
  return traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model)))


@pytest.mark.parametrize("family", ["llama2", "gpt2"])  # torch layout; fused c_attn
def test_host_and_sharded_paths_fill_one_plan(family, tmp_path, monkeypatch):
  config = models.config.config_from_hf(hf_config(family))
  model = models.CausalLM(config, rngs=nnx.Rngs(0))
  state = nnx.state(model)  # biases and norm gains away from their init, so a wrong slice shows
  nnx.update(model, jax.tree.map(
      lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape), state))
  path = str(tmp_path / family)
  models.save_pretrained(model, path)
  plans, reads = [], []
  read_plan, read_slice = load.read_plan, load.read_slice

  def spy_plan(*args, **kw):
    plans.append(read_plan(*args, **kw))
    return plans[-1]

  def spy_slice(file, name, index, **kw):
    out = read_slice(file, name, index, **kw)
    reads[-1].append((name, out.size))
    return out

  monkeypatch.setattr(load, "read_plan", spy_plan)
  monkeypatch.setattr(load, "read_slice", spy_slice)
  reads.append([])
  host = _flat(models.from_pretrained(path))
  reads.append([])
  sharded = _flat(models.from_pretrained(path, mesh=make_mesh(MeshConfig(data=1))))
  assert len(plans) == 2 and plans[0] == plans[1]
  fused = {s.tensor for s in plans[0].sources.values() if s.offset}
  assert bool(fused) == (family == "gpt2")
  assert set(host) == set(sharded) == set(_flat(model))
  for p, want in _flat(model).items():
    np.testing.assert_array_equal(np.asarray(host[p]), np.asarray(want), err_msg=str(p))
    np.testing.assert_array_equal(np.asarray(sharded[p]), np.asarray(want), err_msg=str(p))
  # Both read every planned tensor and each parameter element exactly once.
  planned = {s.tensor for s in plans[0].sources.values()}
  elements = sum(np.size(x) for x in host.values())
  for r in reads:
    assert {name for name, _ in r} == planned
    assert sum(n for _, n in r) == elements


@pytest.mark.parametrize("keep", [0, 5, 60, -4])  # empty, no header, cut header, cut data
def test_truncated_safetensors_file_is_named(saved, tmp_path, keep):
  path = _copy(saved[False], tmp_path / "ckpt")
  file = os.path.join(path, "model.safetensors")
  _truncate(file, keep)
  for load_fn in (models.from_pretrained, models.load_scalar_model):
    with pytest.raises(errors.ModelFileError, match="truncated or corrupt") as err:
      load_fn(path)
    assert file in str(err.value)
    assert isinstance(err.value, ValueError)


def test_truncated_shard_is_named_before_anything_loads(saved, tmp_path):
  path = _copy(saved[True], tmp_path / "ckpt")
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
  assert len(shards) > 2
  last = os.path.join(path, shards[-1])
  _truncate(last, -8)
  with pytest.raises(errors.ModelFileError, match="truncated or corrupt") as err:
    models.from_pretrained(path)
  assert last in str(err.value)


def test_missing_shard_and_missing_weights(saved, tmp_path):
  path = _copy(saved[True], tmp_path / "ckpt")
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    shard = sorted(set(json.load(f)["weight_map"].values()))[1]
  os.remove(os.path.join(path, shard))
  with pytest.raises(errors.MissingModelFileError, match="does not exist") as err:
    models.from_pretrained(path)
  assert os.path.join(path, shard) in str(err.value)
  assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, ValueError)
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "config.json").write_text((tmp_path / "ckpt" / "config.json").read_text())
  with pytest.raises(errors.MissingModelFileError, match="No model.safetensors"):
    models.from_pretrained(str(empty))


def test_bad_shard_index(saved, tmp_path):
  path = _copy(saved[True], tmp_path / "ckpt")
  index_file = os.path.join(path, "model.safetensors.index.json")
  with open(index_file) as f:
    index = json.load(f)
  first = next(iter(index["weight_map"]))
  moved = dict(index["weight_map"], **{first: index["weight_map"][first].replace("00001", "00002")})
  with open(index_file, "w") as f:
    json.dump({"weight_map": moved}, f)
  with pytest.raises(errors.ModelFileError, match=f"lacks tensors .*{first}"):
    models.from_pretrained(path)
  with open(index_file, "w") as f:
    f.write('{"weight_map": ')
  with pytest.raises(errors.ModelFileError, match="index.json is unreadable"):
    models.from_pretrained(path)


def test_config_json_missing_or_invalid(saved, tmp_path):
  path = _copy(saved[False], tmp_path / "ckpt")
  config_file = os.path.join(path, "config.json")
  text = open(config_file).read()
  with open(config_file, "w") as f:
    f.write(text.replace('"model_type"', "model_type", 1))
  line = 1 + text[: text.index('"model_type"')].count("\n")
  with pytest.raises(errors.ModelFileError, match=rf"config\.json is not valid JSON \(line {line}"):
    models.from_pretrained(path)
  os.remove(config_file)
  with pytest.raises(errors.MissingModelFileError, match="No config.json"):
    models.load_config(path)


@pytest.mark.parametrize(
    ("patch", "shown"),
    [({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, "MixtralForCausalLM"),
     ({"model_type": "gemma3"}, "'gemma3'"),
     ({"model_type": None}, "None")],
)
def test_unsupported_architecture_lists_supported_ones(saved, tmp_path, patch, shown):
  path = _copy(saved[False], tmp_path / "ckpt")
  config_file = os.path.join(path, "config.json")
  with open(config_file) as f:
    raw = json.load(f)
  raw.update(patch)
  with open(config_file, "w") as f:
    json.dump(raw, f)
  with pytest.raises(errors.UnsupportedModelError) as err:
    models.from_pretrained(path)
  message = str(err.value)
  assert shown in message and config_file in message
  for model_type in models.SUPPORTED_MODEL_TYPES:
    assert model_type in message
  assert "LlamaForCausalLM" in message and "GPT2LMHeadModel" in message


def test_unsupported_option_is_an_unsupported_model_error():
  hf = hf_config("llama2", rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0))
  with pytest.raises(errors.UnsupportedModelError, match="yarn"):
    models.config.config_from_hf(hf)


def test_unsupported_model_type_lists_supported(tmp_path):
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"model_type": "bert", "vocab_size": 10}, f)
  with pytest.raises(ValueError, match="bert") as err:
    models.from_pretrained(str(tmp_path))
  for family in models.SUPPORTED_MODEL_TYPES:
    assert family in str(err.value)
  with pytest.raises(ValueError, match="supported"):
    models.config.config_from_hf(type("C", (), {"model_type": "gemma"})())


def test_missing_and_unexpected_tensors_are_named(hf_checkpoint, tmp_path):
  _, path = hf_checkpoint("qwen3")
  dst = _copy(path, tmp_path / "ckpt")
  file = os.path.join(dst, "model.safetensors")
  tensors = load_file(file)
  del tensors["model.layers.1.self_attn.k_norm.weight"]
  tensors["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
  save_file(tensors, file, metadata={"format": "pt"})
  with pytest.raises(ValueError) as err:
    models.from_pretrained(dst)
  message = str(err.value)
  assert "missing tensors: model.layers.1.self_attn.k_norm.weight" in message
  assert "unexpected tensors: model.layers.0.mlp.extra.weight" in message


def test_shape_mismatch_names_tensor_and_shapes(hf_checkpoint, tmp_path):
  _, path = hf_checkpoint("llama2")
  dst = _copy(path, tmp_path / "ckpt")
  file = os.path.join(dst, "model.safetensors")
  tensors = load_file(file)
  tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((65, 32), np.float32)
  save_file(tensors, file, metadata={"format": "pt"})
  pattern = r"model\.layers\.1\.mlp\.up_proj\.weight.*\(65, 32\).*\(64, 32\)"
  with pytest.raises(ValueError, match=pattern):
    models.from_pretrained(dst)


def test_missing_weights_file(tmp_path, hf_checkpoint):
  _, path = hf_checkpoint("gpt2")
  dst = _copy(path, tmp_path / "ckpt")
  os.remove(os.path.join(dst, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    models.from_pretrained(dst)


def test_has_score_head_tells_a_reward_model_from_a_causal_lm(hf_checkpoint, saved):
  """From the files' headers only: a one-label `*ForSequenceClassification` checkpoint (or a
  sharded causal LM's index) is told apart without loading a tensor."""
  _, reward = hf_checkpoint("llama2", seq_cls=True, num_labels=1)
  _, causal = hf_checkpoint("llama2")
  assert models.has_score_head(reward)
  assert not models.has_score_head(causal)
  assert not models.has_score_head(saved[True])  # sharded: read from the index
