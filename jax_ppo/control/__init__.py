"""jax_ppo.control: PPO on gymnax control tasks, built from the same core as the LM trainer.

CartPole-v1 checks that `jax_ppo.core` (GAE, clipped losses, entropy) trains a policy to the
task's ceiling; see `experiments/cartpole_ppo.py`. Needs gymnax (the `experiments` extra).
"""

from jax_ppo.control.ppo import (
    ActorCritic,
    ControlPPOConfig,
    EpisodeStats,
    final_return,
    init_episode_stats,
    make_env,
    make_train,
    return_curve,
    update_episode_stats,
)

__all__ = [
    "ActorCritic",
    "ControlPPOConfig",
    "EpisodeStats",
    "final_return",
    "init_episode_stats",
    "make_env",
    "make_train",
    "return_curve",
    "update_episode_stats",
]
