"""`jax_ppo.runs.ppo`: the reward and value models of a PPO run hold a scalar head.

A reward model path that is a causal-LM checkpoint (no `score.weight`, e.g. the SFT export) would
score with a random new head: refused, before any weights load, naming the field and the path. A
value model path of that kind is refused unless `value_model_new_head=true` says a new value head
is meant (a critic from the SFT policy); with it the critic is built. The reward-model stage,
which starts from a causal LM on purpose, is not checked. A refused run changes no file.
"""

import hashlib
import pathlib

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
pytest.importorskip("transformers")

from jax_ppo.cli import main  # noqa: E402
from jax_ppo.models import ScalarModel  # noqa: E402
from jax_ppo.runs import ppo, reward  # noqa: E402
from jax_ppo.runs.ppo_config import load_run_config  # noqa: E402
from tests.tiny_hf_run import make_checkpoint, make_reward_checkpoint, write_data  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  root = tmp_path_factory.mktemp("ppo_heads")
  return {"root": root, "model": make_checkpoint(root, "llama"),
          "reward": make_reward_checkpoint(root, "llama"), **write_data(root)}


@pytest.fixture
def no_weights(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("weights were loaded before the refusal")

  monkeypatch.setattr(ppo, "from_pretrained", refuse)
  monkeypatch.setattr(ppo, "load_scalar_model", refuse)


def _hashes(folder) -> dict[str, str]:
  return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}


def _argv(assets, run_dir, *extra) -> list[str]:
  return [f"policy_path={assets['model']}", f"prompts_path={assets['prompts']}",
          f"run_dir={run_dir}", "run.progress=false", *extra]


def test_a_causal_lm_as_reward_model_is_refused(assets, tmp_path, capsys, no_weights):
  model, run_dir = assets["model"], tmp_path / "run"
  before = _hashes(assets["root"])
  first = (f"RunConfig.reward_model_path={model!r} is a causal-LM checkpoint without a score head "
           "(its safetensors hold no score.weight): PPO would train against the random scores of "
           "a new head; give a reward model (the export_dir of `jax-ppo reward`, or a one-label "
           "*ForSequenceClassification folder).")
  assert main(["train", *_argv(assets, run_dir, f"reward_model_path={model}")]) == 2
  assert capsys.readouterr().err == f"jax-ppo train: error: {first}\n"
  with pytest.raises(ValueError) as error:
    ppo.run_training(load_run_config(_argv(assets, run_dir, f"reward_model_path={model}")))
  assert str(error.value) == first
  # One source of a combined reward: named by its index.
  combined = f"rewards=[{{function: length}}, {{model_path: {model}}}]"
  with pytest.raises(ValueError, match=rf"^RunConfig.rewards\[1\].model_path='{model}' is a "
                                       "causal-LM checkpoint without a score head"):
    ppo.run_training(load_run_config(_argv(assets, run_dir, combined)))
  assert _hashes(assets["root"]) == before and not run_dir.exists()


def test_a_causal_lm_as_value_model_needs_the_switch(assets, tmp_path, capsys, no_weights):
  model, run_dir = assets["model"], tmp_path / "run"
  before = _hashes(assets["root"])
  first = (f"RunConfig.value_model_path={model!r} is a causal-LM checkpoint without a score head "
           "(its safetensors hold no score.weight); set value_model_new_head=true to start the "
           "critic from its trunk with a new value head (e.g. from the SFT policy), or give a "
           "value or reward model (a folder with score.weight).")
  argv = _argv(assets, run_dir, f"reward_model_path={assets['reward']}",
               f"value_model_path={model}")
  assert main(["train", *argv]) == 2
  assert capsys.readouterr().err == f"jax-ppo train: error: {first}\n"
  with pytest.raises(ValueError) as error:
    ppo.build_trainer(load_run_config(argv))
  assert str(error.value) == first
  assert _hashes(assets["root"]) == before and not run_dir.exists()
  # Without a critic the value model is ignored (a warning), so it is not checked.
  ppo.check_scalar_heads(load_run_config([*argv, "ppo.advantage_mode=rloo",
                                          "ppo.n_samples=2", "ppo.batch_size=4"]))
  # A run folder that is only evaluated or exported: its critic comes from the checkpoint.
  ppo.check_scalar_heads(load_run_config(argv), critic=False)


def test_value_model_new_head_builds_the_critic_on_a_causal_lm(assets, tmp_path, monkeypatch):
  built = {}
  monkeypatch.setattr(ppo, "PPOTrainer", lambda *args, **kwargs: built.update(kwargs))
  argv = _argv(assets, tmp_path / "run", "reward_function=length",
               f"value_model_path={assets['model']}", "value_model_new_head=true")
  ppo.build_trainer(load_run_config(argv), open_run=False)
  critic = built["value_model"]
  assert isinstance(critic, ScalarModel)
  kernel = np.asarray(critic.score_head.kernel[...])
  assert kernel.shape[0] == critic.config.hidden_size and np.abs(kernel).sum() > 0
  # With a score head in the folder, the switch replaces it by a new one.
  argv[-2] = f"value_model_path={assets['reward']}"
  ppo.build_trainer(load_run_config(argv), open_run=False)
  new = np.asarray(built["value_model"].score_head.kernel[...]).ravel()
  assert not np.allclose(new, _reward_kernel(assets["reward"]).ravel())


def _reward_kernel(path: str) -> np.ndarray:
  from safetensors.numpy import load_file

  return load_file(str(pathlib.Path(path) / "model.safetensors"))["score.weight"]


def test_value_model_new_head_needs_a_value_model_path(assets, tmp_path, capsys):
  argv = _argv(assets, tmp_path / "run", "reward_function=length", "value_model_new_head=true")
  with pytest.raises(ValueError, match=r"^RunConfig.value_model_new_head=True is invalid: it gives "
                                       r"value_model_path's trunk a new value head, and "
                                       r"value_model_path is null"):
    load_run_config(argv)
  with pytest.raises(ValueError, match=r"RunConfig.value_model_new_head\) in override "
                                       r"\"value_model_new_head='yes'\": Couldn't parse 'yes' "
                                       r"into a bool"):
    load_run_config([*argv[:-1], f"value_model_path={assets['model']}",
                     "value_model_new_head='yes'"])


def test_reward_models_with_a_head_pass_and_the_reward_stage_is_not_checked(assets, tmp_path):
  ppo.check_scalar_heads(load_run_config(_argv(
      assets, tmp_path / "run", f"reward_model_path={assets['reward']}",
      f"value_model_path={assets['reward']}")))
  # The reward-model stage starts from the causal LM on purpose: a new score head.
  trainer = reward.build_reward_trainer(reward.load_reward_config([
      f"model_path={assets['model']}", f"train_path={assets['prefs']}",
      f"run_dir={tmp_path / 'reward'}", "reward.max_length=16", "reward.batch_size=4",
      "run.progress=false"]))
  try:
    assert trainer.step_count == 0
  finally:
    trainer.close()
