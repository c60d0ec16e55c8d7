"""jax_ppo.trainer: the RLHF loop (PPO with a critic, GRPO, RLOO, REINFORCE++) on the pure core.

    from jax_ppo.trainer import PPOConfig, PPOTrainer
    trainer = PPOTrainer(PPOConfig(...), policy, reward=reward_fn, prompts=dataset)
    trainer.train()

`config` (PPOConfig), `state` (TrainState, FrozenParams), `step` (the jitted experience and
update functions), `optim` (the optimizer and the KL controller), `rewards` (reward sources),
`trainer` (host orchestration), `loop` (the run loop shared by trainers: run folders,
`RunOptions`, checkpoints, rollback, preemption), `run` (`RunConfig`, `run_training`,
evaluation and export of run folders, used by the `jax-ppo` command line), `perf` (MFU).
"""

from jax_ppo.trainer.config import ADVANTAGE_MODES, PPOConfig
from jax_ppo.trainer.loop import NonFiniteUpdates
from jax_ppo.trainer.reward_model import RewardModelConfig, RewardModelTrainer
from jax_ppo.trainer.rewards import (
    CombinedScorer,
    FunctionScorer,
    RewardModelScorer,
    TokenScorer,
)
from jax_ppo.trainer.run import (
    REWARD_FUNCTIONS,
    RunConfig,
    build_trainer,
    evaluate_run,
    export_run,
    load_run_config,
    run_training,
)
from jax_ppo.trainer.sft import SFTConfig, SFTTrainer
from jax_ppo.trainer.state import FrozenParams, TrainState
from jax_ppo.trainer.step import Batch, PPOSteps, init_train_state, make_optimizer
from jax_ppo.trainer.trainer import PPOTrainer, RunCollapsed, RunOptions

__all__ = [
    "ADVANTAGE_MODES",
    "REWARD_FUNCTIONS",
    "Batch",
    "CombinedScorer",
    "FrozenParams",
    "FunctionScorer",
    "NonFiniteUpdates",
    "PPOConfig",
    "PPOSteps",
    "PPOTrainer",
    "RewardModelConfig",
    "RewardModelScorer",
    "RewardModelTrainer",
    "RunCollapsed",
    "RunConfig",
    "RunOptions",
    "SFTConfig",
    "SFTTrainer",
    "TokenScorer",
    "TrainState",
    "build_trainer",
    "evaluate_run",
    "export_run",
    "init_train_state",
    "load_run_config",
    "make_optimizer",
    "run_training",
]
