"""`DPOConfig.precompute_reference`: the reference's log-probs of every pair computed once and
cached give the on-the-fly run's losses, metrics, evaluations and weights (full fine-tune with
gradient accumulation, and LoRA), free a full reference, and survive a resume."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jax_ppo.dpo import DPOConfig, DPOOptimizer, DPOTrainer
from jax_ppo.models import CausalLM
from jax_ppo.models.lora import LoRAConfig, add_lora
from jax_ppo.parallel.jit import compiled_programs
from jax_ppo.training import RunOptions
from tests.preference_toys import EOS, MODEL, toy_records

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

TRAIN, EVAL = toy_records(12, 4, response_len=(1, 5)), toy_records(6, 5, response_len=(1, 5))


def config(**kw):
  kw = {"batch_size": 4, "total_steps": 3, "max_length": 16, "eos_token_id": EOS,
        "eval_batch_size": 4, "beta": 0.5,
        "optimizer": DPOOptimizer(learning_rate=1e-2, lr_schedule="constant"), **kw}
  return DPOConfig(**kw)


def make(lora: bool, **kw):
  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  if lora:
    add_lora(model, LoRAConfig(rank=2), rngs=nnx.Rngs(1))
  return DPOTrainer(config(**kw), model, train_data=TRAIN, eval_data=EVAL)


def assert_trees_close(a, b, atol):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0,
                                                       atol=atol), a, b)


def assert_histories_close(cached, fly):
  assert len(cached) == len(fly)
  for c, f in zip(cached, fly, strict=True):
    assert c.keys() - {"time/reference_s"} == f.keys()
    for k, v in f.items():
      if k == "rewards/accuracies" and abs(f["rewards/margins"]) < 1e-5:
        continue  # policy = reference: rounding decides whether a tie (margin ~0) is a win
      assert c[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_cached_reference_equals_the_on_the_fly_reference(lora):
  kw = {} if lora else {"gradient_accumulation_steps": 2}
  fly, cached = make(lora, **kw), make(lora, precompute_reference=True, **kw)
  assert cached.reference_cache is None
  fly_history, history = fly.train(), cached.train()
  # The cache is the reference's log-probs of every pair, in the pairs' order.
  assert set(cached.reference_cache) == {"train", "eval"}
  assert cached.reference_cache["train"].shape == (12, 2)
  assert cached.reference_cache["eval"].shape == (6, 2)
  assert cached.reference_cache["train"].dtype == np.float32
  if not lora:
    _, want = fly.steps.logps(fly.state.params, fly.rest, fly.ref, fly.train_pairs)
    np.testing.assert_allclose(cached.reference_cache["train"], np.asarray(want), rtol=1e-6)
  # Only the first step reports the precomputation.
  assert history[0]["time/reference_s"] > 0
  assert all("time/reference_s" not in h for h in history[1:])
  assert_histories_close(history, fly_history)
  # the cached run never runs the reference forward in a step; one compile for all steps
  assert compiled_programs(cached.steps.train_step) == 0
  assert compiled_programs(cached.steps.train_cached_step) == 1
  assert history[-1]["train/loss"] < history[0]["train/loss"]  # it trained
  assert_trees_close(cached.state.params, fly.state.params, 1e-6)
  assert_trees_close(cached.state.opt_state, fly.state.opt_state, 1e-6)
  want, got = fly.evaluate(), cached.evaluate()
  assert got.keys() == want.keys()
  for k, v in want.items():
    assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
  if lora:  # the reference is the base weights: still there, other pairs still evaluate
    assert not cached.reference_freed
    other = cached.evaluate(toy_records(3, 9))
    assert other["eval/pairs"] == 3
  else:  # a full fine-tune's reference is freed, and other pairs cannot be evaluated
    assert cached.reference_freed and cached.ref == {}
    with pytest.raises(ValueError, match="reference was freed after "
                                         "DPOConfig.precompute_reference"):
      cached.evaluate(toy_records(3, 9))


def test_evaluating_first_precomputes_and_the_first_step_reports_it():
  trainer = make(False, precompute_reference=True)
  before = trainer.evaluate()
  assert trainer.reference_freed and trainer.reference_seconds > 0
  assert before["eval/loss"] == pytest.approx(np.log(2), abs=1e-6)  # policy = reference
  history = trainer.train(2)
  assert history[0]["time/reference_s"] == trainer.reference_seconds
  assert "time/reference_s" not in history[1]


@pytest.mark.slow
def test_a_resumed_cached_run_equals_the_uninterrupted_one(tmp_path):
  options = RunOptions(save_every=1, progress=False, tensorboard=False,
                       async_checkpointing=False, log_samples_every=0)

  def trainer(run_dir=None, precompute=True):
    return DPOTrainer(config(precompute_reference=precompute),
                      CausalLM(MODEL, rngs=nnx.Rngs(0)), train_data=TRAIN, eval_data=EVAL,
                      run_dir=run_dir, run_options=options)

  straight = trainer()
  straight_history = straight.train()
  fly = trainer(precompute=False)
  assert_histories_close(straight_history, fly.train())
  with trainer(tmp_path / "run") as first:
    first.train(1)
  with trainer(tmp_path / "run") as resumed:
    assert resumed.step_count == 1 and resumed.reference_cache is None
    history = resumed.train()
    assert resumed.step_count == 3
    # (recomputed on resume: the same program on the same pairs gives the same numbers)
    np.testing.assert_array_equal(resumed.reference_cache["train"],
                                  straight.reference_cache["train"])
    assert_trees_close(resumed.state, straight.state, 1e-7)
    for got, want in zip(history, straight_history[1:], strict=True):
      assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-6)
  lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3]
  # each process start logs its precomputation at its first step
  assert [r["step"] for r in lines if "time/reference_s" in r] == [1, 2]


def test_precompute_reference_must_be_a_bool():
  with pytest.raises(ValueError, match=r"^DPOConfig\.precompute_reference='yes' is invalid: "
                                       r"use True or False"):
    DPOConfig(precompute_reference="yes")
