"""Every config under experiments/configs runs end to end, for a few steps, on tiny random Hugging
Face models built here (paths and sizes replaced through key=value overrides; nothing is
downloaded). Pipeline configs run through `jax-ppo pipeline`, PPO configs through
`jax-ppo train`, stage configs through `jax-ppo sft` / `jax-ppo reward`.
"""

import json
import math
import pathlib

import pytest

pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from jax_ppo.cli import main as cli_main  # noqa: E402
from jax_ppo.models import from_pretrained, load_scalar_model  # noqa: E402
from jax_ppo.runs.pipeline import load_pipeline  # noqa: E402
from jax_ppo.runs.ppo_config import load_run_config  # noqa: E402
from jax_ppo.runs.reward import load_reward_config  # noqa: E402
from jax_ppo.runs.sft import load_sft_config  # noqa: E402
from tests.tiny_hf_run import make_checkpoint, make_reward_checkpoint, write_data  # noqa: E402

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"
EXPERIMENTS = ROOT / "experiments"

SFT_SMALL = ["dtype=float32", "sft.max_length=16", "sft.batch_size=4", "sft.total_steps=2",
             "sft.gradient_accumulation_steps=1", "sft.optimizer.warmup_steps=0",
             "sft.eval_every=0", "run.progress=false"]
REWARD_SMALL = ["dtype=float32", "reward.max_length=16", "reward.batch_size=4",
                "reward.total_steps=2", "reward.optimizer.warmup_steps=0", "reward.eval_every=0",
                "normalise_samples=4", "normalise_max_new_tokens=4", "run.progress=false"]
PPO_SMALL = ["dtype=float32", "ppo.batch_size=4", "ppo.num_minibatches=2", "ppo.ppo_epochs=1",
             "ppo.sampling.max_new_tokens=4", "ppo.total_updates=2", "run.progress=false",
             "run.tensorboard=false"]

KIND = {
    "pipeline.yaml": "pipeline", "quickstart.yaml": "pipeline", "sft.yaml": "sft",
    "reward.yaml": "reward", "ppo_reward_model.yaml": "train",
    "grpo_reward_function.yaml": "train", "lora.yaml": "train",
}
"""Every example config and the command that runs it."""
FAMILY = {"pipeline.yaml": "qwen3", "ppo_reward_model.yaml": "qwen3"}
"""The tiny model family each config runs on (default llama): one Qwen3, one Llama at least."""
EXTRA = {"grpo_reward_function.yaml": ["ppo.n_samples=2"]}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  root = tmp_path_factory.mktemp("example_configs")
  return {
      "root": root, **write_data(root),
      "llama": make_checkpoint(root, "llama"), "qwen3": make_checkpoint(root, "qwen3"),
      "llama_reward": make_reward_checkpoint(root, "llama"),
      "qwen3_reward": make_reward_checkpoint(root, "qwen3"),
  }


def _argv(name: str, assets, run_root: pathlib.Path) -> list[str]:
  """The config file and the overrides that point it at the tiny models and data."""
  family = FAMILY.get(name, "llama")
  model, reward = assets[family], assets[f"{family}_reward"]
  kind = KIND[name]
  path = str(CONFIGS / name)
  if kind == "pipeline":
    return [path, f"model_path={model}", f"out_dir={run_root}",
            f"sft.train_path={assets['sft']}", f"reward.train_path={assets['prefs']}",
            f"ppo.prompts_path={assets['prompts']}", f"eval.prompts_path={assets['prompts']}",
            *(f"sft.{o}" for o in SFT_SMALL), *(f"reward.{o}" for o in REWARD_SMALL),
            *(f"ppo.{o}" for o in PPO_SMALL)]
  if kind == "sft":
    return [path, f"model_path={model}", f"train_path={assets['sft']}",
            f"run_dir={run_root / 'sft'}", *SFT_SMALL]
  if kind == "reward":
    return [path, f"model_path={model}", f"train_path={assets['prefs']}",
            f"run_dir={run_root / 'reward'}", *REWARD_SMALL]
  argv = [path, f"policy_path={model}", f"prompts_path={assets['prompts']}",
          f"run_dir={run_root / 'ppo'}", *PPO_SMALL, *EXTRA.get(name, [])]
  if "reward_model_path" in (CONFIGS / name).read_text():
    argv.append(f"reward_model_path={reward}")
  return argv


def test_every_example_config_is_exercised():
  assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(KIND)


@pytest.mark.parametrize("name", sorted(KIND))
def test_example_config_loads_with_its_documented_command(name, assets, tmp_path):
  """Fast: every example config (as shipped, only paths and sizes replaced) is a valid config
  of its command; the pipelines wire the stages into each other."""
  argv = _argv(name, assets, tmp_path)
  kind = KIND[name]
  if kind == "pipeline":
    configs = load_pipeline(argv)
    sft, reward, ppo = configs["sft"], configs["reward"], configs["ppo"]
    assert sft.model_path == assets[FAMILY.get(name, "llama")]
    assert reward.model_path == str(sft.export_path) == ppo.policy_path
    assert ppo.reward_model_path == str(reward.export_path)
    assert {c.run_dir for c in (sft, reward, ppo)} == {
        str(tmp_path / s) for s in ("sft", "reward", "ppo")}
    assert configs["eval"].prompts_path == str(assets["prompts"])
  else:
    loader = {"sft": load_sft_config, "reward": load_reward_config, "train": load_run_config}
    config = loader[kind](argv)
    assert config.run_dir.startswith(str(tmp_path))


def _run(name: str, argv: list[str], capsys) -> list[dict]:
  rc = cli_main([KIND[name], *argv])
  out, err = capsys.readouterr()
  assert rc == 0, err
  return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(KIND))
def test_example_config_runs_end_to_end(name, assets, tmp_path, capsys, monkeypatch):
  monkeypatch.syspath_prepend(str(EXPERIMENTS))  # example_rewards:positive_words
  argv = _argv(name, assets, tmp_path)
  summaries = _run(name, argv, capsys)
  kind = KIND[name]
  if kind == "pipeline":
    assert [s["stage"] for s in summaries] == ["sft", "reward", "ppo"]
    assert all(s["complete"] for s in summaries)
    sft, reward, ppo = summaries
    assert sft["steps_run"] == 2 and reward["steps_run"] == 2 and ppo["updates_run"] == 2
    from_pretrained(ppo["export_dir"])
    load_scalar_model(reward["export_dir"])
    # The final PPO checkpoint scored the held-out prompts, as `jax-ppo eval` does.
    assert ppo["eval"]["step"] == 2 and math.isfinite(ppo["eval"]["eval/score_mean"])
    saved = json.loads(pathlib.Path(ppo["eval"]["out"]).read_text())
    assert saved["step"] == 2 and saved["metrics"] == {
        k: v for k, v in ppo["eval"].items() if k.startswith("eval/")}
    # The same command again resumes every stage: nothing left to train.
    again = _run(name, argv, capsys)
    assert [s.get("steps_run", s.get("updates_run")) for s in again] == [0, 0, 0]
  elif kind in ("sft", "reward"):
    (summary,) = summaries
    assert summary["complete"] and summary["steps_run"] == 2
    model = (from_pretrained if kind == "sft" else load_scalar_model)(summary["export_dir"])
    assert model.config.vocab_size > 0
  else:
    (summary,) = summaries
    assert summary["updates_run"] == 2 and summary["step"] == 2
    metrics = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [m["step"] for m in metrics if "objective/scores" in m][-1] == 2
