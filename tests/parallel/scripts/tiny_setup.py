"""A tiny model, config and prompts shared by the multi-device scripts (imported by them)."""

import jax
import numpy as np
from flax import nnx

from jax_ppo.data import PromptDataset
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.transformer import CausalLM
from tests.ppo import conftest as trainer_conftest
from tests.ppo.conftest import count_target  # noqa: F401  (re-exported to the scripts)

EOS, PAD, TARGET = 2, 0, 7
# Every sharded dimension divides 2: D = 32 (fsdp), H*Dh = 32, K*Dh = 16, F = 64, V = 64 (tensor).
MODEL = ModelConfig(
    model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
)


def policy(seed: int = 0) -> CausalLM:
  return CausalLM(MODEL, rngs=nnx.Rngs(seed))


def prompts(n: int = 16, seed: int = 0) -> PromptDataset:
  return trainer_conftest.prompts(n, seed, vocab_size=MODEL.vocab_size)


def max_abs_diff(a, b) -> float:
  import jax

  diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64)
                                                        - np.asarray(y, np.float64)))), a, b)
  return max(jax.tree.leaves(diffs), default=0.0)


def one_update(trainer, rollout, scores):
  """One PPO update of `trainer` on `rollout`: `(state, batch, metrics on the host)`, through the
  fused program when the config allows it, else experience then update. One multi-device
  program is in flight at a time (XLA:CPU's fake devices can deadlock in their collectives when
  two programs overlap on a loaded machine)."""
  if trainer.steps.fuses_first_epoch:
    state, batch, exp, upd = jax.block_until_ready(trainer.steps.experience_update(
        trainer.state, trainer.frozen, rollout, scores))
  else:
    batch, exp = jax.block_until_ready(
        trainer.steps.experience(trainer.state, trainer.frozen, rollout, scores))
    state, upd = jax.block_until_ready(
        trainer.steps.update(trainer.state, trainer.frozen, batch, exp["objective/kl"]))
  return state, batch, {**jax.device_get(exp), **jax.device_get(upd)}


def rollout_and_scores(shared, split):
  """One rollout of `shared`'s policy and its scores by both trainers: `shared`'s scorer, and
  `split`'s through its placement (the reward model on its own devices when split)."""
  from jax_ppo.ppo.placed_steps import score

  prompt_ids, _ = shared.dataset.batch(0, shared.config.prompts_per_update)
  rollout = jax.block_until_ready(
      shared.sampler(prompt_ids, jax.random.PRNGKey(1), state=shared.policy_state()))
  scores1 = jax.block_until_ready(shared.scorer(rollout, shared.frozen.reward))
  scores2 = jax.block_until_ready(score(split.placement, split.scorer, rollout,
                                        split.frozen.reward))
  return rollout, scores1, scores2
