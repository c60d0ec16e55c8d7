"""`SFTConfig` and its optimizer block (`jax_ppo.sft.config`): SFT's optimizer defaults, the
keys that moved into `sft.optimizer` and into the run config's `run` block (a file or override
with an old key is one error naming the new one), and a run folder saved with the old flat keys,
which resumes like the uninterrupted run."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from jax_ppo.checkpoint import CheckpointConfigMismatch
from jax_ppo.config_io import config_to_dict, load_config
from jax_ppo.data.sft import example_from_ids
from jax_ppo.models.transformer import CausalLM
from jax_ppo.runs.common import STAGE_OPERATIONAL_FIELDS, STAGE_RUN_FIELDS, StageRunFolder
from jax_ppo.runs.sft import SFTRunConfig, load_sft_config
from jax_ppo.sft import SFTConfig, SFTOptimizer, SFTTrainer
from jax_ppo.sft.config import OPTIMIZER_KEYS
from jax_ppo.training.optim import OptimizerConfig
from tests.ppo.conftest import EOS, MODEL


def test_the_optimizer_block_has_sft_defaults_and_replaces_the_flat_fields():
  block = SFTConfig().optimizer
  assert isinstance(block, SFTOptimizer) and isinstance(block, OptimizerConfig)
  assert (block.learning_rate, block.lr_schedule, block.adam_eps) == (2e-5, "cosine", 1e-8)
  # The kit's other defaults are kept.
  kit = OptimizerConfig()
  assert (block.warmup_steps, block.adam_b1, block.adam_b2, block.weight_decay,
          block.max_grad_norm) == (kit.warmup_steps, kit.adam_b1, kit.adam_b2, kit.weight_decay,
                                   kit.max_grad_norm)
  fields = {f.name for f in dataclasses.fields(SFTConfig)}
  assert "optimizer" in fields and not fields & set(OPTIMIZER_KEYS)
  assert SFTConfig.MOVED_KEYS == {k: f"optimizer.{k}" for k in OPTIMIZER_KEYS}
  assert set(OPTIMIZER_KEYS) == {f.name for f in dataclasses.fields(OptimizerConfig)}


def test_a_file_giving_part_of_the_block_keeps_the_other_sft_defaults(tmp_path):
  path = tmp_path / "sft.yaml"
  path.write_text("optimizer: {warmup_steps: 3}\nbatch_size: 4\n")
  config = load_config(SFTConfig, path, ["optimizer.weight_decay=0.1"])
  assert config.optimizer == SFTOptimizer(warmup_steps=3, weight_decay=0.1)


MOVED = [*(("sft.", "sft.optimizer.", "SFTConfig.optimizer", k) for k in OPTIMIZER_KEYS),
         *(("", "run.", "SFTRunConfig.run", k) for k in STAGE_RUN_FIELDS)]
"""(old prefix, new prefix, the new place's class path, key) of every key that moved."""


@pytest.mark.parametrize("old, new, owner, key", MOVED)
def test_an_old_flat_key_is_one_error_naming_its_new_place(tmp_path, old, new, owner, key):
  value = {"lr_schedule": "linear", "max_grad_norm": 0.5, "adam_b1": 0.5, "adam_b2": 0.5,
           "tensorboard": True, "progress": False}.get(key, 1)
  data = {"model_path": "m", "train_path": "t.jsonl", "run_dir": "r"}
  data.update({"sft": {"batch_size": 4, key: value}} if old else {key: value})
  path = tmp_path / "run.yaml"
  path.write_text(yaml.safe_dump(data))
  want = (f"Config key '{old}{key}' has moved to '{new}{key}' ({owner}.{key}); write "
          f"'{new}{key}' instead.")
  with pytest.raises(ValueError) as err:
    load_sft_config([str(path)])
  assert str(err.value) == f"Config file {str(path)!r}: {want}"
  base = ["model_path=m", "train_path=t.jsonl", "run_dir=r"]
  with pytest.raises(ValueError) as err:
    load_sft_config([*base, f"{old}{key}={value}"])
  assert str(err.value) == want
  config = load_sft_config([*base, f"{new}{key}={value}"])
  for part in (new + key).split("."):
    config = getattr(config, part)
  assert config == value


def test_the_run_block_holds_the_keys_that_moved():
  assert set(STAGE_RUN_FIELDS) == {f.name for f in dataclasses.fields(StageRunFolder)}
  assert SFTRunConfig.MOVED_KEYS == {f: f"run.{f}" for f in STAGE_RUN_FIELDS}


def _flatten_optimizer(run_config: dict) -> dict:
  """A saved `SFTRunConfig` dict as the version before `sft.optimizer` and the `run` block wrote
  it (their keys flat: `sft.learning_rate`, `save_every`, ...)."""
  if "run" in run_config:
    run_config = {**{k: v for k, v in run_config.items() if k != "run"}, **run_config["run"]}
  sft = dict(run_config["sft"])
  if "optimizer" not in sft:  # (already flat)
    return run_config
  return {**run_config, "sft": {**{k: v for k, v in sft.items() if k != "optimizer"},
                                **sft["optimizer"]}}


def test_a_run_folder_saved_with_the_flat_keys_resumes_like_the_uninterrupted_run(tmp_path):
  rng = np.random.default_rng(0)
  examples = [example_from_ids(rng.integers(3, MODEL.vocab_size, size=2),
                               rng.integers(3, MODEL.vocab_size, size=3), eos_token_id=EOS)
              for _ in range(12)]
  config = SFTConfig(max_length=8, batch_size=4, eos_token_id=EOS, total_steps=4,
                     optimizer=SFTOptimizer(learning_rate=1e-2, warmup_steps=1))

  def trainer(run_dir: pathlib.Path, save_every: int = 1) -> SFTTrainer:
    run_config = SFTRunConfig(model_path="m", train_path="t.jsonl", run_dir=str(run_dir),
                              sft=config, run=StageRunFolder(save_every=save_every,
                                                             progress=False))
    opts = run_config.run_options(plots=False, async_checkpointing=False)
    assert opts.resume_ignore == STAGE_OPERATIONAL_FIELDS and opts.log_samples_every == 0
    return SFTTrainer(config, CausalLM(MODEL, rngs=nnx.Rngs(0)), train_data=examples,
                      run_dir=run_dir, run_options=opts, run_config=run_config)

  with trainer(tmp_path / "ref") as ref:
    ref.train()
    want = jax.tree.map(np.asarray, ref.state)
  run = tmp_path / "run"
  with trainer(run) as first:
    first.train(2)
  # Rewrite the folder as the version before the optimizer and run blocks saved it: config.yaml
  # and the configuration stored with every checkpoint.
  saved = yaml.safe_load((run / "config.yaml").read_text())
  assert saved == config_to_dict(first.run.run_config)
  (run / "config.yaml").write_text(yaml.safe_dump(_flatten_optimizer(saved), sort_keys=False))
  metas = sorted(run.glob("checkpoints/*/meta/metadata"))
  assert len(metas) == 2
  for meta in metas:
    data = json.loads(meta.read_text())
    data["config"] = _flatten_optimizer(data["config"])
    assert data["config"]["sft"]["learning_rate"] == 1e-2 and data["config"]["save_every"] == 1
    meta.write_text(json.dumps(data))
  # Given as a config file, the old folder's config.yaml is refused with the new key ...
  with pytest.raises(ValueError, match="has moved to 'sft.optimizer.learning_rate'"):
    load_sft_config([str(run / "config.yaml")])
  # ... and the run folder itself resumes with the same meaning (another `run` block, which
  # may change on resume), ending as the uninterrupted run.
  with trainer(run, save_every=2) as second:
    assert second.step_count == 2
    second.train()
  jax.tree.map(np.testing.assert_array_equal, want, jax.tree.map(np.asarray, second.state))
  # A changed optimizer field is still refused against the old flat keys.
  changed = dataclasses.replace(config, optimizer=SFTOptimizer(learning_rate=1e-3,
                                                               warmup_steps=1))
  for meta in run.glob("checkpoints/*/meta/metadata"):
    data = json.loads(meta.read_text())
    data["config"] = _flatten_optimizer(data["config"])
    meta.write_text(json.dumps(data))
  with pytest.raises(CheckpointConfigMismatch, match=r"sft\.optimizer\.learning_rate: saved "
                                                     r"0\.01, now 0\.001"):
    changed_run = SFTRunConfig(model_path="m", train_path="t.jsonl", run_dir=str(run),
                               sft=changed, run=StageRunFolder(save_every=1, progress=False))
    SFTTrainer(changed, CausalLM(MODEL, rngs=nnx.Rngs(0)), train_data=examples, run_dir=run,
               run_options=changed_run.run_options(plots=False, async_checkpointing=False),
               run_config=changed_run)
