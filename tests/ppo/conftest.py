"""The tiny model, config, prompts and reward shared by the trainer tests."""

import jax.numpy as jnp
import numpy as np

from jax_ppo.data import PromptDataset
from jax_ppo.models.config import ModelConfig
from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling

EOS, PAD, TARGET = 2, 0, 7
MODEL = ModelConfig(
    model_type="llama", vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=48,
)
CONFIG = PPOConfig(
    batch_size=8, num_minibatches=2, ppo_epochs=2,
    sampling=PPOSampling(max_new_tokens=6, temperature=1.0, stop_token_ids=(EOS,),
                         pad_token_id=PAD),
    optimizer=PPOOptimizer(learning_rate=3e-3, lr_schedule="constant"),
    kl_coef=0.01, vf_coef=0.5, total_updates=40, reward_clip=None,
)


def prompts(n=32, seed=0, vocab_size=MODEL.vocab_size):
  """`n` random prompts of 2-5 tokens (ids 3.. so none is PAD, BOS or EOS)."""
  rng = np.random.default_rng(seed)
  return PromptDataset(
      [list(rng.integers(3, vocab_size, size=int(rng.integers(2, 6)))) for _ in range(n)],
      seed=seed,
  )


def count_target(prompt_ids, prompt_mask, response_ids, response_mask):
  """The reward: how often the response contains TARGET."""
  return jnp.sum((response_ids == TARGET) & response_mask, axis=1).astype(jnp.float32)
