"""Run folders of the PPO trainer: exact resume, rollback on collapse, config checks, export.

Trainers here share one `PPOConfig` and model, so after the first compile the others hit JAX's
persistent compilation cache (the test run's temporary folder, tests/conftest.py).
"""

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from jax_ppo.checkpoint import CheckpointConfigMismatch
from jax_ppo.config_io import config_to_dict, load_config, save_config
from jax_ppo.data import PromptDataset
from jax_ppo.models import LoRAConfig, add_lora, from_pretrained, merge_lora
from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOConfig, PPOTrainer
from jax_ppo.ppo.monitor import MonitorConfig
from jax_ppo.rewards import TokenScorer
from jax_ppo.training import RunOptions
from tests.ppo.conftest import CONFIG, MODEL, TARGET, count_target, prompts

# Metrics that measure time, not the computation.
TIMING = ("time/", "tokens_per_s", "eps", "mfu")


pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def _trainer(config=CONFIG, policy=None, reward=None, **kwargs):
  """A fresh trainer from scratch, as a new process would build it."""
  policy = policy if policy is not None else CausalLM(MODEL, rngs=nnx.Rngs(0))
  reward = reward if reward is not None else TokenScorer(count_target)
  return PPOTrainer(config, policy, reward=reward, prompts=prompts(), peak_flops=1e11, **kwargs)


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _jsonl(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


class Crash(Exception):
  pass


def test_resume_in_a_new_trainer_equals_the_uninterrupted_run(tmp_path):
  opts = RunOptions(save_every=2, keep_last=2, log_samples_every=1, samples_per_log=2,
                    progress=False)
  with _trainer(run_dir=tmp_path / "ref", run_options=opts) as ref:
    ref_history = ref.train(4)
    ref_state = _host(ref.state)

  # Interrupted run: checkpoint at step 2, then a crash after step 3 was logged but not saved.
  first = _trainer(run_dir=tmp_path / "run", run_options=opts)

  def crash(metrics):
    if metrics["step"] == 3:
      raise Crash

  with pytest.raises(Crash):
    first.train(4, callback=crash)
  first.close()
  run = tmp_path / "run"
  assert [r["step"] for r in _jsonl(run / "metrics.jsonl")] == [1, 2, 3]
  assert first.checkpointer is None  # closed

  second = _trainer(run_dir=run, run_options=opts)  # restores step 2
  assert second.step_count == 2 and second.data_position == 2
  assert [r["step"] for r in _jsonl(run / "metrics.jsonl")] == [1, 2]  # step 3 truncated
  assert second.monitor.state_dict()["rewards"] == [
      [s, m["objective/scores"]] for s, m in zip((1, 2), ref_history[:2], strict=True)
  ]
  history = second.train(2)
  second.close()
  assert second.steps.update._cache_size() == 1

  # Same parameters, optimizer state, KL controller, RNG and counters as 4 uninterrupted updates.
  jax.tree.map(np.testing.assert_array_equal, ref_state, _host(second.state))
  for got, want in zip(history, ref_history[2:], strict=True):
    exact = {k: v for k, v in want.items() if not k.startswith(TIMING)}
    assert {k: got[k] for k in exact} == exact
  logged = _jsonl(run / "metrics.jsonl")
  ref_logged = _jsonl(tmp_path / "ref" / "metrics.jsonl")
  assert [r["step"] for r in logged] == [1, 2, 3, 4]  # no duplicates
  for got, want in zip(logged, ref_logged, strict=True):
    assert got["objective/scores"] == want["objective/scores"]
    assert got["policy/approxkl_avg"] == want["policy/approxkl_avg"]
    assert got["monitor/warnings"] == 0
  samples = _jsonl(run / "samples.jsonl")
  assert [s["step"] for s in samples] == [1, 1, 2, 2, 3, 3, 4, 4]
  assert all(isinstance(s["response"], list) and "reward" in s for s in samples)
  assert second.checkpointer is None
  assert load_config(PPOConfig, run) == CONFIG  # config.yaml
  assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [2, 4]  # keep_last=2


def _flat(config: dict, block: str) -> dict:
  """A saved `PPOConfig` dict as written before `block` existed (its keys flat)."""
  config = dict(config)
  # (only the keys the block held flat: fields added to it since, e.g. the optimizer's
  # critic_learning_rate, were never written flat)
  config.update({k: v for k, v in config.pop(block).items()
                 if k in PPOConfig.MOVED_KEYS})
  return config


# A field of each block, a changed value and how the mismatch names it.
CHANGED = {"optimizer": ("learning_rate", 1e-3, "optimizer.learning_rate: saved 0.003"),
           "sampling": ("temperature", 0.5, "sampling.temperature: saved 1.0, now 0.5")}


@pytest.mark.parametrize("block", ["optimizer", "sampling"])
def test_a_run_folder_written_before_a_block_resumes(tmp_path, block):
  """Checkpoints whose saved config has the old flat keys (`learning_rate`, `temperature`, ...)
  resume as the same run (`config_io.migrate_keys`), and so does a folder whose config.yaml has
  them and no checkpoint yet; a changed value is still refused by its new key."""
  opts = RunOptions(save_every=1, progress=False, tensorboard=False, log_samples_every=0)
  with _trainer(run_dir=tmp_path, run_options=opts) as trainer:
    trainer.train(1)
  rewritten = 0
  for path in (tmp_path / "checkpoints").rglob("*"):
    if not path.is_file():
      continue
    try:
      meta = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError):
      continue
    if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
      meta["config"] = _flat(meta["config"], block)
      path.write_text(json.dumps(meta))
      rewritten += 1
  assert rewritten == 1
  with _trainer(run_dir=tmp_path, run_options=opts) as resumed:
    assert resumed.step_count == 1
    assert resumed.train(1)[0]["step"] == 2
  field, value, message = CHANGED[block]
  changed = dataclasses.replace(
      CONFIG, **{block: dataclasses.replace(getattr(CONFIG, block), **{field: value})})
  with pytest.raises(CheckpointConfigMismatch, match=message):
    _trainer(config=changed, run_dir=tmp_path, run_options=opts)
  # A run that stopped before its first checkpoint: its config.yaml alone, with the flat keys.
  early = tmp_path / "early"
  early.mkdir()
  (early / "config.yaml").write_text(yaml.safe_dump(_flat(config_to_dict(CONFIG), block)))
  with pytest.raises(CheckpointConfigMismatch, match=message):
    _trainer(config=changed, run_dir=early, run_options=opts)
  with _trainer(run_dir=early, run_options=opts) as resumed:
    assert resumed.step_count == 0


