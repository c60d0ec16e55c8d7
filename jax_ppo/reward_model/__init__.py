"""jax_ppo.reward_model: the reward-model stage, a scalar head trained on preference pairs.

`config` (`RewardModelConfig` and its optimizer block `RewardModelOptimizer`), `pairwise`
(preference pairs, the Bradley-Terry loss, the normalisation's gain and bias), `steps` (the
compiled train, eval and score programs, on one device or a mesh), `trainer`
(`RewardModelTrainer`: data, the run loop, evaluation, normalisation, export).
"""

from jax_ppo.reward_model.config import RewardModelConfig, RewardModelOptimizer
from jax_ppo.reward_model.pairwise import (
    PreferencePairs,
    bradley_terry_loss,
    normalisation_from_scores,
    preference_pairs,
)
from jax_ppo.reward_model.steps import RewardModelSteps
from jax_ppo.reward_model.trainer import NORMALISATION_FILE, RewardModelTrainer

__all__ = [
    "NORMALISATION_FILE",
    "PreferencePairs",
    "RewardModelConfig",
    "RewardModelOptimizer",
    "RewardModelSteps",
    "RewardModelTrainer",
    "bradley_terry_loss",
    "normalisation_from_scores",
    "preference_pairs",
]
