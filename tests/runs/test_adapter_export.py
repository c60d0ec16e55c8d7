"""`export_adapter_dir`: `jax-ppo sft` and `jax-ppo train` with LoRA write the adapters as a PEFT
adapter folder that `peft` loads on the starting model with the merged export's logits, and
`jax-ppo export --adapter` writes the same from a checkpoint; a run
without LoRA, a reward-model run, a grown vocabulary and an adapter folder on the model export are
one clear error before any weights load (or before training)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="the adapter folder is checked by loading it with peft")

from jax_ppo.cli import main  # noqa: E402
from jax_ppo.models.hf import ADAPTER_CONFIG, ADAPTER_WEIGHTS  # noqa: E402
from tests.tiny_hf_run import make_checkpoint, tree_hashes, write_data  # noqa: E402

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

SFT = ["dtype=float32", "sft.max_length=16", "sft.batch_size=4", "sft.total_steps=2",
       "sft.optimizer.learning_rate=5e-2", "sft.optimizer.warmup_steps=0", "run.progress=false",
       "run.tensorboard=false", "lora.rank=2", "lora.alpha=3", "lora.targets=[q,v,up,down]"]
IDS = np.array([[3, 4, 5, 6, 7, 8]], np.int64)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  root = tmp_path_factory.mktemp("adapter")
  return {"root": root, "model": make_checkpoint(root, "llama"), **write_data(root)}


def _summary(capsys) -> dict:
  lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
  return json.loads(lines[-1])


def _logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(IDS)).logits.float().numpy()


def _check_adapter(folder, base_path, merged_path):
  """PEFT on the starting model gives the merged export's logits, which differ from the base's."""
  names = {p.name for p in folder.iterdir()}
  assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "tokenizer.json"} <= names and "config.json" not in names
  config = json.loads((folder / ADAPTER_CONFIG).read_text())
  assert config["base_model_name_or_path"] == base_path and config["r"] == 2
  base = transformers.AutoModelForCausalLM.from_pretrained(base_path).eval()
  before = _logits(base)
  adapted = _logits(peft.PeftModel.from_pretrained(base, str(folder)).eval())
  merged = _logits(transformers.AutoModelForCausalLM.from_pretrained(merged_path).eval())
  np.testing.assert_allclose(adapted, merged, atol=1e-4)
  assert np.abs(adapted - before).max() > 1e-3  # training moved the adapters


@pytest.mark.slow
def test_sft_with_lora_writes_the_peft_adapter(assets, tmp_path, capsys):
  adapter, export = tmp_path / "adapter", tmp_path / "merged"
  argv = ["sft", f"model_path={assets['model']}", f"train_path={assets['sft']}",
          f"run_dir={tmp_path / 'run'}", f"export_dir={export}", f"export_adapter_dir={adapter}",
          *SFT]
  assert main(argv) == 0, capsys.readouterr().err
  summary = _summary(capsys)
  assert summary["complete"] and summary["adapter_dir"] == str(adapter)
  assert summary["export_dir"] == str(export)
  _check_adapter(adapter, assets["model"], export)
  assert not (tmp_path / "adapter.export-tmp").exists()


@pytest.mark.slow
def test_ppo_train_with_lora_writes_the_peft_adapter(assets, tmp_path, capsys):
  run_dir, adapter = tmp_path / "run", tmp_path / "adapter"
  argv = ["train", f"policy_path={assets['model']}", f"prompts_path={assets['prompts']}",
          f"run_dir={run_dir}", "reward_function=length", f"export_adapter_dir={adapter}",
          "lora.rank=2", "lora.alpha=3", "ppo.batch_size=4", "ppo.num_minibatches=2",
          "ppo.ppo_epochs=1", "ppo.sampling.max_new_tokens=4", "ppo.total_updates=1",
          "ppo.optimizer.learning_rate=5e-2", "run.progress=false", "run.plots=false",
          "run.tensorboard=false"]
  assert main(argv) == 0, capsys.readouterr().err
  capsys.readouterr()
  merged, exported = tmp_path / "merged", tmp_path / "exported"
  assert main(["export", "--run-dir", str(run_dir), "--out", str(merged)]) == 0
  _check_adapter(adapter, assets["model"], merged)
  # `jax-ppo export --adapter` writes the same adapters from the run's checkpoint
  assert main(["export", "--run-dir", str(run_dir), "--out", str(exported), "--adapter"]) == 0
  assert json.loads(capsys.readouterr().out.splitlines()[-1])["out"] == str(exported)
  _check_adapter(exported, assets["model"], merged)
  from safetensors.numpy import load_file

  ours, theirs = (load_file(str(f / ADAPTER_WEIGHTS)) for f in (exported, adapter))
  assert ours.keys() == theirs.keys()
  for name, value in ours.items():
    np.testing.assert_array_equal(value, theirs[name], err_msg=name)


def test_export_adapter_of_a_run_without_lora_is_refused(assets, tmp_path, capsys):
  from jax_ppo.config_io import save_config
  from jax_ppo.runs.ppo_config import RunConfig

  run_dir = tmp_path / "run"
  run_dir.mkdir()
  save_config(RunConfig(policy_path=assets["model"], prompts_path=assets["prompts"],
                        run_dir=str(run_dir), reward_function="length"), run_dir)
  assert main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "a"),
               "--adapter"]) == 2
  err = capsys.readouterr().err
  assert "--adapter: the run in" in err and "trained no LoRA adapters" in err, err
  assert not (tmp_path / "a").exists()


def test_refusals_name_the_field_before_any_weights_load(assets, tmp_path, capsys, no_weights):
  base = [f"model_path={assets['model']}", f"run_dir={tmp_path / 'run'}"]
  sft = ["sft", *base, f"train_path={assets['sft']}"]
  not_adapter = tmp_path / "full"
  not_adapter.mkdir()
  (not_adapter / "notes.txt").write_text("keep")
  cases = [
      ([*sft, f"export_adapter_dir={tmp_path / 'a'}"],
       f"SFTRunConfig.export_adapter_dir={str(tmp_path / 'a')!r} is invalid: a PEFT adapter "
       "export needs LoRA adapters and lora is null"),
      (["reward", *base, f"train_path={assets['prefs']}", f"export_adapter_dir={tmp_path / 'a'}",
        "lora.rank=2"],
       "RewardRunConfig.export_adapter_dir="),
      ([*sft, "lora.rank=2", f"export_dir={tmp_path / 'm'}",
        f"export_adapter_dir={tmp_path / 'm' / 'adapter'}"],
       f"SFTRunConfig.export_adapter_dir={str(tmp_path / 'm' / 'adapter')!r} lies inside "
       f"SFTRunConfig.export_dir={str(tmp_path / 'm')!r}"),
      ([*sft, "lora.rank=2", f"export_adapter_dir={assets['model']}"],
       "SFTRunConfig.export_adapter_dir="),
      ([*sft, "lora.rank=2", f"export_adapter_dir={not_adapter}"],
       "holds no PEFT adapter (no adapter_config.json"),
      (["train", f"policy_path={assets['model']}", f"prompts_path={assets['prompts']}",
        f"run_dir={tmp_path / 'run'}", "reward_function=length",
        f"export_adapter_dir={tmp_path / 'a'}"],
       "RunConfig.export_adapter_dir="),
  ]
  before = tree_hashes(assets["root"], not_adapter)
  for argv, message in cases:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
  assert tree_hashes(assets["root"], not_adapter) == before
  assert not (tmp_path / "run").exists()


def test_a_grown_vocabulary_is_refused_before_training(assets, tmp_path, capsys):
  argv = ["sft", f"model_path={assets['model']}", f"train_path={assets['sft']}",
          f"run_dir={tmp_path / 'run'}", f"export_adapter_dir={tmp_path / 'a'}",
          "pad_token=<newpad>", "resize_embeddings=true", *SFT]  # a new pad token: one more id
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert "SFTRunConfig.export_adapter_dir=" in err and "grew the vocabulary" in err, err
  assert not (tmp_path / "a").exists() and not (tmp_path / "run" / "checkpoints").exists()