def test_resuming_with_another_config_names_the_fields_and_keeps_everything(tmp_path):
  opts = RunOptions(save_every=1, progress=False, tensorboard=False)
  with _trainer(run_dir=tmp_path, run_options=opts) as trainer:
    trainer.train(1)
  before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

  changed = dataclasses.replace(
      CONFIG, optimizer=dataclasses.replace(CONFIG.optimizer, learning_rate=1e-3), ppo_epochs=1)
  with pytest.raises(CheckpointConfigMismatch,
                     match="optimizer.learning_rate: saved 0.003, now 0.001") as e:
    _trainer(config=changed, run_dir=tmp_path, run_options=opts)
  assert [d[0] for d in e.value.differences] == ["optimizer.learning_rate", "ppo_epochs"]
  after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  assert after == before  # nothing deleted, truncated or overwritten

  # A run that stopped before its first checkpoint is protected by its config.yaml.
  (tmp_path / "early").mkdir()
  save_config(changed, tmp_path / "early")
  with pytest.raises(CheckpointConfigMismatch, match="config.yaml.*learning_rate"):
    _trainer(run_dir=tmp_path / "early", run_options=opts)
  assert load_config(PPOConfig, tmp_path / "early") == changed

  # Run options (logging, checkpoint frequency) are not part of the config: they may change.
  with _trainer(run_dir=tmp_path, run_options=RunOptions(save_every=3, progress=False)) as t:
    assert t.step_count == 1


def test_rollback_on_collapse_restores_the_last_good_checkpoint(tmp_path, caplog):
  calls = []

  def reward(prompts, responses):
    # Smooth scores (little noise), then one collapsed batch on the 6th rollout.
    calls.append(len(responses))
    if len(calls) == 6:
      return [-20.0] * len(responses)
    return [1.0 + 0.01 * r.count(TARGET) for r in responses]

  monitor = MonitorConfig(collapse_smoothing=1, collapse_min_history=4, collapse_window=4,
                          kl_threshold=100.0, reward_volatility_ratio=10.0)
  opts = RunOptions(save_every=2, rollback=True, progress=False, tensorboard=False,
                    log_samples_every=0)
  trainer = _trainer(reward=reward, run_dir=tmp_path, run_options=opts, monitor=monitor)
  snapshots = {}

  def snapshot(metrics):
    snapshots.setdefault(int(metrics["step"]), []).append(_host(trainer.state.policy))

  with caplog.at_level(logging.WARNING, logger="jax_ppo"):
    history = trainer.train(8, callback=snapshot)
  trainer.close()

  rolled = [m for m in history if "rollback/to_step" in m]
  assert len(rolled) == 1
  assert rolled[0]["step"] == 6 and rolled[0]["rollback/to_step"] == 4
  assert rolled[0]["rollback/lr_scale"] == 0.5
  assert [int(m["step"]) for m in history] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
  # Right after the rollback the policy is the one saved at step 4.
  jax.tree.map(np.testing.assert_array_equal, snapshots[4][0], snapshots[6][0])
  assert trainer.rollbacks == 1 and float(trainer.state.lr_scale) == 0.5
  assert not trainer.monitor.collapsed
  lr = CONFIG.optimizer.learning_rate
  assert history[4]["lr"] == pytest.approx(lr) and history[-1]["lr"] == pytest.approx(lr / 2)
  assert "rolled back to the checkpoint of step 4" in caplog.text
  logged = _jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
  assert logged[5]["rollback/to_step"] == 4 and logged[5]["objective/scores"] == -20.0
  assert 8 in trainer_steps(tmp_path)
  # Restored and rescaled arrays have the live state's signature: nothing recompiled.
  assert trainer.steps.update._cache_size() == 1
  assert trainer.sampler.compile_count == 1


