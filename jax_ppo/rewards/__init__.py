"""jax_ppo.rewards: what PPO scores its rollouts with.

`scorers` (a reward model, a Python function on texts or token ids, and their weighted
combination), `specs` (the built-in reward functions and `module:function` references a run
config names), `arithmetic` (the exact-match reward of the arithmetic task).
"""

from jax_ppo.rewards.scorers import CombinedScorer, FunctionScorer, RewardModelScorer, TokenScorer
from jax_ppo.rewards.specs import REWARD_FUNCTIONS

__all__ = [
    "REWARD_FUNCTIONS",
    "CombinedScorer",
    "FunctionScorer",
    "RewardModelScorer",
    "TokenScorer",
]
