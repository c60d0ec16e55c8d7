"""`RewardModelConfig` and its optimizer block: errors name the field, the block keeps the reward
model's defaults, accumulation must divide the batch; and its moved keys: a config file or
override with an old flat key is one error naming the new key, and a run folder saved before the
block existed (flat `reward.learning_rate`, ... in config.yaml and in its checkpoints) resumes
with the same meaning (`jax_ppo.config_io.migrate_keys`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from flax import nnx

from jax_ppo.checkpoint import CheckpointConfigMismatch
from jax_ppo.config_io import migrate_keys
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.heads import ScalarModel
from jax_ppo.reward_model import RewardModelConfig, RewardModelOptimizer, RewardModelTrainer
from jax_ppo.reward_model.config import OPTIMIZER_FIELDS
from jax_ppo.runs.reward import RewardRunConfig, load_reward_config
from jax_ppo.training import RunOptions

MODEL = ModelConfig(
    model_type="llama", vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=48,
)
BASE = ["model_path=m", "train_path=p.jsonl", "run_dir=r"]


def test_every_old_flat_key_moves_into_the_optimizer_block():
  assert RewardModelConfig.MOVED_KEYS == {f: f"optimizer.{f}" for f in OPTIMIZER_FIELDS}
  assert set(OPTIMIZER_FIELDS) == {f for f in RewardModelOptimizer.__dataclass_fields__}
  old = {"batch_size": 4, "learning_rate": 3e-3, "lr_schedule": "constant", "max_grad_norm": None}
  assert migrate_keys(RewardModelConfig, old) == {
      "batch_size": 4, "optimizer": {"learning_rate": 3e-3, "lr_schedule": "constant",
                                     "max_grad_norm": None}}


def test_an_old_key_in_a_file_or_override_names_the_new_key(tmp_path):
  path = tmp_path / "reward.yaml"
  path.write_text("model_path: m\ntrain_path: p.jsonl\nrun_dir: r\n"
                  "reward: {batch_size: 4, learning_rate: 1.0e-3}\n")
  with pytest.raises(ValueError, match=r"'reward\.learning_rate' has moved to "
                                       r"'reward\.optimizer\.learning_rate'") as e:
    load_reward_config([str(path)])
  assert len(str(e.value).splitlines()) == 1
  with pytest.raises(ValueError, match=r"'reward\.warmup_steps' has moved to "
                                       r"'reward\.optimizer\.warmup_steps'"):
    load_reward_config([*BASE, "reward.warmup_steps=2"])
  config = load_reward_config([*BASE, "reward.optimizer.learning_rate=1e-3",
                               "reward.gradient_accumulation_steps=2"])
  assert config.reward.optimizer == RewardModelOptimizer(learning_rate=1e-3)
  assert config.reward.gradient_accumulation_steps == 2


def _records(n: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  ids = lambda: [int(t) for t in rng.integers(3, 24, size=int(rng.integers(2, 5)))]  # noqa: E731
  return [{"prompt": ids(), "chosen": ids(), "rejected": ids()} for _ in range(n)]


def _trainer(run_dir, learning_rate: float = 3e-3):
  reward = RewardModelConfig(batch_size=4, total_steps=3, max_length=12, eos_token_id=2,
                             optimizer=RewardModelOptimizer(learning_rate=learning_rate))
  run_config = RewardRunConfig(model_path="m", train_path="p.jsonl", run_dir=str(run_dir),
                               reward=reward)
  return RewardModelTrainer(
      reward, ScalarModel(MODEL, rngs=nnx.Rngs(0)), train_data=_records(12, 0),
      run_dir=run_dir, run_config=run_config,
      run_options=RunOptions(save_every=1, progress=False, tensorboard=False,
                             async_checkpointing=False))


def _flatten(saved: dict) -> dict:
  """`saved` as a config written before the optimizer block: its fields flat in `reward`."""
  reward = dict(saved["reward"])
  reward.update(reward.pop("optimizer"))
  reward.pop("gradient_accumulation_steps")  # (added with it)
  return {**saved, "reward": reward}


def test_a_run_folder_saved_with_the_old_flat_keys_resumes(tmp_path):
  run_dir = tmp_path / "rm"
  with _trainer(run_dir) as first:
    first.train(1)
  config_file = run_dir / "config.yaml"
  config_file.write_text(yaml.safe_dump(_flatten(yaml.safe_load(config_file.read_text()))))
  metas = [p for p in (run_dir / "checkpoints").rglob("*") if p.is_file() and p.parent.name ==
           "meta" and '"config"' in p.read_text()]
  assert metas
  for meta in metas:
    data = json.loads(meta.read_text())
    data["config"] = _flatten(data["config"])
    meta.write_text(json.dumps(data))
  assert "learning_rate" in yaml.safe_load(config_file.read_text())["reward"]
  # Another learning rate under the old key is a change of the new key: refused, named.
  with pytest.raises(CheckpointConfigMismatch, match=r"reward\.optimizer\.learning_rate"):
    _trainer(run_dir, learning_rate=1e-3)
  with _trainer(run_dir) as resumed:
    assert resumed.step_count == 1
    resumed.train()
    assert resumed.step_count == 3
  assert "optimizer" in yaml.safe_load(config_file.read_text())["reward"]  # saved anew


@pytest.mark.parametrize("field, value", [
    ("batch_size", 0), ("max_length", 1), ("total_steps", 0), ("eval_every", -1),
    ("pad_token_id", -2), ("chosen_field", ""), ("add_eos", "yes"), ("eos_token_id", 1.5),
    ("eval_fraction", 1.0), ("max_consecutive_skips", 0), ("gradient_accumulation_steps", 0),
])
def test_config_errors_name_the_field(field, value):
  with pytest.raises(ValueError, match=rf"RewardModelConfig\.{field}=.*invalid: "):
    RewardModelConfig(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("learning_rate", 0.0), ("lr_schedule", "step"), ("adam_b2", 1.0), ("max_grad_norm", -1.0),
    ("weight_decay", -0.1), ("adam_b1", "0.9"), ("learning_rate", float("nan")),
])
def test_optimizer_errors_name_the_field(field, value):
  with pytest.raises(ValueError, match=rf"RewardModelOptimizer\.{field}=.*invalid: "):
    RewardModelOptimizer(**{field: value})


def test_optimizer_block_keeps_the_reward_model_defaults():
  """A block that sets one field keeps the reward model's other defaults."""
  block = RewardModelOptimizer(warmup_steps=3)
  assert (block.learning_rate, block.lr_schedule, block.adam_eps) == (1e-5, "linear", 1e-8)
  assert RewardModelConfig().optimizer == RewardModelOptimizer()
  with pytest.raises(ValueError, match=r"learning_rate=0.0 is invalid: .*reward-model"):
    RewardModelOptimizer(learning_rate=0.0)


def test_accumulation_must_divide_the_batch():
  with pytest.raises(ValueError, match=r"gradient_accumulation_steps=3 is invalid: it must "
                                       r"divide batch_size \(8\)"):
    RewardModelConfig(batch_size=8, gradient_accumulation_steps=3)


def test_warmup_longer_than_the_run_is_refused():
  with pytest.raises(ValueError, match=r"optimizer=.* is invalid: its warmup_steps \(5\) "
                                       r"exceeds .*total_steps \(3\)"):
    RewardModelConfig(total_steps=3, optimizer=RewardModelOptimizer(warmup_steps=5))
  with pytest.raises(ValueError, match=r"optimizer\.warmup_steps=5 is invalid: .*1 optimizer "
                                       r"steps"):
    RewardModelTrainer(RewardModelConfig(batch_size=4, add_eos=False,
                                         optimizer=RewardModelOptimizer(warmup_steps=5)),
                       ScalarModel(MODEL, rngs=nnx.Rngs(0)),
                       train_data=[{"prompt": [3], "chosen": [4], "rejected": [5]}])
