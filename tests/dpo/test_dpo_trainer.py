"""`DPOTrainer`: learning a toy preference (rewards/accuracies and margins rise on the training
pairs), LoRA (only the adapters train; the reference is the base), resume equal to the
uninterrupted run, records' errors."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from jax_ppo.dpo import DPOConfig, DPOOptimizer, DPOTrainer
from jax_ppo.models import CausalLM
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.lora import LoRAConfig, add_lora
from jax_ppo.training import RunOptions
from tests.preference_toys import EOS, MODEL, toy_records

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def config(**kw):
  kw = {"batch_size": 8, "total_steps": 3, "max_length": 16, "eos_token_id": EOS,
        "eval_batch_size": 16, "optimizer": DPOOptimizer(learning_rate=1e-2), **kw}
  return DPOConfig(**kw)


def test_training_raises_accuracy_and_margins_on_the_training_pairs():
  records = toy_records(16, 0, response_len=(1, 4))
  trainer = DPOTrainer(config(total_steps=8, beta=0.5), CausalLM(MODEL, rngs=nnx.Rngs(0)),
                       train_data=records, eval_data=records)
  before = trainer.evaluate()
  assert before["eval/loss"] == pytest.approx(math.log(2), abs=1e-5)
  assert before["eval/rewards/margins"] == pytest.approx(0.0, abs=1e-6)
  assert before["eval/rewards/accuracies"] == 0.0  # ties are not wins
  history = trainer.train()
  after = trainer.evaluate()
  assert len(history) == 8 and {"rewards/chosen", "rewards/accuracies", "logps/rejected",
                                "train/loss"} <= history[-1].keys()
  assert after["eval/rewards/accuracies"] >= 0.85, after
  assert after["eval/rewards/margins"] > 0.5, after
  assert after["eval/loss"] < 0.6 * math.log(2), after
  assert after["eval/pairs"] == 16


def flat(tree):
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_lora_trains_only_the_adapters_and_the_reference_is_the_base():
  model = add_lora(CausalLM(MODEL, rngs=nnx.Rngs(0)), LoRAConfig(rank=2), rngs=nnx.Rngs(1))
  records = toy_records(8, 3, response_len=(1, 4))
  trainer = DPOTrainer(config(total_steps=3), model, train_data=records)
  start, rest = flat(trainer.state.params), flat(trainer.rest)
  assert start and all("lora" in p for p in start), sorted(start)
  pairs = trainer.train_pairs
  pi0, ref0 = trainer.steps.logps(trainer.state.params, trainer.rest, trainer.ref, pairs)
  np.testing.assert_allclose(pi0, ref0, rtol=1e-6)  # B = 0: the adapted model is its base
  history = trainer.train()
  assert history[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
  end = flat(trainer.state.params)
  assert any(np.any(end[p] != start[p]) for p in start)
  for p, v in flat(trainer.rest).items():  # the base weights stay frozen
    np.testing.assert_array_equal(v, rest[p], err_msg=p)
  pi1, ref1 = trainer.steps.logps(trainer.state.params, trainer.rest, trainer.ref, pairs)
  np.testing.assert_allclose(ref1, ref0, rtol=1e-6)  # the reference is still the base ...
  assert np.max(np.abs(np.asarray(pi1) - np.asarray(pi0))) > 1e-3  # ... the policy moved
  with pytest.raises(ValueError, match="LoRA policy's reference is its base"):
    DPOTrainer(config(), model, train_data=records, reference=CausalLM(MODEL, rngs=nnx.Rngs(2)))


@pytest.mark.slow
def test_a_run_stopped_after_step_one_resumes_like_the_uninterrupted_run(tmp_path):
  options = RunOptions(save_every=1, progress=False, tensorboard=False,
                       async_checkpointing=False, log_samples_every=0)
  records = toy_records(16, 2, response_len=(1, 4))

  def make(run_dir=None):
    return DPOTrainer(config(total_steps=3), CausalLM(MODEL, rngs=nnx.Rngs(0)),
                      train_data=records, run_dir=run_dir, run_options=options)

  straight = make()
  straight.train()
  with make(tmp_path / "run") as first:
    first.train(1)
  with make(tmp_path / "run") as resumed:
    assert resumed.step_count == 1
    resumed.train()
    assert resumed.step_count == 3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-6, atol=1e-7),
                 resumed.state, straight.state)
  lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3]
  assert all("rewards/margins" in r for r in lines if "train/loss" in r)


def test_bad_records_and_configs_name_the_field():
  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  good = {"prompt": [3, 4], "chosen": [5], "rejected": [6]}
  with pytest.raises(ValueError, match=r"train_data\[1\]: expected an object with \"prompt\", "
                     r"\"chosen\" and \"rejected\" fields, got keys \['prompt', 'chosen'\]"):
    DPOTrainer(config(), model, train_data=[good, {"prompt": [3], "chosen": [5]}])
  with pytest.raises(ValueError, match=r"train_data\[0\]\.chosen holds text but no tokenizer"):
    DPOTrainer(config(), model, train_data=[{**good, "chosen": "good"}])
  with pytest.raises(ValueError, match=r"train_data\[0\]\.rejected .*\[0, 24\)"):
    DPOTrainer(config(), model, train_data=[{**good, "rejected": [99]}])
  with pytest.raises(ValueError, match=r"train_data\[0\]: \"prompt\" \(the prompt\) is empty; "
                                       r"give at least one message or token id or remove the "
                                       r"record\.$"):
    DPOTrainer(config(), model, train_data=[{**good, "prompt": []}])
  with pytest.raises(ValueError, match="No held-out split"):
    DPOTrainer(config(), model, train_data=[good]).evaluate()
  # A reference model: its weights, not the policy's, are the frozen reference.
  other = CausalLM(MODEL, rngs=nnx.Rngs(5))
  trainer = DPOTrainer(config(), model, train_data=[good], reference=other)
  want = flat(nnx.state(other, nnx.Param))
  assert flat(trainer.ref).keys() == want.keys()
  for p, v in flat(trainer.ref).items():
    np.testing.assert_array_equal(v, want[p], err_msg=p)
  wider = CausalLM(ModelConfig(**{**MODEL.__dict__, "intermediate_size": 48}), rngs=nnx.Rngs(5))
  with pytest.raises(ValueError, match="differ in structure or shape from the policy's"):
    DPOTrainer(config(), model, train_data=[good], reference=wider)
  for kw, field in (({"beta": 0.0}, "beta"), ({"beta": -1}, "beta"),
                    ({"loss_type": "kto"}, "loss_type"), ({"label_smoothing": 0.5},
                                                          "label_smoothing"),
                    ({"label_smoothing": -0.1}, "label_smoothing"),
                    ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing"),
                    ({"batch_size": 4, "gradient_accumulation_steps": 3},
                     "gradient_accumulation_steps"), ({"max_length": 1}, "max_length")):
    with pytest.raises(ValueError, match=rf"^DPOConfig\.{field}=.* is invalid: "):
      DPOConfig(**kw)


def test_a_warmup_longer_than_the_run_is_refused_naming_the_field():
  config = DPOConfig(optimizer=DPOOptimizer(warmup_steps=5))
  config.check_warmup(5)
  with pytest.raises(ValueError, match=r"DPOConfig\.optimizer\.warmup_steps=5 is invalid: it "
                                       r"exceeds the run's 4 optimizer steps"):
    config.check_warmup(4)
