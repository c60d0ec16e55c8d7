"""End-to-end and unit tests of the PPO trainer (jax_ppo/ppo) on tiny random models."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models import LoRAConfig, ScalarModel, add_lora
from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOConfig, PPOTrainer
from jax_ppo.ppo.batch import process_scores
from jax_ppo.rewards import TokenScorer
from jax_ppo.rewards.scorers import FunctionScorer, check_scores
from tests.ppo.conftest import CONFIG, MODEL, TARGET, count_target, prompts

# Trainers with identical programs load them from the cache instead of recompiling.
pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def _config(**kwargs):
  return dataclasses.replace(CONFIG, **kwargs)


def _lr(learning_rate: float):
  """`CONFIG`'s optimizer block at another learning rate."""
  return dataclasses.replace(CONFIG.optimizer, learning_rate=learning_rate)


def _trainer(config, policy=None, **kwargs):
  policy = policy if policy is not None else CausalLM(MODEL, rngs=nnx.Rngs(0))
  return PPOTrainer(
      config, policy, reward=TokenScorer(count_target), prompts=prompts(), peak_flops=1e11,
      **kwargs,
  )


def test_programmatic_reward_rises_and_first_ratio_is_one():
  trainer = _trainer(_config())
  history = [trainer.step() for _ in range(25)]
  scores = [m["objective/scores"] for m in history]
  assert np.mean(scores[-5:]) > np.mean(scores[:5]) + 1.0, scores
  for m in history:
    # Item 4: on the first minibatch of the first epoch the policy is the behaviour policy.
    assert abs(m["val/ratio_first_minibatch"] - 1.0) < 1e-5
    assert all(np.isfinite(v) for v in m.values())
  for name in ("objective/kl", "objective/entropy", "objective/non_score_reward",
               "objective/rlhf_reward", "policy/approxkl_avg", "policy/clipfrac_avg",
               "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "policy/entropy_avg",
               "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr", "episode", "eps",
               "val/explained_variance", "response_length/mean", "kl_coef", "time/rollout_s",
               "time/update_s", "tokens_per_s", "mfu"):
    assert name in history[-1], name
  assert history[-1]["episode"] == 25 * 8
  assert trainer.steps.update._cache_size() == len({m["rollout/prompt_len"] for m in history})


@pytest.mark.parametrize("mode", ["grpo", "rloo", "reinforce++"])
def test_every_advantage_mode_learns(mode):
  trainer = _trainer(_config(advantage_mode=mode, n_samples=4 if mode != "reinforce++" else 1))
  history = [trainer.step() for _ in range(20)]
  scores = [m["objective/scores"] for m in history]
  assert np.mean(scores[-5:]) > np.mean(scores[:5]) + 0.5, scores
  assert ("loss/kl_avg" in history[-1]) == (mode == "grpo")  # GRPO: KL as a loss term
  assert "loss/value_avg" not in history[-1]  # no critic


def test_lora_trains_adapters_only_with_base_as_reference():
  policy = add_lora(CausalLM(MODEL, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, alpha=8),
                    rngs=nnx.Rngs(1))
  trainer = _trainer(_config(optimizer=_lr(1e-2)), policy=policy)
  base_before = jax.tree.map(np.asarray, trainer.frozen.policy_rest)
  assert trainer.frozen.ref is None  # no second copy of the weights
  history = [trainer.step() for _ in range(3)]
  jax.tree.map(np.testing.assert_array_equal, base_before,
               jax.tree.map(np.asarray, trainer.frozen.policy_rest))
  assert history[0]["objective/kl"] == pytest.approx(0.0, abs=1e-6)  # adapters start at B = 0
  assert history[-1]["objective/kl"] != 0.0


def test_separate_critic_from_a_reward_model():
  """The critic is the given model: the policy gets no value head, the rollout's old values are
  the critic's outputs at the positions that predict each response token (0 on padding), and
  the update trains the critic's own parameters."""
  critic = ScalarModel(MODEL, head_init="reward", rngs=nnx.Rngs(3))
  initial = jax.tree.map(np.asarray, nnx.state(critic, nnx.Param))
  trainer = _trainer(_config(), value_model=critic)
  assert not any("value_head" in str(path) for path, _ in
                 jax.tree_util.tree_leaves_with_path(trainer.state.policy))
  jax.tree.map(np.testing.assert_array_equal, initial, jax.tree.map(np.asarray,
                                                                    trainer.state.value))
  batch, _ = _experience(trainer)
  t = batch.response_ids.shape[1]
  s = batch.input_ids.shape[1] - t
  expected = np.asarray(critic(batch.input_ids, batch.attention_mask,
                               positions=batch.positions))[:, s - 1 : s + t - 1]
  mask = np.asarray(batch.response_mask)
  np.testing.assert_allclose(np.asarray(batch.old_values)[mask], expected[mask], rtol=1e-5,
                             atol=1e-6)
  assert np.all(np.asarray(batch.old_values)[~mask] == 0)
  m = trainer.step()
  assert np.isfinite(m["loss/value_avg"]) and m["loss/value_avg"] > 0
  moved = jax.tree.map(lambda a, b: bool(np.any(a != np.asarray(b))), initial,
                       trainer.state.value)
  assert all(jax.tree.leaves(moved)), "every critic parameter is trained"


