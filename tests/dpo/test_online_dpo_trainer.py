"""`OnlineDPOTrainer`: a tiny llama learns a reward from its own scored samples (the chosen
score rises); tied pairs are masked out of the loss; a resumed run equals the uninterrupted one;
bad configs name the field."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.dpo import DPOConfig, DPOOptimizer, DPOSampling, OnlineDPOTrainer
from jax_ppo.dpo.online import SCORE_METRICS, sampler_ids
from jax_ppo.dpo.trainer import METRICS
from jax_ppo.models import CausalLM
from jax_ppo.models.lora import LoRAConfig, add_lora
from jax_ppo.rewards import TokenScorer
from jax_ppo.training import RunOptions
from tests.preference_toys import EOS, MODEL

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

LOW = 12


def low_share(prompt_ids, prompt_mask, response_ids, response_mask):
  """`[B]` share of a response's tokens with ids in [3, LOW) (the policy can learn to prefer
  them: about 0.4 at the start)."""
  m = response_mask.astype(jnp.float32)
  low = ((response_ids < LOW) & (response_ids > EOS)).astype(jnp.float32)
  return jnp.sum(low * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def prompts(n=32, seed=0):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, 24, size=int(rng.integers(2, 5)))] for _ in range(n)]


def config(**kw):
  kw = {"batch_size": 16, "total_steps": 12, "eos_token_id": EOS, "beta": 0.1,
        "sampling": DPOSampling(max_new_tokens=8, temperature=1.0),
        "optimizer": DPOOptimizer(learning_rate=3e-2, lr_schedule="constant"), **kw}
  return DPOConfig(**kw)


def test_online_dpo_raises_the_chosen_score():
  trainer = OnlineDPOTrainer(config(), CausalLM(MODEL, rngs=nnx.Rngs(0)),
                             reward=TokenScorer(low_share), prompts=prompts())
  assert trainer.sampling.n_samples == 2 and trainer.sampling.stop_token_ids == (EOS,)
  history = trainer.train()
  assert len(history) == 12
  assert {"train/loss", "objective/kl", *METRICS, *SCORE_METRICS} <= history[0].keys()
  first = history[0]
  assert first["train/loss"] == pytest.approx(np.log(2), abs=1e-5)  # the policy is the reference
  assert first["objective/kl"] == pytest.approx(0.0, abs=1e-5)
  chosen = [h["objective/scores_chosen"] for h in history]
  scores = [h["objective/scores"] for h in history]
  assert np.mean(chosen[-3:]) > np.mean(chosen[:3]) + 0.2, chosen
  assert np.mean(scores[-3:]) > np.mean(scores[:3]) + 0.2, scores
  assert all(h["objective/scores_chosen"] >= h["objective/scores_rejected"] for h in history)
  assert all(0.0 <= h["objective/ties"] < 1.0 for h in history)
  assert history[-1]["objective/kl"] > 0.5  # the policy left the reference
  # The last step's pairs: chosen is the better scored sample of each prompt.
  s, (c, r, tie) = trainer.last_scores, trainer.last_pairs
  rows = np.arange(len(s))
  assert np.all(s[rows, c] >= s[rows, r]) and np.all(tie == (s[rows, c] == s[rows, r]))


def test_tied_pairs_are_masked_out_of_the_loss():
  """A constant reward ties every pair: a zero loss and gradient, the weights unchanged."""
  constant = TokenScorer(lambda pi, pm, ri, rm: jnp.zeros(ri.shape[:1], jnp.float32),
                         name="zero")
  trainer = OnlineDPOTrainer(config(total_steps=1, batch_size=4),
                             CausalLM(MODEL, rngs=nnx.Rngs(0)), reward=constant,
                             prompts=prompts(8))
  before = jax.tree.map(np.asarray, trainer.state.params)
  (metrics,) = trainer.train()
  assert metrics["objective/ties"] == 1.0 and metrics["train/loss"] == 0.0
  assert metrics["train/grad_norm"] == 0.0 and metrics["rewards/accuracies"] == 0.0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, trainer.state.params),
               before)


@pytest.mark.slow
def test_a_resumed_run_equals_the_uninterrupted_run(tmp_path):
  options = RunOptions(save_every=1, progress=False, tensorboard=False,
                       async_checkpointing=False, log_samples_every=0)

  def make(run_dir=None):
    model = add_lora(CausalLM(MODEL, rngs=nnx.Rngs(0)), LoRAConfig(rank=2), rngs=nnx.Rngs(1))
    return OnlineDPOTrainer(config(total_steps=3, batch_size=4), model,
                            reward=TokenScorer(low_share), prompts=prompts(8), run_dir=run_dir,
                            run_options=options)

  straight = make()
  expected = straight.train()
  with make(tmp_path / "run") as first:
    first.train(1)
  with make(tmp_path / "run") as resumed:
    assert resumed.step_count == 1
    rest = resumed.train()
    assert resumed.step_count == 3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-6, atol=1e-7),
                 resumed.state, straight.state)
  for key in ("objective/scores", "objective/scores_chosen", "train/loss"):
    assert [h[key] for h in rest] == pytest.approx([h[key] for h in expected[1:]], abs=1e-6)
  lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3]
  assert all("objective/ties" in r for r in lines if "train/loss" in r)


def test_bad_configs_name_the_field():
  for kw, field in (({"n_samples": 1}, "n_samples"), ({"n_samples": 2.0}, "n_samples"),
                    ({"sampling": {"max_new_tokens": 8}}, "sampling")):
    with pytest.raises(ValueError, match=rf"^DPOConfig\.{field}=.* is invalid: "):
      DPOConfig(**kw)
  with pytest.raises(ValueError, match=r"^DPOConfig\.sampling\.temperature=0 is invalid"):
    DPOSampling(temperature=0)
  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  reward = TokenScorer(low_share)
  with pytest.raises(ValueError, match=r"^DPOConfig\.precompute_reference=True is invalid for "
                                       r"online DPO"):
    OnlineDPOTrainer(config(precompute_reference=True), model, reward=reward, prompts=prompts())
  with pytest.raises(ValueError, match=r"^DPOConfig\.eval_fraction=0\.1 is invalid for online"):
    OnlineDPOTrainer(config(eval_fraction=0.1), model, reward=reward, prompts=prompts())
  with pytest.raises(ValueError, match="warmup_steps=5 is invalid: it exceeds the run's 2 "):
    OnlineDPOTrainer(config(total_steps=None, optimizer=DPOOptimizer(warmup_steps=5)), model,
                     reward=reward, prompts=prompts())  # 32 prompts, 16 per step: 2 steps
  with pytest.raises(ValueError, match="The prompt dataset is empty"):
    OnlineDPOTrainer(config(), model, reward=reward, prompts=[])
  with pytest.raises(ValueError, match="`reward` must be a reward model, a scorer or a function"):
    OnlineDPOTrainer(config(), model, reward=3, prompts=prompts())
  lora = add_lora(CausalLM(MODEL, rngs=nnx.Rngs(0)), LoRAConfig(rank=2), rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match="LoRA policy's reference is its base"):
    OnlineDPOTrainer(config(), lora, reward=reward, prompts=prompts(), reference=model)


def test_sampler_ids_default_to_the_eos_ids_without_the_pad():
  assert sampler_ids(config(), None, (EOS, 5)) == (0, (EOS, 5))
  assert sampler_ids(config(pad_token_id=5), None, (EOS, 5)) == (5, (EOS,))
  sampling = DPOSampling(max_new_tokens=8, stop_token_ids=(9,))
  assert sampler_ids(config(sampling=sampling), None, (EOS,)) == (0, (9,))
