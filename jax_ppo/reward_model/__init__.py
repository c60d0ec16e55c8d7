"""jax_ppo.reward_model: the reward-model stage, a scalar head trained on preference pairs.

`pairwise` (the Bradley-Terry loss and the compiled steps), `trainer` (`RewardModelConfig`,
`RewardModelTrainer`).
"""

from jax_ppo.reward_model.trainer import RewardModelConfig, RewardModelTrainer

__all__ = ["RewardModelConfig", "RewardModelTrainer"]
