"""Hugging Face Hub ids in run configs (`jax_ppo.runs.common.resolve_model_paths`): every model
field (PPO's `rewards[i].model_path` too) that names an id is the folder of its snapshot in the
local cache, once, when the run starts; an SFT run loads an id, records the snapshot
folder in its config.yaml and opens again with the same id; an absent id is one line naming
the field and `hf download`, before any weights load."""

from __future__ import annotations

import shutil

import pytest
import yaml

from jax_ppo.cli import main
from jax_ppo.runs.common import resolve_model_paths
from jax_ppo.runs.dpo import DPORunConfig
from jax_ppo.runs.ppo_config import load_run_config
from jax_ppo.runs.sft import build_sft_trainer, load_sft_config
from tests.tiny_hf_run import cache_snapshot, make_checkpoint, write_data

pytest.importorskip("torch", reason="torch builds the tiny Hugging Face model")


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """An empty hub cache folder named by HF_HUB_CACHE."""
  folder = tmp_path / "hub"
  folder.mkdir()
  monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
  monkeypatch.setenv("HF_HUB_CACHE", str(folder))
  return folder


def test_every_model_field_of_a_ppo_config_is_resolved(cache, tmp_path):
  policy = cache_snapshot(cache, "org/policy")
  reward = cache_snapshot(cache, "org/rm", commit="b" * 40)
  local = tmp_path / "reference"
  local.mkdir()
  config = load_run_config([
      "policy_path=org/policy", f"prompts_path={tmp_path / 'p.txt'}",
      f"run_dir={tmp_path / 'run'}", f"reference_path={local}",
      "rewards=[{model_path: org/rm@main, weight: 1.0}, {function: length, weight: 0.1}]"])
  resolved = resolve_model_paths(config)
  assert resolved.policy_path == str(policy)
  assert resolved.reference_path == str(local)  # a local folder stays as given
  assert [r.model_path for r in resolved.rewards] == [str(reward), None]
  assert [r.function for r in resolved.rewards] == [None, "length"]
  assert resolve_model_paths(resolved) is resolved  # nothing left to resolve

  missing = load_run_config([
      "policy_path=org/policy", "prompts_path=p.txt", "run_dir=r",
      "rewards=[{function: length}, {model_path: org/gone}]"])
  with pytest.raises(FileNotFoundError, match=r"RunConfig\.rewards\[1\]\.model_path='org/gone'"
                                              r".*`hf download org/gone`"):
    resolve_model_paths(missing)


def test_a_dpo_reference_id_is_resolved(cache, tmp_path):
  model = cache_snapshot(cache, "org/sft")
  config = DPORunConfig(model_path="org/sft", reference_path="org/sft", train_path="t.jsonl",
                        run_dir=str(tmp_path / "dpo"))
  resolved = resolve_model_paths(config)
  assert (resolved.model_path, resolved.reference_path) == (str(model), str(model))


def test_an_sft_run_loads_a_cached_hub_id_and_reopens_with_it(cache, tmp_path):
  """The trainer loads the snapshot's weights and tokenizer; the run folder records the snapshot
  folder, and the same config (the same id) opens the folder again as the same run."""
  built = make_checkpoint(tmp_path / "built", "llama")
  snapshot = cache_snapshot(cache, "org/tiny", files=())
  shutil.copytree(built, snapshot, dirs_exist_ok=True)
  data = write_data(tmp_path)
  run_dir = tmp_path / "sft"
  config = load_sft_config([
      "model_path=org/tiny", f"train_path={data['sft']}", f"run_dir={run_dir}",
      "sft.max_length=16", "sft.batch_size=4", "run.progress=false", "run.tensorboard=false"])
  trainer = build_sft_trainer(config)
  try:
    assert trainer.run.run_config.model_path == str(snapshot)
    assert trainer.tokenizer.pad_token == "<pad>"  # the snapshot's tokenizer
  finally:
    trainer.close()
  saved = yaml.safe_load((run_dir / "config.yaml").read_text())
  assert saved["model_path"] == str(snapshot)  # the run records the snapshot it starts from
  build_sft_trainer(config).close()  # the same id: the same run (a changed config is refused)


def test_an_absent_id_is_one_line_before_any_weights_load(cache, tmp_path, capsys, no_weights):
  data = {"t": tmp_path / "t.jsonl"}
  data["t"].write_text('{"prompt": "a", "response": "b"}\n')
  code = main(["sft", "model_path=org/absent", f"train_path={data['t']}",
               f"run_dir={tmp_path / 'sft'}"])
  err = capsys.readouterr().err
  assert code == 2 and len(err.strip().splitlines()) == 1
  assert err.startswith("jax-ppo sft: error: SFTRunConfig.model_path='org/absent': no local "
                        "folder there")
  assert "`hf download org/absent`" in err and str(cache) in err
  assert not (tmp_path / "sft").exists()
