"""Tests of jax_ppo.ppo.policy_losses and the GRPO-family options of a PPO run: the loss table,
GSPO / CISPO / Dr. GRPO updates with their microbatch weighting, DAPO's overlong shaping, and
rollout correction between a bfloat16 sampler and a float32 trainer."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo import core
from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOTrainer
from jax_ppo.ppo.batch import batch_view, process_scores
from jax_ppo.ppo.config import POLICY_LOSSES
from jax_ppo.ppo.experience import make_batch
from jax_ppo.ppo.policy_losses import POLICY_LOSS_FNS
from jax_ppo.rewards import TokenScorer
from jax_ppo.rollout.sampler import Sampler
from tests.ppo.conftest import CONFIG, MODEL, count_target, prompts

# Trainers with identical programs load them from the cache instead of recompiling.
pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def _config(**kwargs):
  return dataclasses.replace(CONFIG, **kwargs)


def _trainer(config):
  return PPOTrainer(config, CausalLM(MODEL, rngs=nnx.Rngs(0)), reward=TokenScorer(count_target),
                    prompts=prompts(), peak_flops=1e11)


def _experience(trainer):
  prompt_ids, _ = trainer.dataset.batch(0, trainer.config.prompts_per_update)
  rollout = trainer.sampler(prompt_ids, jax.random.PRNGKey(0), state=trainer.policy_state())
  scores = trainer.scorer(rollout, None)
  return trainer.steps.experience(trainer.state, trainer.frozen, rollout, scores)


def test_the_table_is_the_config_choices_and_each_entry_is_its_core_loss():
  assert POLICY_LOSSES == tuple(POLICY_LOSS_FNS) == ("ppo", "gspo", "cispo")
  rng = np.random.default_rng(0)
  old = jnp.asarray(rng.uniform(-3, -0.5, (3, 4)), jnp.float32)
  lp = old + jnp.asarray(rng.normal(scale=0.3, size=(3, 4)), jnp.float32)
  mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool)
  adv_seq = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
  mb = types.SimpleNamespace(old_logprobs=old, response_mask=mask,  # the fields read
                             advantages=jnp.where(mask, adv_seq[:, None], 0.0))
  c = _config(clip_eps=0.1, clip_eps_high=0.3)
  np.testing.assert_array_equal(
      POLICY_LOSS_FNS["ppo"](c, lp, mb)[0],
      core.ppo_policy_loss(lp, old, mb.advantages, mask, clip_eps=0.1, clip_eps_high=0.3)[0])
  # GSPO reads one advantage per row: the row's (broadcast) sequence advantage.
  np.testing.assert_allclose(
      POLICY_LOSS_FNS["gspo"](c, lp, mb)[0],
      core.gspo_policy_loss(lp, old, adv_seq, mask, clip_eps=0.1, clip_eps_high=0.3)[0],
      rtol=1e-6)
  np.testing.assert_array_equal(
      POLICY_LOSS_FNS["cispo"](c, lp, mb)[0],
      core.cispo_policy_loss(lp, old, mb.advantages, mask, clip_eps_high=0.3)[0])


GRPO = dict(advantage_mode="grpo", n_samples=2, num_minibatches=1, ppo_epochs=1)


@pytest.mark.parametrize("options", [
    dict(policy_loss="gspo", clip_eps=3e-4, clip_eps_high=4e-4,
         loss_reduction="seq-mean-token-mean", rollout_correction_level="sequence"),
    dict(policy_loss="cispo", clip_eps_high=0.28, rollout_correction_level="token",
         rollout_correction_mode="mask"),
    dict(loss_reduction="token-sum-norm", grpo_scale="none", overlong_cache_length=3),
], ids=["gspo", "cispo", "dr_grpo"])
def test_accumulated_microbatches_give_the_whole_minibatch_update(options):
  # Each variant's loss over 4 microbatches (weighted by `loss_shares`) is the loss of the whole
  # minibatch: the same parameters after one update.
  cfg = _config(**GRPO, **options)
  one = _trainer(cfg)
  batch, metrics = _experience(one)
  assert len(set(np.asarray(batch.response_mask).sum(1).tolist())) > 1  # uneven lengths
  assert np.isfinite(metrics["rollout_correction/kl"])
  four = _trainer(dataclasses.replace(cfg, gradient_accumulation_steps=4))
  start = jax.tree.map(np.asarray, one.state.policy)  # (the update donates the state)
  s1, m1 = one.steps.update(one.state, one.frozen, batch, metrics["objective/kl"])
  s4, m4 = four.steps.update(four.state, four.frozen, batch, metrics["objective/kl"])
  moved = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(
      jax.tree.leaves(s1.policy), jax.tree.leaves(start), strict=True))
  assert moved > 1e-6
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6),
               s1.policy, s4.policy)
  np.testing.assert_allclose(m1["loss/policy_avg"], m4["loss/policy_avg"], rtol=1e-4, atol=1e-6)


def test_a_gspo_run_trains_and_logs_its_clip_fraction():
  trainer = _trainer(_config(**GRPO, policy_loss="gspo", loss_reduction="seq-mean-token-mean"))
  m = trainer.step()
  assert {"policy/clipfrac_avg", "val/ratio", "rollout_correction/kl"} <= m.keys()
  assert all(np.isfinite(v) for v in m.values())


def test_overlong_shaping_enters_the_scores():
  cfg = _config(overlong_cache_length=4, overlong_penalty=2.0)  # max_new_tokens 6: window 2..6

  class R:
    has_stop = jnp.array([True, True, True, False])
    response_lengths = jnp.array([1, 2, 4, 6])

  got = process_scores(cfg, jnp.zeros(4), R)
  np.testing.assert_allclose(got, [0.0, 0.0, -1.0, -2.0], rtol=1e-6)


def test_rollout_correction_weighs_a_bfloat16_samplers_tokens():
  # The case it exists for: tokens drawn by a bfloat16 sampler, trained by a float32 trainer.
  # The trainer's old log-probs differ from the sampler's; the advantages are multiplied by the
  # truncated ratio, and the sampler-trainer KL and the truncated share are logged.
  cfg = _config(rollout_correction_level="token", rollout_correction_cap=1.0)
  trainer = _trainer(cfg)
  bf16 = CausalLM(MODEL, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  prompt_ids, _ = trainer.dataset.batch(0, cfg.prompts_per_update)
  rollout = Sampler(bf16, trainer.sampling)(prompt_ids, jax.random.PRNGKey(3))
  scores = jnp.ones(rollout.response_ids.shape[0], jnp.float32)
  batch, metrics = trainer.steps.experience(trainer.state, trainer.frozen, rollout, scores)
  off_cfg = dataclasses.replace(cfg, rollout_correction_level=None)
  view = batch_view(rollout)
  behaviour = {"logprobs": batch.old_logprobs, "values": batch.old_values}
  plain, plain_metrics = make_batch(off_cfg, trainer.state, rollout, scores, view, behaviour,
                                    batch.ref_logprobs, values=batch.old_values)
  mask = np.asarray(rollout.response_mask)
  ratio = np.exp(np.asarray(batch.old_logprobs) - np.asarray(rollout.logprobs))
  assert np.abs(ratio - 1)[mask].max() > 1e-3  # bf16 vs fp32: the log-probs really differ
  want = np.where(mask, np.asarray(plain.advantages) * np.minimum(ratio, 1.0), 0.0)
  np.testing.assert_allclose(np.asarray(batch.advantages), want, rtol=1e-5, atol=1e-6)
  assert metrics["rollout_correction/kl"] > 0
  assert 0 < metrics["rollout_correction/truncated_frac"] < 1
  assert float(plain_metrics["rollout_correction/kl"]) == pytest.approx(
      float(metrics["rollout_correction/kl"]))


@pytest.mark.parametrize(("options", "field"), [
    (dict(policy_loss="trpo"), "policy_loss"),
    (dict(policy_loss="gspo", gradient_accumulation_steps=2), "loss_reduction"),
    (dict(policy_loss="gspo", loss_reduction="seq-mean-token-mean",
          rollout_correction_level="token"), "rollout_correction_level"),
    (dict(rollout_correction_level="row"), "rollout_correction_level"),
    (dict(rollout_correction_mode="clip"), "rollout_correction_mode"),
    (dict(rollout_correction_cap=0.0), "rollout_correction_cap"),
    (dict(overlong_cache_length=7), "overlong_cache_length"),
    (dict(overlong_cache_length=0), "overlong_cache_length"),
    (dict(overlong_penalty=-1.0), "overlong_penalty"),
])
def test_bad_options_name_the_field(options, field):
  with pytest.raises(ValueError, match=rf"PPOConfig\.{field}="):
    _config(**options)
