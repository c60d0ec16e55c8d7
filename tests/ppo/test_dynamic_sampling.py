"""DAPO dynamic sampling (jax_ppo/ppo/dynamic_sampling.py and `PPOTrainer.step`): constant groups
are dropped and replaced by further draws, the metrics, the cap's fallback, static shapes,
prompt batches of different padding lengths, exact resume, and the config errors."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from jax_ppo.data import PromptDataset
from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOConfig, PPOTrainer
from jax_ppo.ppo import dynamic_sampling as ds
from jax_ppo.rollout.sampler import Rollout
from jax_ppo.training import RunOptions
from tests.ppo.conftest import CONFIG, MODEL, TARGET, prompts

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

N = 4  # responses per prompt
DYN = dataclasses.replace(CONFIG, advantage_mode="grpo", n_samples=N, batch_size=4 * N,
                          dynamic_sampling=True)
TIMING = ("time/", "tokens_per_s", "eps", "mfu")


class Recorder:
  """A reward function whose groups we control: prompts ending in an odd token get a constant
  score (1.0); the others `sum(response) + row / 1000`, different for every row of a call. Each
  call's prompts and scores are recorded (one call per draw)."""

  def __init__(self, constant=lambda prompt: prompt[-1] % 2 == 1):
    self.constant = constant
    self.calls = []

  def __call__(self, prompts, responses):
    scores = [1.0 if self.constant(p) else float(sum(r)) + i / 1000
              for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]
    self.calls.append((prompts, responses, scores))
    return scores


def _trainer(config, reward, dataset=None, model=MODEL, **kwargs):
  return PPOTrainer(config, CausalLM(model, rngs=nnx.Rngs(0)), reward=reward,
                    prompts=dataset if dataset is not None else prompts(), peak_flops=1e11,
                    **kwargs)


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _valid_prompts(rollout):
  return [p[m.astype(bool)].tolist() for p, m in zip(np.asarray(rollout.prompt_ids),
                                                     np.asarray(rollout.prompt_mask),
                                                     strict=True)]


def _rollout(num_rows, prompt_len, *, seed=0, t=3):
  rng = np.random.default_rng(seed)
  mask = np.ones((num_rows, prompt_len), np.int32)
  mask[:, 0] = 0  # one slot of left padding
  ids = np.where(mask, rng.integers(3, 20, (num_rows, prompt_len)), 0).astype(np.int32)
  full = np.concatenate([mask, np.ones((num_rows, t), np.int32)], axis=1)
  return Rollout(prompt_ids=ids, prompt_mask=mask,
                 response_ids=rng.integers(3, 20, (num_rows, t)).astype(np.int32),
                 response_mask=np.ones((num_rows, t), bool),
                 logprobs=rng.normal(size=(num_rows, t)).astype(np.float32),
                 positions=np.maximum(np.cumsum(full, axis=1) - 1, 0).astype(np.int32),
                 has_stop=np.zeros(num_rows, bool))


# --- the pure functions --------------------------------------------------------------------------

def test_varied_groups_flags_groups_whose_scores_differ():
  scores = np.array([1, 1, 1, 0, 0, 0, 2, 2, 2.5, -1, -1, -1], np.float32)
  np.testing.assert_array_equal(ds.varied_groups(scores, 3), [False, False, True, False])
  with pytest.raises(ValueError, match="n_samples=5"):
    ds.varied_groups(scores, 5)


def test_select_groups_takes_varied_groups_in_draw_order_then_fills_with_constant_ones():
  varied = [np.array([False, True, False]), np.array([True, False, True])]
  sel = ds.select_groups(varied, 3)
  assert (sel.draw.tolist(), sel.group.tolist(), sel.kept, sel.filled) == (
      [0, 1, 1], [1, 0, 2], 3, 0)
  sel = ds.select_groups(varied[:1], 3)  # the cap was hit: constant groups fill the batch
  assert (sel.draw.tolist(), sel.group.tolist(), sel.kept, sel.filled) == (
      [0, 0, 0], [1, 0, 2], 1, 2)
  assert ds.sampling_metrics(varied, ds.select_groups(varied, 3)) == {
      "dynamic_sampling/dropped_fraction": 0.5, "train/num_gen_batches": 2.0,
      "dynamic_sampling/filled_groups": 0.0}
  assert ds.sampling_metrics(varied[:1], sel)["dynamic_sampling/filled_groups"] == 2.0
  with pytest.raises(ValueError, match="fewer than the batch's 4"):
    ds.select_groups(varied[:1], 4)


