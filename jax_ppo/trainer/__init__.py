"""jax_ppo.trainer: the RLHF loop (PPO with a critic, GRPO, RLOO, REINFORCE++) on the pure core.

    from jax_ppo.trainer import PPOConfig, PPOTrainer
    trainer = PPOTrainer(PPOConfig(...), policy, reward=reward_fn, prompts=dataset)
    trainer.train()

`config` (PPOConfig), `state` (TrainState, FrozenParams), `step` (the jitted experience and
update functions), `rewards` (reward sources), `trainer` (host orchestration), `perf` (MFU).
"""

from jax_ppo.trainer.config import ADVANTAGE_MODES, PPOConfig
from jax_ppo.trainer.rewards import FunctionScorer, RewardModelScorer, TokenScorer
from jax_ppo.trainer.state import FrozenParams, TrainState
from jax_ppo.trainer.step import Batch, PPOSteps, init_train_state, make_optimizer
from jax_ppo.trainer.trainer import PPOTrainer

__all__ = [
    "ADVANTAGE_MODES",
    "Batch",
    "FrozenParams",
    "FunctionScorer",
    "PPOConfig",
    "PPOSteps",
    "PPOTrainer",
    "RewardModelScorer",
    "TokenScorer",
    "TrainState",
    "init_train_state",
    "make_optimizer",
]
