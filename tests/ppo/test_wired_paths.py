"""Wired-but-untested paths of the PPO step, each checked through the real jitted functions.

`PPOSteps.experience` / `experience_update` run on a hand-built rollout (so the rows with and
without a stop token, and their lengths, are known) and their batch and metrics are compared
with NumPy references written from the definitions in docs/rlhf_details.md (items 7, 8 and 11)
and `PPOConfig`'s docstrings: the missing-EOS and length penalties, KL as a loss term with GAE,
reward whitening, and the entropy bonus and its schedule. The trainer's own progress bar and its
`mfu` metric (against a hand count of the model FLOPs) go through `PPOTrainer`.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.core import position_ids_from_mask
from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOTrainer, perf
from jax_ppo.rewards import TokenScorer
from jax_ppo.rollout.sampler import Rollout
from jax_ppo.training.loop import RunOptions
from tests.ppo.conftest import CONFIG, EOS, MODEL, PAD, count_target, prompts

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

# One minibatch, one epoch: the update's only optimizer step sees the behaviour policy, so its
# loss metrics can be recomputed from the batch.
ONE_STEP = dataclasses.replace(CONFIG, num_minibatches=1, ppo_epochs=1)

# The hand-built rollout: B = 8 rows, S = 4 prompt slots, T = 6 response slots.
PROMPT_LENGTHS = (4, 2, 3, 4, 1, 2, 3, 4)
STOP_AT = (1, None, 0, 5, None, 3, 2, None)  # index of the EOS token; None: no stop token
T = 6
RAW_SCORES = np.array([1.0, 4.0, -3.0, 0.25, 2.0, 10.0, -10.0, 0.0], np.float32)


def _hand_rollout(seed: int = 0) -> Rollout:
  """A left-padded rollout whose stop tokens and lengths are set by hand (`STOP_AT`)."""
  rng = np.random.default_rng(seed)
  b, s = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)
  prompt_ids = np.full((b, s), PAD, np.int32)
  prompt_mask = np.zeros((b, s), np.int32)
  response_ids = np.full((b, T), PAD, np.int32)
  response_mask = np.zeros((b, T), bool)
  for i, (n, stop) in enumerate(zip(PROMPT_LENGTHS, STOP_AT, strict=True)):
    prompt_ids[i, s - n:] = rng.integers(3, MODEL.vocab_size, n)
    prompt_mask[i, s - n:] = 1
    length = T if stop is None else stop + 1
    response_ids[i, :length] = rng.integers(3, MODEL.vocab_size, length)
    if stop is not None:
      response_ids[i, stop] = EOS
    response_mask[i, :length] = True
  full_mask = np.concatenate([prompt_mask, response_mask.astype(np.int32)], axis=1)
  return Rollout(
      prompt_ids=jnp.asarray(prompt_ids),
      prompt_mask=jnp.asarray(prompt_mask),
      response_ids=jnp.asarray(response_ids),
      response_mask=jnp.asarray(response_mask),
      logprobs=jnp.zeros((b, T), jnp.float32),
      positions=position_ids_from_mask(jnp.asarray(full_mask)),
      has_stop=jnp.asarray([stop is not None for stop in STOP_AT]),
  )


def _trainer(config, **kwargs) -> PPOTrainer:
  return PPOTrainer(
      config, CausalLM(MODEL, rngs=nnx.Rngs(0)), reward=TokenScorer(count_target),
      prompts=prompts(), peak_flops=1e9, **kwargs,
  )


def _copy(tree):
  """A fresh copy (the update functions donate the state they are given)."""
  return jax.tree.map(jnp.copy, tree)


def _perturbed(state, scale: float = 0.3):
  """`state` with noise added to every trainable policy array, so the policy differs from the
  reference (non-zero KL) and the zero-initialised value head gives non-zero values."""
  leaves, treedef = jax.tree.flatten(state.policy)
  keys = jax.random.split(jax.random.PRNGKey(42), len(leaves))
  noisy = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys,
                                                                              strict=True)]
  return state.replace(policy=jax.tree.unflatten(treedef, noisy))


def _like(x, value):
  """`value` as an array of `x`'s dtype on `x`'s devices (committed like the trainer's state, so
  the jitted steps see the same argument signature and do not recompile)."""
  return jax.device_put(jnp.asarray(value, x.dtype), x.sharding)


def _with_kl_coef(state, coef: float):
  return state.replace(kl=state.kl._replace(coef=_like(state.kl.coef, coef)))


def _np(x) -> np.ndarray:
  return np.asarray(jax.device_get(x), np.float64)


def _gae_reference(rewards, values, mask, gamma, lam):
  """Plain-loop GAE over the valid tokens of each row; the value after the last one is 0."""
  b, t = rewards.shape
  adv = np.zeros((b, t))
  for i in range(b):
    next_adv, next_value = 0.0, 0.0
    for j in reversed(range(t)):
      if not mask[i, j]:
        next_adv, next_value = 0.0, 0.0
        continue
      delta = rewards[i, j] + gamma * next_value - values[i, j]
      adv[i, j] = delta + gamma * lam * next_adv
      next_adv, next_value = adv[i, j], values[i, j]
  return adv, np.where(mask, adv + values, 0.0)


def _score_rewards(scores, mask):
  """`[B, T]`: each row's score on its last valid token, 0 elsewhere."""
  last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
  out = np.zeros(mask.shape)
  out[np.arange(len(scores)), last] = scores
  return out


