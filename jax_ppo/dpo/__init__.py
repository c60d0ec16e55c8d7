"""jax_ppo.dpo: direct preference optimisation (DPO, IPO, hinge, cDPO) of a causal LM on
preference pairs, against a frozen reference.

`config` (`DPOConfig` and its optimizer block `DPOOptimizer`), `pairs` (tokenized pairs with
their response tokens marked, and their encoding from preference records), `steps` (the policy's
and the reference's sequence log-probs, `jax_ppo.core.dpo_loss`, the compiled train and eval
steps), `trainer` (`DPOTrainer`: data, the precomputed reference, the run loop, evaluation,
export); online DPO: `online_pairs` (the best and worst scored of each prompt's samples as
pairs), `online` (`OnlineDPOTrainer`: sample, score, pick, one DPO step).
"""

from jax_ppo.dpo.config import DPOConfig, DPOOptimizer, DPOSampling
from jax_ppo.dpo.online import OnlineDPOTrainer
from jax_ppo.dpo.online_pairs import rollout_pairs, select_pairs
from jax_ppo.dpo.pairs import DPOPairs, PairEncoder, dpo_pairs
from jax_ppo.dpo.steps import DPOSteps, sequence_logprobs
from jax_ppo.dpo.trainer import METRICS, DPOTrainer

__all__ = [
    "METRICS",
    "DPOConfig",
    "DPOOptimizer",
    "DPOPairs",
    "DPOSampling",
    "DPOSteps",
    "DPOTrainer",
    "OnlineDPOTrainer",
    "PairEncoder",
    "dpo_pairs",
    "rollout_pairs",
    "select_pairs",
    "sequence_logprobs",
]
