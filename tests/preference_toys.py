"""The toy preference of the reward-model and DPO trainer tests: a one-layer llama and records
of token ids whose chosen responses contain `TARGET` and whose rejected ones do not."""

from __future__ import annotations

import numpy as np

from jax_ppo.models.config import ModelConfig

MODEL = ModelConfig(
    model_type="llama", vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=48,
)
TARGET, EOS = 7, 2


def toy_records(n: int, seed: int, *, response_len: tuple[int, int] = (2, 6)) -> list[dict]:
  """`n` records `{prompt, chosen, rejected}` of token ids: prompts of 2-4 tokens, responses of
  `response_len` = `[low, high)` tokens; chosen ones contain TARGET, rejected ones do not."""
  rng = np.random.default_rng(seed)
  others = [t for t in range(3, MODEL.vocab_size) if t != TARGET]
  out = []
  for _ in range(n):
    prompt = [int(t) for t in rng.choice(others, size=int(rng.integers(2, 5)))]
    chosen = [int(t) for t in rng.choice(others, size=int(rng.integers(*response_len)))]
    chosen[int(rng.integers(len(chosen)))] = TARGET
    rejected = [int(t) for t in rng.choice(others, size=int(rng.integers(*response_len)))]
    out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
  return out