def _total_loss(m, config, entropy_coef, kl_coef=0.0):
  """The PPO loss from its logged parts: pg - c_ent * H + c_vf * L_V (+ beta * KL loss)."""
  total = m["loss/policy_avg"] - entropy_coef * m["policy/entropy_avg"]
  total += config.vf_coef * m["loss/value_avg"]
  return total + kl_coef * m.get("loss/kl_avg", 0.0)


# -- missing-EOS and length penalties (item 7) ---------------------------------------------------


def test_missing_eos_and_length_penalties_through_experience():
  config = dataclasses.replace(
      ONE_STEP, missing_eos_penalty=-1.0, length_penalty=0.1, reward_scale=2.0,
      reward_shift=0.5, reward_clip=3.0, kl_coef=0.0, gamma=1.0, lam=1.0,
      whiten_advantages=False,
  )
  trainer = _trainer(config)
  rollout = _hand_rollout()
  batch, metrics = trainer.steps.experience(
      trainer.state, trainer.frozen, rollout, jnp.asarray(RAW_SCORES)
  )
  # By hand: lengths 2, 6, 1, 6, 6, 4, 3, 6; rows 1, 4 and 7 never emitted EOS.
  lengths = np.array([2, 6, 1, 6, 6, 4, 3, 6])
  scaled = np.clip((RAW_SCORES - 0.5) * 2.0, -3.0, 3.0)  # 1, 3, -3, -0.5, 3, 3, -3, -1
  expected = scaled - 0.1 * lengths
  expected[[1, 4, 7]] = -1.0
  np.testing.assert_allclose(expected, [0.8, -1, -3.1, -1.1, -1, 2.6, -3.3, -1], atol=1e-6)

  mask = np.asarray(batch.response_mask)
  np.testing.assert_array_equal(mask.sum(1), lengths)
  # gamma = lam = 1 and no KL: the return of every valid token is the row's score, and the
  # per-token rewards (differences of consecutive returns) are 0 except on the last token.
  returns = _np(batch.returns)
  np.testing.assert_allclose(returns, np.where(mask, expected[:, None], 0.0), atol=1e-5)
  rewards = returns - np.pad(returns[:, 1:], ((0, 0), (0, 1)))
  np.testing.assert_allclose(rewards, _score_rewards(expected, mask), atol=1e-5)
  np.testing.assert_allclose(_np(batch.advantages), np.where(mask, returns - _np(batch.old_values),
                                                             0.0), atol=1e-5)
  assert float(metrics["objective/scores"]) == pytest.approx(expected.mean(), abs=1e-5)
  assert float(metrics["objective/raw_scores"]) == pytest.approx(RAW_SCORES.mean(), abs=1e-5)
  assert float(metrics["val/num_eos_tokens"]) == 5.0
  assert float(metrics["response_length/mean"]) == pytest.approx(lengths.mean())


# -- reward whitening (item 11) ------------------------------------------------------------------