def test_assembly_left_pads_prompts_of_different_lengths():
  short, long = _rollout(4, 3, seed=0), _rollout(4, 6, seed=1)  # 2 groups of 2 each
  sel = ds.Selection(draw=np.array([0, 1]), group=np.array([1, 0]), kept=2, filled=0)
  out = ds.assemble_rollout([short, long], sel, n_samples=2, pad_token_id=0)
  assert out.prompt_ids.shape == (4, 6) and out.positions.shape == (4, 9)
  # rows 2, 3 of the short draw, left-padded by 3 slots: PAD, mask 0, position 0
  np.testing.assert_array_equal(out.prompt_ids[:2, 3:], short.prompt_ids[2:])
  np.testing.assert_array_equal(out.prompt_ids[:2, :3], 0)
  np.testing.assert_array_equal(out.prompt_mask[:2, :3], 0)
  np.testing.assert_array_equal(out.positions[:2, 3:], short.positions[2:])
  np.testing.assert_array_equal(out.positions[:2, :3], 0)
  # the padded positions are those of the padded mask (what the sampler would have written)
  full = np.concatenate([out.prompt_mask, out.response_mask.astype(np.int32)], axis=1)
  np.testing.assert_array_equal(out.positions, np.maximum(np.cumsum(full, 1) - 1, 0))
  for name in ("response_ids", "response_mask", "logprobs", "has_stop"):
    np.testing.assert_array_equal(getattr(out, name)[:2], getattr(short, name)[2:])
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[2:], b[:2]), out, long)
  scores = ds.assemble_rows([np.arange(4.0), 10 + np.arange(4.0)], sel, 2)
  np.testing.assert_array_equal(scores, [2, 3, 10, 11])
  assert ds.assemble_texts([["a", "b"], ["c", "d"]], sel) == ["b", "c"]
  assert ds.assemble_texts([None, None], sel) is None


def test_draw_zero_uses_the_updates_key_and_extra_draws_differ():
  key = jax.random.PRNGKey(3)
  keys = [np.asarray(ds.draw_key(key, d)) for d in range(3)]
  np.testing.assert_array_equal(keys[0], key)
  assert len({k.tobytes() for k in keys} | {np.asarray(jax.random.fold_in(key, i)).tobytes()
                                            for i in range(3)}) == 6


# --- in the trainer ------------------------------------------------------------------------------

