"""jax_ppo.dpo: direct preference optimisation (DPO, IPO, hinge, cDPO) of a causal LM on
preference pairs, against a frozen reference.

`config` (`DPOConfig` and its optimizer block `DPOOptimizer`), `pairs` (tokenized pairs with
their response tokens marked, and their encoding from preference records), `steps` (the policy's
and the reference's sequence log-probs, `jax_ppo.core.dpo_loss`, the compiled train and eval
steps), `trainer` (`DPOTrainer`: data, the precomputed reference, the run loop, evaluation,
export).
"""

from jax_ppo.dpo.config import DPOConfig, DPOOptimizer
from jax_ppo.dpo.pairs import DPOPairs, PairEncoder, dpo_pairs
from jax_ppo.dpo.steps import DPOSteps, sequence_logprobs
from jax_ppo.dpo.trainer import METRICS, DPOTrainer

__all__ = [
    "METRICS",
    "DPOConfig",
    "DPOOptimizer",
    "DPOPairs",
    "DPOSteps",
    "DPOTrainer",
    "PairEncoder",
    "dpo_pairs",
    "sequence_logprobs",
]
