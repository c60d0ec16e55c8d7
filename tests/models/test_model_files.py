"""Bad checkpoint folders give one clear error naming the file: missing, truncated or corrupt
safetensors files and shard indexes, a broken config.json, an unsupported architecture."""

from __future__ import annotations

import json
import os

import pytest
from flax import nnx

from jax_ppo import models
from jax_ppo.models import errors
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


@pytest.mark.parametrize("keep", [0, 5, 60, -4])  # empty, no header, cut header, cut data
def test_truncated_safetensors_file_is_named(saved, tmp_path, keep):
  path = _copy(saved[False], tmp_path / "ckpt")
  file = os.path.join(path, "model.safetensors")
  _truncate(file, keep)
  for load in (models.from_pretrained, models.load_scalar_model):
    with pytest.raises(errors.ModelFileError, match="truncated or corrupt") as err:
      load(path)
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
