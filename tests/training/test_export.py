"""`jax_ppo.training.export`: an export is written beside its folder and renamed into place (a
failed export leaves an earlier one untouched), replaces an earlier export only once complete,
refuses a folder that holds no model, and writes the tokenizer's pad id into `config.json` and
`generation_config.json` (transformers' `generate` reads it from there)."""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest
from flax import nnx

from jax_ppo.models import CausalLM, ModelConfig
from jax_ppo.training import export as export_lib
from jax_ppo.training.export import check_export_target, export_pretrained

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tests.tiny_hf_run import tokenizer as word_tokenizer  # noqa: E402


def _model(tok) -> CausalLM:
  config = ModelConfig(
      model_type="llama", vocab_size=len(tok), hidden_size=16, intermediate_size=32,
      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=32,
      eos_token_ids=(tok.eos_token_id,), pad_token_id=None)  # as a GPT-2 config: no pad id
  return CausalLM(config, rngs=nnx.Rngs(0))


def _hashes(folder: pathlib.Path) -> dict[str, str]:
  return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tok():
  return word_tokenizer()


def test_the_tokenizers_pad_id_is_written_into_both_configs(tok, tmp_path):
  assert tok.pad_token_id == 0 and tok.eos_token_id == 1
  out = export_pretrained(_model(tok), tmp_path / "hf", tokenizer=tok)
  for name in ("config.json", "generation_config.json"):
    assert json.loads((out / name).read_text())["pad_token_id"] == 0, name
  assert transformers.GenerationConfig.from_pretrained(out).pad_token_id == 0
  assert transformers.AutoConfig.from_pretrained(out).pad_token_id == 0
  # Without a tokenizer the model config's (here none) is kept.
  bare = export_pretrained(_model(tok), tmp_path / "bare")
  assert json.loads((bare / "config.json").read_text()).get("pad_token_id") is None


def test_an_earlier_export_is_replaced_whole_and_nothing_is_left_beside_it(tok, tmp_path):
  target = tmp_path / "hf"
  export_pretrained(_model(tok), target, tokenizer=tok)
  (target / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
  export_pretrained(_model(tok), target, tokenizer=tok)
  assert "model-00001-of-00002.safetensors" not in _hashes(target)
  assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_failed_export_leaves_the_earlier_one_untouched(tok, tmp_path, monkeypatch):
  target = tmp_path / "hf"
  export_pretrained(_model(tok), target, tokenizer=tok)
  before = _hashes(target)

  def fails(model, path, **kw):
    pathlib.Path(path).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(path) / "model.safetensors").write_bytes(b"half")
    raise OSError("No space left on device")

  monkeypatch.setattr(export_lib, "save_pretrained", fails)
  with pytest.raises(OSError, match="No space left"):
    export_pretrained(_model(tok), target, tokenizer=tok)
  assert _hashes(target) == before
  monkeypatch.undo()
  export_pretrained(_model(tok), target, tokenizer=tok)  # the leftovers are cleared
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_folder_that_holds_no_model_is_refused_and_kept(tok, tmp_path):
  notes = tmp_path / "notes"
  notes.mkdir()
  (notes / "todo.txt").write_text("keep me")
  message = (r"^export folder='.*notes' is a folder that holds no model \(no config.json; it "
             r"holds todo.txt\): an export replaces its folder whole and would delete them")
  with pytest.raises(ValueError, match=message):
    export_pretrained(_model(tok), notes, tokenizer=tok)
  assert _hashes(notes) == {"todo.txt": hashlib.sha256(b"keep me").hexdigest()}
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match=r"^out='.*file' is a file, not a folder"):
    check_export_target(tmp_path / "file", field="out")
  (tmp_path / "empty").mkdir()
  check_export_target(tmp_path / "empty")  # an empty folder is fine
  assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "notes"]
