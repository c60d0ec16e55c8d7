"""The PPO optimizer (`make_optimizer`, docs/rlhf_details.md item 17) on small pytrees.

AdamW with PyTorch-style `eps = 1e-5`, gradients clipped to one global norm over the whole tree
(policy and critic together), and a learning rate decayed linearly to 0 at the run's last
optimizer step. Each update is compared with a NumPy AdamW written from its definition:

  g <- g * min(1, c / ||g||),  m <- b1 m + (1 - b1) g,  v <- b2 v + (1 - b2) g^2,
  u = -lr_k * (m / (1 - b1^k)) / (sqrt(v / (1 - b2^k)) + eps)

with `k` the 1-based step and `lr_k` the schedule at step `k - 1`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_ppo.ppo import PPOConfig, PPOOptimizer
from jax_ppo.training.optim import make_optimizer

# 2 updates x 2 epochs x 2 minibatches = 8 optimizer steps.
SMALL_RUN = PPOConfig(batch_size=4, num_minibatches=2, ppo_epochs=2, total_updates=2,
                      optimizer=PPOOptimizer(learning_rate=1e-2))


def _tree(seed: int, scale: float = 1.0):
  """A `{"policy", "value"}` gradient-shaped pytree (like the trainer's params)."""
  rng = np.random.default_rng(seed)
  return {
      "policy": {"w": jnp.asarray(scale * rng.normal(size=(3, 2)), jnp.float32),
                 "b": jnp.asarray(scale * rng.normal(size=(2,)), jnp.float32)},
      "value": {"w": jnp.asarray(scale * rng.normal(size=(2,)), jnp.float32)},
  }


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def _with(config: PPOConfig, **optimizer) -> PPOConfig:
  """`config` with fields of its optimizer block replaced."""
  return dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, **optimizer))


def _make(config: PPOConfig):
  """`make_optimizer` over the run's optimizer steps, as `PPOTrainer` builds it."""
  return make_optimizer(config.optimizer, config.total_optimizer_steps)


def _run(config: PPOConfig, grads: list):
  """The optimizer's updates `[K, P]` for the gradients `grads` (one per step), jitted."""
  optimizer, _ = _make(config)
  params = jax.tree.map(jnp.zeros_like, grads[0])
  state = optimizer.init(params)
  step = jax.jit(optimizer.update)
  updates = []
  for g in grads:
    u, state = step(g, state, params)
    updates.append(_flat(u))
  return np.stack(updates), state


def _adamw_reference(config: PPOConfig, grads: list, lr) -> np.ndarray:
  """NumPy AdamW (PyTorch-style eps outside the square root) after global-norm clipping."""
  opt = config.optimizer
  b1, b2, eps = opt.adam_b1, opt.adam_b2, opt.adam_eps
  m = v = 0.0
  out = []
  for k, g in enumerate(grads, start=1):
    g = _flat(g)
    if opt.max_grad_norm is not None:
      g = g * min(1.0, opt.max_grad_norm / np.linalg.norm(g))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    out.append(-lr(k - 1) * (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps))
  return np.stack(out)


def test_adam_eps_is_pytorch_style_1e_5():
  assert PPOConfig().optimizer.adam_eps == 1e-5 and PPOConfig().optimizer.weight_decay == 0.0
  # A gradient of the order of eps: the first step is -lr * g / (|g| + eps), so eps = 1e-5
  # halves a 1e-5 gradient's step (eps = 1e-8 would leave it at ~ -lr).
  config = _with(SMALL_RUN, lr_schedule="constant")
  g = jax.tree.map(lambda x: jnp.full_like(x, 1e-5), _tree(0))
  updates, _ = _run(config, [g])
  np.testing.assert_allclose(updates[0], -config.optimizer.learning_rate * 0.5, rtol=1e-4)
  grads = [_tree(s, 1e-5) for s in range(3)]
  updates, _ = _run(config, grads)
  np.testing.assert_allclose(
      updates, _adamw_reference(config, grads, lambda k: config.optimizer.learning_rate), rtol=1e-4,
      atol=1e-9)


def test_learning_rate_decays_linearly_to_zero_at_the_last_optimizer_step():
  config = SMALL_RUN
  assert PPOConfig().optimizer.lr_schedule == "linear"
  assert config.optimizer.lr_schedule == "linear"
  total = config.total_optimizer_steps
  assert total == 8
  _, schedule = _make(config)
  lr = config.optimizer.learning_rate
  for k in range(total + 2):
    assert float(schedule(k)) == pytest.approx(lr * max(1 - k / total, 0.0), abs=1e-9), k
  # The updates follow it: step k + 1 (optax's count k) uses lr * (1 - k / total), so the
  # step after the run's last one would not move the parameters at all.
  grads = [_tree(s) for s in range(total + 1)]
  updates, state = _run(config, grads)
  np.testing.assert_allclose(
      updates, _adamw_reference(config, grads, lambda k: lr * max(1 - k / total, 0.0)),
      rtol=1e-4, atol=1e-8)
  assert np.all(updates[total] == 0.0) and np.abs(updates[total - 1]).max() > 0
  # The schedule's own step counter in the optimizer state has passed the run's last step.
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
  (sched,) = [s for s in jax.tree.leaves(state, is_leaf=is_schedule) if is_schedule(s)]
  count = sched.count
  assert int(count) == total + 1 and float(schedule(int(count) - 1)) == 0.0

  # With warm-up: linear from 0 to lr over the warm-up steps, then linear to 0 at the end.
  warm = _with(config, warmup_steps=2)
  _, schedule = _make(warm)
  expected = [0.0, lr / 2, lr, lr * 5 / 6, lr * 4 / 6, lr * 3 / 6, lr * 2 / 6, lr / 6, 0.0]
  np.testing.assert_allclose([float(schedule(k)) for k in range(total + 1)], expected,
                             atol=1e-9)


def test_gradients_are_clipped_to_one_global_norm_over_policy_and_critic():
  config = _with(SMALL_RUN, lr_schedule="constant")
  assert PPOConfig().optimizer.max_grad_norm == 1.0 and config.optimizer.max_grad_norm == 1.0
  huge = _tree(1, 1e6)
  # The policy's gradient is huge, the critic's is small: one norm over both scales both.
  huge["value"]["w"] = jnp.asarray([1e-3, -2e-3], jnp.float32)
  norm = np.linalg.norm(_flat(huge))
  assert norm > 1e5
  grads = [huge, _tree(2), _tree(3)]
  updates, state = _run(config, grads)
  np.testing.assert_allclose(
      updates, _adamw_reference(config, grads, lambda k: config.optimizer.learning_rate), rtol=1e-4,
      atol=1e-9)
  # Read the first moment from the optimizer state after one step: it is (1 - b1) times the
  # clipped gradient, g / ||g||, critic included; unclipped it would be 1e5 times larger.
  _, state = _run(config, [huge])
  mu = _flat(optax.tree.get(state, "mu"))
  b1 = config.optimizer.adam_b1
  np.testing.assert_allclose(mu, (1 - b1) * _flat(huge) / norm, rtol=1e-5, atol=1e-12)
  assert np.linalg.norm(mu) == pytest.approx(1 - b1, rel=1e-5)
  # Without clipping the huge gradient would dominate Adam's moments for many steps: the
  # second step's update would differ from the clipped one.
  unclipped, _ = _run(_with(config, max_grad_norm=None), grads)
  assert np.abs(unclipped[1] - updates[1]).max() > 1e-3