def test_reward_whitening_feeds_whitened_per_token_rewards_to_gae():
  beta, gamma, lam = 0.2, 0.9, 0.8
  config = dataclasses.replace(
      ONE_STEP, whiten_rewards=True, whiten_advantages=False, kl_coef=beta, gamma=gamma,
      lam=lam, reward_clip=None,
  )
  trainer = _trainer(config)
  state = _perturbed(trainer.state)
  batch, metrics = trainer.steps.experience(state, trainer.frozen, _hand_rollout(),
                                            jnp.asarray(RAW_SCORES))
  mask = np.asarray(batch.response_mask)
  values = _np(batch.old_values)
  kl = np.where(mask, _np(batch.old_logprobs) - _np(batch.ref_logprobs), 0.0)  # k1
  assert np.abs(kl).max() > 0.05 and np.abs(values).max() > 0.05  # the check needs both

  rewards = np.where(mask, -beta * kl, 0.0) + _score_rewards(RAW_SCORES, mask)
  valid = rewards[mask]
  mean, var = valid.mean(), valid.var(ddof=1)
  whitened = np.where(mask, (rewards - mean) / np.sqrt(var + 1e-8) + mean, 0.0)
  adv, ret = _gae_reference(whitened, values, mask, gamma, lam)
  np.testing.assert_allclose(_np(batch.advantages), adv, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(_np(batch.returns), ret, rtol=1e-4, atol=1e-5)
  # Whitening matters here: GAE on the raw rewards is far from the batch.
  raw_adv, _ = _gae_reference(rewards, values, mask, gamma, lam)
  assert np.abs(raw_adv - adv).max() > 0.5
  # The KL and score metrics still describe the unwhitened rewards.
  assert float(metrics["objective/kl"]) == pytest.approx(kl.sum(1).mean(), rel=1e-4, abs=1e-6)
  assert float(metrics["objective/non_score_reward"]) == pytest.approx(
      -beta * kl.sum(1).mean(), rel=1e-4, abs=1e-6)


# -- KL as a loss term with GAE (item 8) ---------------------------------------------------------


def test_kl_as_a_loss_with_gae():
  beta = 0.5
  config = dataclasses.replace(
      ONE_STEP, kl_in_reward=False, kl_coef=beta, kl_loss_estimator="k3", gamma=1.0, lam=1.0,
      whiten_advantages=False, reward_clip=None,
  )
  trainer = _trainer(config)
  assert trainer.steps.fuses_first_epoch  # what the trainer runs for this config
  start = _perturbed(trainer.state)
  rollout, raw = _hand_rollout(), jnp.asarray(RAW_SCORES)
  runs = {}
  for coef in (beta, 0.0):
    state, batch, exp_m, upd_m = trainer.steps.experience_update(
        _with_kl_coef(_copy(start), coef), trainer.frozen, rollout, raw
    )
    runs[coef] = (jax.tree.map(np.asarray, state.policy), batch, jax.device_get(exp_m),
                  jax.device_get(upd_m))
  params, batch, exp_m, upd_m = runs[beta]
  mask = np.asarray(batch.response_mask)

  # No KL in the rewards: every valid token's return is the raw score (gamma = lam = 1).
  np.testing.assert_allclose(_np(batch.returns), np.where(mask, RAW_SCORES[:, None], 0.0),
                             atol=1e-5)
  assert exp_m["objective/non_score_reward"] == 0.0
  d = np.where(mask, _np(batch.old_logprobs) - _np(batch.ref_logprobs), 0.0)
  assert exp_m["objective/kl"] == pytest.approx(d.sum(1).mean(), rel=1e-4)
  assert abs(exp_m["objective/kl"]) > 0.1  # hand-written responses: k1 may be negative

  # The KL is a loss term: k3 = exp(-d) - 1 + d, token-mean over valid tokens, weighted by beta.
  k3 = np.where(mask, np.expm1(-d) + d, 0.0)
  assert upd_m["loss/kl_avg"] == pytest.approx(k3.sum() / mask.sum(), rel=1e-4)
  assert upd_m["loss/total_avg"] == pytest.approx(
      _total_loss(upd_m, config, 0.0, beta), rel=1e-5, abs=1e-6)

  # Its coefficient changes the gradient but not the batch.
  params0, batch0, _, upd_m0 = runs[0.0]
  np.testing.assert_array_equal(np.asarray(batch0.advantages), np.asarray(batch.advantages))
  assert upd_m0["loss/kl_avg"] == pytest.approx(upd_m["loss/kl_avg"], rel=1e-6)
  assert upd_m0["loss/total_avg"] == pytest.approx(_total_loss(upd_m0, config, 0.0), rel=1e-5)
  assert upd_m0["policy/grad_norm"] != pytest.approx(upd_m["policy/grad_norm"], rel=1e-3)
  diff = max(float(np.abs(a - b).max())
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params0), strict=True))
  assert diff > 1e-4


