"""jax_ppo.core: the pure, jittable math of PPO for language models.

Imports only jax. Every function here is documented with its equation, its paper and the shape
of each argument (`B` batch, `T` response steps, `V` vocabulary); see `docs/core_api.md` and its
summary table.
"""

from jax_ppo.core._checks import REDUCTIONS
from jax_ppo.core.advantages import (
    gae,
    gae_from_dones,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from jax_ppo.core.importance import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    rollout_correction_weights,
)
from jax_ppo.core.kl import (
    KL_ESTIMATORS,
    KLController,
    KLControllerState,
    adaptive_kl_controller,
    fixed_kl_controller,
    kl_penalty,
    multiplicative_kl_controller,
)
from jax_ppo.core.logprobs import chunked_logprobs, entropy_from_logits, gather_logprobs
from jax_ppo.core.losses import (
    aggregate_loss,
    cispo_policy_loss,
    entropy_bonus,
    gspo_policy_loss,
    ppo_policy_loss,
    ppo_value_loss,
)
from jax_ppo.core.masks import (
    position_ids_from_mask,
    response_mask_from_stop_tokens,
    truncate_after_stop,
)
from jax_ppo.core.preference import DPO_LOSS_TYPES, dpo_loss
from jax_ppo.core.rewards import last_valid_index, overlong_penalty, shape_rewards
from jax_ppo.core.stats import (
    explained_variance,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "DPO_LOSS_TYPES",
    "KL_ESTIMATORS",
    "REDUCTIONS",
    "KLController",
    "KLControllerState",
    "adaptive_kl_controller",
    "aggregate_loss",
    "chunked_logprobs",
    "cispo_policy_loss",
    "dpo_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "explained_variance",
    "fixed_kl_controller",
    "gae",
    "gae_from_dones",
    "gather_logprobs",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_penalty",
    "last_valid_index",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "multiplicative_kl_controller",
    "overlong_penalty",
    "position_ids_from_mask",
    "ppo_policy_loss",
    "ppo_value_loss",
    "reinforce_plus_plus_advantages",
    "response_mask_from_stop_tokens",
    "rloo_advantages",
    "rollout_correction_weights",
    "shape_rewards",
    "truncate_after_stop",
]
