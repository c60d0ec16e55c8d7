"""`PPOConfig`'s defaults are the values docs/rlhf_details.md states (items 10, 12 and 17)."""

import dataclasses

from jax_ppo.ppo import PPOConfig


def test_gae_and_value_loss_defaults_are_the_documented_ones():
  c = PPOConfig()
  # Item 10: no discount within a response, GAE lambda 0.95.
  assert (c.gamma, c.lam) == (1.0, 0.95)
  assert c.advantage_mode == "gae" and c.whiten_advantages and not c.whiten_rewards
  # Item 12: the value loss is clipped at 0.2 around the rollout values and weighted by 0.1.
  assert (c.value_clip_eps, c.vf_coef) == (0.2, 0.1)
  # The dataclass's own field defaults say the same (not a value computed in __post_init__).
  fields = {f.name: f.default for f in dataclasses.fields(PPOConfig)}
  assert [fields[k] for k in ("gamma", "lam", "value_clip_eps", "vf_coef")] == [1.0, 0.95, 0.2,
                                                                                0.1]


def test_optimizer_defaults_are_the_documented_ones():
  c = PPOConfig()
  # Item 17: PyTorch-style AdamW eps, linear decay to 0, global-norm clipping at 1.0.
  o = c.optimizer
  assert (o.adam_eps, o.lr_schedule, o.max_grad_norm) == (1e-5, "linear", 1.0)
  assert 1e-6 <= o.learning_rate <= 3e-6