def test_constant_groups_are_dropped_and_replaced_by_further_draws():
  reward = Recorder()
  trainer = _trainer(DYN, reward)
  position = 0
  for _ in range(3):
    start = len(reward.calls)
    metrics = trainer.step()
    calls = reward.calls[start:]
    varied = [ds.varied_groups(np.array(s), N) for _, _, s in calls]
    assert len(calls) > 1  # about half the groups are constant: one draw is not enough
    assert metrics["train/num_gen_batches"] == len(calls)
    assert metrics["dynamic_sampling/dropped_fraction"] == pytest.approx(
        1 - np.mean(np.concatenate(varied)))
    assert metrics["dynamic_sampling/filled_groups"] == 0
    position += len(calls)
    assert trainer.data_position == position
    # The batch: the first 4 varied groups in draw order, their rows and scores as drawn.
    want_prompts = [p for ps, _, s in calls for g, p in enumerate(ps[::N])
                    if ds.varied_groups(np.array(s), N)[g]][:4]
    got = _valid_prompts(trainer.last_rollout)
    assert got == [p for p in want_prompts for _ in range(N)]
    assert all(p[-1] % 2 == 0 for p in got)
    want_scores = [x for ps, _, s in calls for g in range(len(ps) // N)
                   if ds.varied_groups(np.array(s), N)[g] for x in s[g * N:(g + 1) * N]][:4 * N]
    np.testing.assert_array_equal(np.asarray(trainer.last_scores), np.float32(want_scores))
    assert abs(metrics["val/ratio_first_minibatch"] - 1) < 1e-5
  # Static shapes: one sampler program, one experience/update program for the one prompt bucket.
  assert trainer.sampler.compile_count == 1
  programs = [trainer.steps.experience_update] if trainer.steps.fuses_first_epoch else [
      trainer.steps.experience, trainer.steps.update]
  assert [p._cache_size() for p in programs] == [1] * len(programs)


def test_without_constant_groups_it_is_the_update_without_dynamic_sampling():
  never = Recorder(constant=lambda prompt: False)
  plain, dyn = _trainer(dataclasses.replace(DYN, dynamic_sampling=False), never), _trainer(
      DYN, Recorder(constant=lambda prompt: False))
  for _ in range(3):
    want, got = plain.step(), dyn.step()
    assert got["train/num_gen_batches"] == 1 and got["dynamic_sampling/dropped_fraction"] == 0
    assert {k: got[k] for k in want if not k.startswith(TIMING)} == {
        k: v for k, v in want.items() if not k.startswith(TIMING)}
  jax.tree.map(np.testing.assert_array_equal, _host(plain.state), _host(dyn.state))
  assert dyn.data_position == plain.data_position == 3


def test_at_the_cap_the_first_draw_fills_the_batch():
  """Every group constant: all `dynamic_sampling_max_draws` draws are taken, the batch is the
  first draw's groups (advantage 0), and the update is the one without dynamic sampling."""
  config = dataclasses.replace(DYN, dynamic_sampling_max_draws=3)
  always = lambda: Recorder(constant=lambda prompt: True)  # noqa: E731
  plain = _trainer(dataclasses.replace(config, dynamic_sampling=False), always())
  reward = always()
  dyn = _trainer(config, reward)
  want, got = plain.step(), dyn.step()
  assert len(reward.calls) == 3 and dyn.data_position == 3
  assert got["train/num_gen_batches"] == 3
  assert got["dynamic_sampling/dropped_fraction"] == 1.0
  assert got["dynamic_sampling/filled_groups"] == 4
  assert got["advantages/std"] == 0
  assert _valid_prompts(dyn.last_rollout) == [p for p in reward.calls[0][0]]
  jax.tree.map(np.testing.assert_array_equal, _host(plain.state), _host(dyn.state))
  assert {k: got[k] for k in want if not k.startswith(TIMING)} == {
      k: v for k, v in want.items() if not k.startswith(TIMING)}


def test_the_score_metric_sees_the_length_penalty():
  """A constant raw score varies after `length_penalty` when the lengths in a group do."""
  config = dataclasses.replace(DYN, dynamic_sampling_metric="score", length_penalty=0.1,
                               dynamic_sampling_max_draws=2)
  reward = Recorder(constant=lambda prompt: True)
  metrics = _trainer(config, reward).step()
  lengths = [ds.varied_groups(np.array([len(r) for r in rs], np.float32), N)
             for _, rs, _ in reward.calls]
  assert 0 < np.mean(np.concatenate(lengths)) < 1
  assert metrics["dynamic_sampling/dropped_fraction"] == pytest.approx(
      1 - np.mean(np.concatenate(lengths)))
  assert metrics["train/num_gen_batches"] == len(reward.calls)


def test_draws_with_different_prompt_lengths_are_padded_to_the_longest():
  """Unshuffled batches alternate short prompts (first bucket) and long ones (the next): an
  update's batch mixes both, left-padded to the long bucket, and the training forward still
  reproduces the sampler's log-probs on every row (first ratio 1)."""
  model = dataclasses.replace(MODEL, max_position_embeddings=80)
  rng = np.random.default_rng(1)
  data = []
  for k in range(8):  # batch k: 4 prompts; even batches short with 2 constant (odd last) ones
    size = 3 if k % 2 == 0 else 33
    for j in range(4):
      p = list(rng.integers(3, MODEL.vocab_size, size=size))
      p[-1] = (2 * int(rng.integers(2, 11)) + (1 if (k % 2 == 0 and j >= 2) else 0))
      data.append(p)
  dataset = PromptDataset(data, shuffle=False)
  trainer = _trainer(DYN, Recorder(), dataset=dataset, model=model)
  metrics = trainer.step()
  assert metrics["train/num_gen_batches"] == 2
  assert metrics["dynamic_sampling/dropped_fraction"] == 0.25
  r = trainer.last_rollout
  assert r.prompt_ids.shape[1] == metrics["rollout/prompt_len"] == 64
  got = _valid_prompts(r)
  assert got == [p for p in data[0:2] + data[4:6] for _ in range(N)]
  assert abs(metrics["val/ratio_first_minibatch"] - 1) < 1e-5
  assert metrics["rollout/logprob_mismatch"] < 1e-5


def test_resume_with_dynamic_sampling_equals_the_uninterrupted_run(tmp_path):
  opts = RunOptions(save_every=10, progress=False, tensorboard=False, log_samples_every=0)
  with _trainer(DYN, Recorder(), run_dir=tmp_path / "ref", run_options=opts) as ref:
    ref_history = ref.train(4)
    ref_state, ref_position = _host(ref.state), ref.data_position
  with _trainer(DYN, Recorder(), run_dir=tmp_path / "run", run_options=opts) as first:
    first.train(2)  # saved at the end of train(), step 2
    position = first.data_position
  assert position > 2  # extra draws advanced the data position
  with _trainer(DYN, Recorder(), run_dir=tmp_path / "run", run_options=opts) as second:
    assert second.step_count == 2 and second.data_position == position
    history = second.train(2)
    assert second.data_position == ref_position
  jax.tree.map(np.testing.assert_array_equal, ref_state, _host(second.state))
  for got, want in zip(history, ref_history[2:], strict=True):
    exact = {k: v for k, v in want.items() if not k.startswith(TIMING)}
    assert {k: got[k] for k in exact} == exact
  logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
  assert [r["train/num_gen_batches"] for r in logged] == [
      m["train/num_gen_batches"] for m in ref_history]


def test_dynamic_sampling_learns_a_binary_reward():
  """Reward 1 when the response holds TARGET, else 0: many groups are all 0 (or all 1); with
  dynamic sampling GRPO still raises the score."""
  def hit(prompts, responses):
    return [float(TARGET in r) for r in responses]

  trainer = _trainer(DYN, hit)
  history = [trainer.step() for _ in range(20)]
  scores = [m["objective/raw_scores"] for m in history]
  assert np.mean(scores[-5:]) > np.mean(scores[:5]) + 0.2, scores
  assert max(m["dynamic_sampling/dropped_fraction"] for m in history) > 0


def test_several_processes_are_refused(monkeypatch):
  import jax_ppo.ppo.trainer as trainer_module

  monkeypatch.setattr(trainer_module, "multi_process", lambda: True)
  with pytest.raises(ValueError, match="dynamic_sampling=True is not supported with several"):
    _trainer(DYN, Recorder())


@pytest.mark.parametrize("kwargs, field", [
    ({"dynamic_sampling": True}, "dynamic_sampling"),  # "gae": no group advantage
    ({"dynamic_sampling": True, "advantage_mode": "reinforce++", "n_samples": 2},
     "dynamic_sampling"),
    ({"dynamic_sampling": 1, "advantage_mode": "grpo", "n_samples": 2}, "dynamic_sampling"),
    ({"dynamic_sampling_max_draws": 0}, "dynamic_sampling_max_draws"),
    ({"dynamic_sampling_max_draws": 2.0}, "dynamic_sampling_max_draws"),
    ({"dynamic_sampling_metric": "acc"}, "dynamic_sampling_metric"),
])
def test_config_errors_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=rf"PPOConfig\.{field}="):
    PPOConfig(**kwargs)
  assert PPOConfig(dynamic_sampling=True, advantage_mode="rloo", n_samples=2).dynamic_sampling