def test_kl_loss_and_entropy_schedule_through_experience_then_update():
  """The same terms through the unfused path (`experience`, then `update` over 2 epochs x 2
  minibatches), which the trainer runs whenever `num_minibatches > 1`."""
  beta = 0.5
  config = dataclasses.replace(
      CONFIG, kl_in_reward=False, kl_coef=beta, entropy_coef=0.5, entropy_coef_final=0.1,
      total_updates=2,
  )
  trainer = _trainer(config)
  assert not trainer.steps.fuses_first_epoch
  start = _perturbed(trainer.state)
  rollout, raw = _hand_rollout(), jnp.asarray(RAW_SCORES)
  batch, exp_m = trainer.steps.experience(start, trainer.frozen, rollout, raw)
  assert float(exp_m["objective/non_score_reward"]) == 0.0
  runs = {}
  for coef in (beta, 0.0):
    state, m = trainer.steps.update(_with_kl_coef(_copy(start), coef), trainer.frozen,
                                    _copy(batch), exp_m["objective/kl"])
    runs[coef] = (state, jax.device_get(m))
  state, m = runs[beta]
  assert m["entropy_coef"] == pytest.approx(0.5)
  assert m["loss/kl_avg"] > 0.01
  assert m["loss/total_avg"] == pytest.approx(_total_loss(m, config, 0.5, beta), rel=1e-5)
  m0 = runs[0.0][1]
  assert m0["loss/total_avg"] == pytest.approx(_total_loss(m0, config, 0.5), rel=1e-5)
  diff = max(float(np.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(state.policy), jax.tree.leaves(runs[0.0][0].policy), strict=True))
  assert diff > 1e-4
  # The next update uses the next value of the schedule: 0.5 + (0.1 - 0.5) * 1 / 2.
  _, m = trainer.steps.update(state, trainer.frozen, _copy(batch), exp_m["objective/kl"])
  assert float(m["entropy_coef"]) == pytest.approx(0.3)
  assert trainer.steps.update._cache_size() == 1


# -- entropy schedule ----------------------------------------------------------------------------


def test_entropy_coefficient_follows_its_schedule_and_weights_the_loss():
  c0, total = 2.0, 4
  config = dataclasses.replace(ONE_STEP, entropy_coef=c0, entropy_coef_final=0.0,
                               total_updates=total, optimizer=dataclasses.replace(
                                   ONE_STEP.optimizer, learning_rate=3e-2))
  trainer = _trainer(config)
  rollout, raw = _hand_rollout(), jnp.asarray(RAW_SCORES)
  # A policy far from uniform (the random init is close to it: entropy ~ log V), so that one
  # step of the bonus has room to raise the entropy.
  start = _perturbed(trainer.state, 1.0)
  state = _copy(start)
  update = trainer.steps.experience_update
  for n in range(total + 2):
    state, _, _, m = update(state, trainer.frozen, rollout, raw)
    m = jax.device_get(m)
    expected = c0 * (1.0 - min(n / total, 1.0))  # linear to the final value, then held
    assert m["entropy_coef"] == pytest.approx(expected, abs=1e-6), n
    assert m["loss/total_avg"] == pytest.approx(_total_loss(m, config, expected), rel=1e-5,
                                                abs=1e-6), n

  # The same parameters and rollout at step 0 (weight 2) and at the end (weight 0): the bonus
  # changes the update, and towards higher entropy of the policy on these responses.
  after = {}
  for step in (0, total):
    s, _, _, _ = trainer.steps.experience_update(
        _copy(start).replace(step=_like(start.step, step)), trainer.frozen, rollout, raw
    )
    after[step] = s
  diff = max(float(np.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(after[0].policy), jax.tree.leaves(after[total].policy), strict=True))
  assert diff > 1e-4
  entropy = {
      step: float(update(s, trainer.frozen, rollout, raw)[3]["policy/entropy_avg"])
      for step, s in after.items()
  }
  assert entropy[0] > entropy[total] + 0.01, entropy
  assert update._cache_size() == 1  # the schedule is read from the state: no recompilation


