"""jax_ppo: PPO fine-tuning of language models (RLHF) as pure, jitted JAX/Flax functions.

The pure core (`jax_ppo.core`) is re-exported here, so research code can write
`from jax_ppo import gae, ppo_policy_loss`. Models, rollout and trainer live in their own
subpackages and are imported explicitly (`import jax_ppo.models`).
"""

from jax_ppo.core import *  # noqa: F403
from jax_ppo.core import __all__ as _core_all

__version__ = "0.1.0"
__all__ = list(_core_all)
