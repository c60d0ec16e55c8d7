"""`jax_ppo.runs.run_folders`: a run folder given to the wrong verb says which stage wrote it.

`jax-ppo eval` / `export` pointed at an SFT or reward-model run folder, `jax-ppo train` resuming
one, and `jax-ppo sft` / `reward` given another stage's folder are one line naming the stage that
wrote the folder and what to use instead, before anything loads; no file changes. The folders are
what the run loop writes first (`config.yaml`, `jax_ppo.config_io.save_config`).
"""

import hashlib
import pathlib

import pytest

pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
pytest.importorskip("transformers")

from jax_ppo.cli import main  # noqa: E402
from jax_ppo.config_io import save_config  # noqa: E402
from jax_ppo.runs import ppo, reward, sft  # noqa: E402
from jax_ppo.runs.ppo_config import load_run_config  # noqa: E402
from jax_ppo.runs.run_folders import check_run_folder_stage, run_folder_stage  # noqa: E402
from tests.tiny_hf_run import make_checkpoint, write_data  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """A tiny model, data files and one run folder of each stage."""
  root = tmp_path_factory.mktemp("run_folders")
  files = {"model": make_checkpoint(root, "llama"), **write_data(root)}
  configs = {
      "ppo": load_run_config([f"policy_path={files['model']}", f"run_dir={root / 'ppo'}",
                              f"prompts_path={files['prompts']}", "reward_function=length"]),
      "sft": sft.load_sft_config([f"model_path={files['model']}", f"run_dir={root / 'sft'}",
                                  f"train_path={files['sft']}"]),
      "reward": reward.load_reward_config([f"model_path={files['model']}",
                                           f"run_dir={root / 'reward'}",
                                           f"train_path={files['prefs']}"]),
  }
  for stage, config in configs.items():
    (root / stage).mkdir()
    save_config(config, root / stage)
  return {"root": root, **files}


def _hashes(folder) -> dict[str, str]:
  return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}


def test_run_folder_stage(folders, tmp_path):
  for stage in ("ppo", "sft", "reward"):
    assert run_folder_stage(folders["root"] / stage) == stage
    check_run_folder_stage(folders["root"] / stage, stage, field="F")  # its own stage passes
  assert run_folder_stage(tmp_path / "new") is None  # absent
  assert run_folder_stage(tmp_path) is None  # no config.yaml: a new folder
  (tmp_path / "config.yaml").write_text("[not, a, mapping]\n")
  assert run_folder_stage(tmp_path) is None  # the verb's own loading reports it
  check_run_folder_stage(tmp_path, "ppo", field="F")


@pytest.mark.parametrize("verb, stage", [("eval", "sft"), ("eval", "reward"),
                                         ("export", "sft"), ("export", "reward")])
def test_eval_and_export_of_another_stage_s_folder(verb, stage, folders, tmp_path, capsys):
  run_dir = folders["root"] / stage
  before = _hashes(folders["root"])
  extra = (["--prompts", folders["prompts"]] if verb == "eval"
           else ["--out", str(tmp_path / "hf")])
  assert main([verb, "--run-dir", str(run_dir), *extra]) == 2
  err = capsys.readouterr().err
  command = {"sft": "jax-ppo sft", "reward": "jax-ppo reward"}[stage]
  assert err == (
      f"jax-ppo {verb}: error: --run-dir={str(run_dir)!r} is a run folder of `{command}` "
      f"(stage {stage}), not of `jax-ppo train`; use the run_dir of a `jax-ppo train` run "
      f"(`jax-ppo {verb}` reads those; this run's model is exported to "
      f"{str(run_dir / 'hf_model')!r} when it is complete).\n")
  with pytest.raises(ValueError, match=rf"is a run folder of `{command}` \(stage {stage}\)"):
    if verb == "eval":
      ppo.evaluate_run(run_dir, folders["prompts"])
    else:
      ppo.export_run(run_dir, tmp_path / "hf")
  assert _hashes(folders["root"]) == before and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("verb, stage", [("train", "sft"), ("train", "reward"), ("sft", "ppo"),
                                         ("sft", "reward"), ("reward", "sft")])
def test_a_run_of_one_stage_in_another_stage_s_folder(verb, stage, folders, capsys):
  run_dir = folders["root"] / stage
  before = _hashes(folders["root"])
  if verb == "train":
    argv = [f"policy_path={folders['model']}", f"prompts_path={folders['prompts']}",
            "reward_function=length", f"run_dir={run_dir}"]
  else:
    argv = [f"model_path={folders['model']}", f"run_dir={run_dir}",
            f"train_path={folders['sft' if verb == 'sft' else 'prefs']}"]
  assert main([verb, *argv]) == 2
  err = capsys.readouterr().err
  commands = {"ppo": "jax-ppo train", "sft": "jax-ppo sft", "reward": "jax-ppo reward"}
  own = {"train": "ppo"}.get(verb, verb)
  field = {"ppo": "RunConfig", "sft": "SFTRunConfig", "reward": "RewardRunConfig"}[own]
  assert err == (
      f"jax-ppo {verb}: error: {field}.run_dir={str(run_dir)!r} is a run folder of "
      f"`{commands[stage]}` (stage {stage}), not of `{commands[own]}`; use a new folder for this "
      f"run (or resume that run with `{commands[stage]}`).\n")
  with pytest.raises(ValueError, match=rf"^{field}.run_dir=.* is a run folder of "):
    if verb == "train":
      ppo.run_training(load_run_config(argv))
    elif verb == "sft":
      sft.run_sft(sft.load_sft_config(argv))
    else:
      reward.run_reward(reward.load_reward_config(argv))
  assert _hashes(folders["root"]) == before
