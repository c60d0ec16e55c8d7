"""jax_ppo.training: the kit every stage trains with.

`loop` (the run loop: run folders, `RunOptions`, checkpoints, resume, preemption, the
non-finite stop, rollback), `stage` (`RunStage`, the base of every trainer on the loop), `hooks`
(what a stage's hook on the loop does: PPO's stability monitor), `optim` (the optimizer and the
checks of its fields), `state` (the optimizer step, gradient accumulation and batch order every
stage shares), `export` (the Hugging Face export).
"""

from jax_ppo.training.loop import NonFiniteUpdates, RunCollapsed, RunOptions
from jax_ppo.training.optim import make_optimizer

__all__ = ["NonFiniteUpdates", "RunCollapsed", "RunOptions", "make_optimizer"]