def trainer_steps(run_dir):
  return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def test_export_merges_lora_drops_the_value_head_and_reloads(tmp_path):
  policy = add_lora(CausalLM(MODEL, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, alpha=8),
                    rngs=nnx.Rngs(1))
  trainer = _trainer(policy=policy)
  # Non-zero adapters (B starts at 0), as after training.
  keys = iter(jax.random.split(jax.random.PRNGKey(5), 64))
  trainer.state = trainer.state.replace(policy=jax.tree.map(
      lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), trainer.state.policy
  ))
  path = trainer.export(tmp_path / "hf")
  reloaded = from_pretrained(str(path))
  assert reloaded.value_head is None
  ids = jnp.asarray([[0, 0, 5, 9, 3], [4, 8, 15, 16, 23]])
  mask = (ids != 0).astype(jnp.int32)

  def logits(model, **kw):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s: nnx.merge(graphdef, s)(ids, attention_mask=mask, **kw))(
        state))

  live = trainer.policy_model()
  np.testing.assert_array_equal(logits(reloaded), logits(merge_lora(live)))
  np.testing.assert_allclose(logits(reloaded), logits(live), atol=2e-5)
  assert not np.allclose(logits(live), logits(live, use_lora=False), atol=1e-3)  # adapters matter

  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
  positions = np.maximum(np.cumsum(np.asarray(mask), axis=1) - 1, 0)
  with torch.no_grad():
    out = hf(input_ids=torch.tensor(np.asarray(ids)), attention_mask=torch.tensor(
        np.asarray(mask)), position_ids=torch.tensor(positions)).logits.numpy()
  valid = np.asarray(mask).astype(bool)
  np.testing.assert_allclose(out[valid], logits(reloaded)[valid], atol=1e-4)


def test_resume_with_replay_equals_the_uninterrupted_run(tmp_path):
  """The replay buffer (batches of different prompt lengths) and its generator are checkpointed:
  a run resumed from step 3 replays the same batches as the uninterrupted one."""
  config = dataclasses.replace(CONFIG, replay_buffer_size=3, replay_batches_per_update=2)
  model = dataclasses.replace(MODEL, max_position_embeddings=80)
  rng = np.random.default_rng(1)
  # Unshuffled: odd batches hold prompts longer than the sampler's first bucket (32 tokens), so
  # the buffered batches have two prompt lengths.
  data = [[list(rng.integers(3, MODEL.vocab_size, size=3 + 30 * (k % 2))) for _ in range(8)]
          for k in range(6)]
  dataset = PromptDataset([p for batch in data for p in batch], shuffle=False)

  def trainer(run_dir):
    return PPOTrainer(config, CausalLM(model, rngs=nnx.Rngs(0)), reward=TokenScorer(count_target),
                      prompts=dataset, peak_flops=1e11, run_dir=run_dir,
                      run_options=RunOptions(save_every=10, progress=False, tensorboard=False,
                                             log_samples_every=0))

  with trainer(tmp_path / "ref") as ref:
    ref_history = ref.train(5)
    ref_state = _host(ref.state)
  with trainer(tmp_path / "run") as first:
    first.train(3)  # saved at the end of train(), step 3
    saved_shapes = [b.input_ids.shape for b in first.replay]
  assert len({s[1] for s in saved_shapes}) == 2  # two prompt lengths in the buffer

  with trainer(tmp_path / "run") as second:
    assert second.step_count == 3
    assert [b.input_ids.shape for b in second.replay] == saved_shapes
    history = second.train(2)
    assert second.steps.replay_update._cache_size() == 2  # one program per prompt length
  jax.tree.map(np.testing.assert_array_equal, ref_state, _host(second.state))
  for got, want in zip(history, ref_history[3:], strict=True):
    exact = {k: v for k, v in want.items() if not k.startswith(TIMING)}
    assert {k: got[k] for k in exact} == exact
