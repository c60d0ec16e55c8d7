"""jax_ppo.ppo: the PPO stage (PPO with a critic, GRPO, RLOO, REINFORCE++) on the pure core.

    from jax_ppo.ppo import PPOConfig, PPOTrainer
    trainer = PPOTrainer(PPOConfig(...), policy, reward=reward_fn, prompts=dataset)
    trainer.train()

`config` (PPOConfig, PPOOptimizer, PPOSampling), `state` (TrainState, FrozenParams, the KL
controller), `batch` (the training batch of a rollout), the update along the algorithm's seams:
`forward` (the models' forward passes, the one teacher-forced log-prob path), `experience` (rollout
-> batch), `advantages` (the advantage modes as a name -> function table), `loss` (one microbatch's
loss), `update` (epochs x minibatches x microbatches); `steps` (the compiled facade over them),
`programs` (how they compile), `placed_steps` / `placed_critic` (roles on sub-meshes of their own),
`prompt_shards` (each process's prompt rows), `trainer` (host orchestration), `monitor` (the
stability monitor, the trainer's hook on the run loop), `presets` (scenario presets and the
hyperparameter guide), `eval_metrics`, `evaluation` (held-out prompts: the metrics of `jax-ppo
eval` and the hook that logs them during training), `perf` (MFU).
"""

from jax_ppo.ppo.batch import Batch
from jax_ppo.ppo.config import ADVANTAGE_MODES, PPOConfig, PPOOptimizer, PPOSampling
from jax_ppo.ppo.state import FrozenParams, TrainState, init_train_state
from jax_ppo.ppo.steps import PPOSteps
from jax_ppo.ppo.trainer import PPOTrainer

__all__ = [
    "ADVANTAGE_MODES",
    "Batch",
    "FrozenParams",
    "PPOConfig",
    "PPOOptimizer",
    "PPOSampling",
    "PPOSteps",
    "PPOTrainer",
    "TrainState",
    "init_train_state",
]
