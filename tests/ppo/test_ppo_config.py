"""`PPOConfig`'s defaults are the values docs/rlhf_details.md states (items 3, 10, 12 and 17);
the sampling block (`PPOConfig.sampling`) and the flat keys it replaced."""

import dataclasses

from jax_ppo.config_io import config_from_dict, migrate_keys
from jax_ppo.ppo import PPOConfig, PPOSampling
from jax_ppo.ppo.config import SAMPLING_FIELDS
from jax_ppo.rollout.config import SamplingConfig, SamplingParams


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


def test_sampling_defaults_are_the_documented_ones():
  s = PPOConfig().sampling
  # Item 3: no top-k or top-p filtering during training; one temperature everywhere.
  assert isinstance(s, PPOSampling) and isinstance(s, SamplingParams)
  assert (s.temperature, s.top_k, s.top_p, s.max_new_tokens) == (0.7, 0, 1.0, 48)
  # The sampler's own options are not part of the block; n_samples stays with the batch. The
  # block holds the fields that moved out of PPOConfig, and the rollout's layout on a mesh
  # (`decode_tensor`, never a flat key).
  fields = {f.name for f in dataclasses.fields(PPOSampling)}
  assert fields == {f.name for f in dataclasses.fields(SamplingParams)}
  assert fields == set(SAMPLING_FIELDS) | {"decode_tensor"}
  assert s.decode_tensor is None  # the rollout on the training mesh
  assert "n_samples" in {f.name for f in dataclasses.fields(PPOConfig)}
  assert not {f.name for f in dataclasses.fields(PPOConfig)} & set(SAMPLING_FIELDS)


def test_the_flat_sampling_keys_moved_into_the_block():
  assert {k: v for k, v in PPOConfig.MOVED_KEYS.items() if v.startswith("sampling.")} == {
      f: f"sampling.{f}" for f in SAMPLING_FIELDS}
  old = {"batch_size": 4, "temperature": 0.9, "stop_token_ids": [2], "pad_token_id": 1,
         "optimizer": {"learning_rate": 1e-6}}
  assert migrate_keys(PPOConfig, old) == {
      "batch_size": 4, "optimizer": {"learning_rate": 1e-6},
      "sampling": {"temperature": 0.9, "stop_token_ids": [2], "pad_token_id": 1}}
  config = config_from_dict(PPOConfig, migrate_keys(PPOConfig, old))
  assert config.sampling == PPOSampling(temperature=0.9, stop_token_ids=(2,), pad_token_id=1)


def test_the_sampler_config_is_built_from_the_block():
  block = PPOSampling(max_new_tokens=5, temperature=0.9, top_k=3, top_p=0.5, stop_token_ids=(2,),
                      pad_token_id=1)
  sampler = SamplingConfig.from_params(block, n_samples=4, batch_buckets=(8,))
  assert sampler == SamplingConfig(max_new_tokens=5, temperature=0.9, top_k=3, top_p=0.5,
                                   stop_token_ids=(2,), pad_token_id=1, n_samples=4,
                                   batch_buckets=(8,))