# -- the trainer: progress bar, logged entropy coefficient, MFU -----------------------------------

TRAINER_CONFIG = dataclasses.replace(ONE_STEP, total_updates=3, entropy_coef=0.3,
                                     entropy_coef_final=0.0)


def test_trainer_progress_bar_shows_reward_and_kl(tmp_path, capfd):
  options = RunOptions(progress=True, tensorboard=False, async_checkpointing=False,
                       log_samples_every=0)
  with _trainer(TRAINER_CONFIG, run_dir=tmp_path, run_options=options) as trainer:
    history = trainer.train()
  err = capfd.readouterr().err
  assert len(history) == 3
  # The trainer logs the scheduled entropy coefficient of each update.
  np.testing.assert_allclose([m["entropy_coef"] for m in history], [0.3, 0.2, 0.1], rtol=1e-6)
  frames = [f for f in re.split(r"[\r\n]", err) if f.startswith("train")]
  for step, m in enumerate(history, start=1):
    shown = [f for f in frames if f" {step}/3 " in f and "reward=" in f]
    assert shown, (step, err[-2000:])
    postfix = dict(re.findall(r"(reward|kl)=([^,\]\s]+)", shown[-1]))
    assert postfix == {"reward": f"{m['objective/scores']:.4g}",
                       "kl": f"{m['objective/kl']:.4g}"}, shown[-1]
  assert "100%" in frames[-1] and "3/3" in frames[-1]


def _llama_param_count(m, *, value_head: bool) -> int:
  """Parameters of a Llama-style `ModelConfig` (RMSNorm, gated MLP, no biases), by hand."""
  d, f, v = m.hidden_size, m.intermediate_size, m.vocab_size
  attention = d * m.num_heads * m.head_dim * 2 + d * m.num_kv_heads * m.head_dim * 2  # q, o; k, v
  mlp = 3 * d * f  # gate, up, down
  norms = 2 * d
  total = v * d + m.num_layers * (attention + mlp + norms) + d  # embedding, layers, final norm
  if not m.tie_word_embeddings:
    total += v * d
  return total + (d + 1 if value_head else 0)


def test_trainer_mfu_against_a_hand_count():
  config = TRAINER_CONFIG  # the progress-bar test's programs, from the compilation cache
  trainer = _trainer(config)
  n = _llama_param_count(MODEL, value_head=True)
  assert n == 24 * 16 + (16 * 16 * 2 + 16 * 8 * 2 + 3 * 16 * 32 + 2 * 16) + 16 + 17 == 2753
  assert perf.count_params(trainer.state.policy) + perf.count_params(
      trainer.frozen.policy_rest) == n
  m = trainer.step()
  tokens = config.batch_size * (int(m["rollout/prompt_len"]) + config.sampling.max_new_tokens)
  # One minibatch: the first epoch's forward also gives the old log-probs, so the forward-only
  # passes are the rollout and the reference (no critic model, no reward model); trained: the
  # policy with its value head, 6N per token per epoch.
  assert trainer.steps.fuses_first_epoch
  hand = 2 * (2 * n * tokens) + config.ppo_epochs * 6 * n * tokens
  assert perf.update_flops(
      policy_params=n, critic_params=0, reward_params=0, batch=config.batch_size,
      prompt_len=int(m["rollout/prompt_len"]), response_len=config.sampling.max_new_tokens,
      epochs=config.ppo_epochs, fused_first_epoch=True,
  ) == hand
  assert m["mfu"] == pytest.approx(hand / m["time/total_s"] / 1e9, rel=1e-9)
  assert m["tokens_per_s"] == pytest.approx(tokens / m["time/total_s"], rel=1e-9)