def _moved(before, after) -> dict:
  """`{path: whether the leaf changed}` of two parameter trees."""
  return {jax.tree_util.keystr(p): bool(np.any(np.asarray(a) != np.asarray(b)))
          for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(before),
                               jax.tree.leaves(after), strict=True)}


def test_critic_learning_rate_scales_the_critics_updates_only():
  """`optimizer.critic_learning_rate`: 0 leaves a separate critic (and a value head on the policy
  trunk) as it was while the policy trains; twice the policy's rate moves the critic twice as
  far on the same batch, the policy as far as without it; `lr/critic` logs it."""
  def run(critic_lr, value_model=True):
    optimizer = dataclasses.replace(CONFIG.optimizer, critic_learning_rate=critic_lr)
    critic = ScalarModel(MODEL, head_init="reward", rngs=nnx.Rngs(3)) if value_model else None
    trainer = _trainer(_config(optimizer=optimizer, ppo_epochs=1, num_minibatches=1),
                       value_model=critic)
    before = jax.tree.map(np.asarray, (trainer.state.policy, trainer.state.value))
    m = trainer.step()
    return before, jax.tree.map(np.asarray, (trainer.state.policy, trainer.state.value)), m

  (policy0, value0), (policy1, value1), m = run(0.0)
  assert not any(_moved(value0, value1).values())
  assert all(_moved(policy0, policy1).values())
  assert m["lr/critic"] == 0.0 and m["lr"] == pytest.approx(3e-3)
  (policy0, _), (policy1, _), m = run(0.0, value_model=False)  # the value head on the trunk
  moved = _moved(policy0, policy1)
  head = [k for k in moved if "value_head" in k]
  assert head and not any(moved[k] for k in head)
  assert all(v for k, v in moved.items() if "value_head" not in k)
  assert m["lr/critic"] == 0.0
  (p0, v0), (p_same, v_same), m_same = run(None)
  _, (p_double, v_double), m_double = run(6e-3)
  assert m_same["lr/critic"] == pytest.approx(3e-3) and m_double["lr/critic"] == pytest.approx(6e-3)
  for a, b in zip(jax.tree.leaves(p_same), jax.tree.leaves(p_double), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  for a, b, c in zip(jax.tree.leaves(v0), jax.tree.leaves(v_same), jax.tree.leaves(v_double),
                     strict=True):
    np.testing.assert_allclose(c - a, 2 * (b - a), rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("value", [-1e-5, float("nan"), float("inf"), "fast", True])
def test_critic_learning_rate_errors_name_the_field(value):
  with pytest.raises(ValueError, match=r"^PPOOptimizer.critic_learning_rate=.* is invalid: use "
                                       "a number >= 0"):
    dataclasses.replace(CONFIG.optimizer, critic_learning_rate=value)
  with pytest.raises(ValueError, match=r"^PPOConfig.optimizer.critic_learning_rate=1e-05 is set "
                                       "but advantage_mode='grpo' trains no critic"):
    _config(advantage_mode="grpo", n_samples=2, optimizer=dataclasses.replace(
        CONFIG.optimizer, critic_learning_rate=1e-5))


def test_layer_loops_change_speed_not_the_update():
  """Unrolled training and scanned sampling (the benchmark's pair) give the scan-only update."""
  runs = []
  for train, rollout in ((True, True), (False, True), (False, False)):
    trainer = _trainer(_config(train_scan_layers=train, rollout_scan_layers=rollout))
    runs.append((trainer.step(), jax.tree.map(np.asarray, trainer.state.policy)))
  (m0, p0), *others = runs
  for m1, p1 in others:
    assert m1["objective/scores"] == m0["objective/scores"]  # the same samples
    for name in ("loss/policy_avg", "loss/value_avg", "objective/kl"):
      np.testing.assert_allclose(m1[name], m0[name], rtol=1e-4, atol=1e-6, err_msg=name)
    for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
      np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def _experience(trainer):
  prompt_ids, _ = trainer.dataset.batch(0, trainer.config.prompts_per_update)
  rollout = trainer.sampler(prompt_ids, jax.random.PRNGKey(0), state=trainer.policy_state())
  scores = trainer.scorer(rollout, None)
  return trainer.steps.experience(trainer.state, trainer.frozen, rollout, scores)


def test_gradient_accumulation_is_normalised_by_the_minibatch_token_count():
  cfg = _config(num_minibatches=1, ppo_epochs=1)
  one = _trainer(cfg)
  batch, metrics = _experience(one)
  lengths = np.asarray(batch.response_mask).sum(1)
  assert len(set(lengths.tolist())) > 1, "the check needs responses of different lengths"
  four = _trainer(dataclasses.replace(cfg, gradient_accumulation_steps=4))
  s1, m1 = one.steps.update(one.state, one.frozen, batch, metrics["objective/kl"])
  s4, m4 = four.steps.update(four.state, four.frozen, batch, metrics["objective/kl"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6),
               s1.policy, s4.policy)
  np.testing.assert_allclose(m1["loss/policy_avg"], m4["loss/policy_avg"], rtol=1e-4, atol=1e-6)


def test_target_kl_stops_the_remaining_epochs():
  trainer = _trainer(_config(ppo_epochs=4, target_kl=1e-9, optimizer=_lr(1e-2)))
  m = trainer.step()
  assert m["policy/early_stopped"] == 1.0
  assert m["policy/epochs_run"] == 1.0


def test_adaptive_kl_controller_moves_the_coefficient():
  trainer = _trainer(_config(kl_controller="adaptive", kl_coef=0.2, kl_target=1e-3,
                             kl_horizon=10, optimizer=_lr(1e-2)))
  coefs = [trainer.step()["kl_coef"] for _ in range(4)]
  assert coefs[0] == pytest.approx(0.2)
  assert coefs[-1] > coefs[0]  # KL above target -> beta grows


def test_replay_buffer_reuses_batches():
  trainer = _trainer(_config(replay_buffer_size=2, replay_batches_per_update=1))
  for _ in range(3):
    trainer.step()
  assert len(trainer.replay) == 2
  assert int(trainer.state.opt_steps) == 3 * 4 + 2 * 4  # fresh: 3 updates x 4; replay: 2 x 4
  assert int(trainer.state.step) == 3


def test_missing_eos_and_length_penalties():
  cfg = _config(missing_eos_penalty=-1.0, length_penalty=0.1, reward_scale=2.0, reward_shift=1.0,
                reward_clip=3.0)

  class R:
    has_stop = jnp.array([True, False, True])
    response_lengths = jnp.array([2, 6, 4])

  out = process_scores(cfg, jnp.array([1.5, 0.0, 10.0]), R)
  np.testing.assert_allclose(out, [1.0 - 0.2, -1.0, 3.0 - 0.4], rtol=1e-6)


def test_python_reward_function_and_bad_reward_values():
  trainer = PPOTrainer(
      _config(), CausalLM(MODEL, rngs=nnx.Rngs(0)), prompts=prompts(), peak_flops=1e11,
      reward=lambda prompts, responses: [float(r.count(TARGET)) for r in responses],
  )
  assert isinstance(trainer.scorer, FunctionScorer)
  assert np.isfinite(trainer.step()["objective/scores"])
  with pytest.raises(ValueError, match="non-finite scores at rows \\[1\\]"):
    check_scores([0.0, float("nan")], 2, source="The reward function")
  with pytest.raises(ValueError, match="shape \\(3,\\) for 2 responses"):
    check_scores([0.0, 1.0, 2.0], 2, source="The reward function")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"batch_size": 6, "num_minibatches": 4}, "batch_size"),
        ({"batch_size": 8, "n_samples": 3}, "batch_size"),
        ({"advantage_mode": "grpo", "n_samples": 1}, "n_samples"),
        ({"advantage_mode": "ppo"}, "advantage_mode"),
        ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps"),
        ({"clip_eps": 0.0}, "clip_eps"),
        ({"lam": 1.5}, "lam"),
        ({"sampling": {"temperature": 1.0}}, "sampling"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"optimizer": {"learning_rate": 1e-6}}, "optimizer"),
        ({"replay_batches_per_update": 2, "replay_buffer_size": 1}, "replay_batches_per_update"),
        ({"train_scan_layers": "unroll"}, "train_scan_layers"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=f"PPOConfig.{field}="):
    PPOConfig(**kwargs)
