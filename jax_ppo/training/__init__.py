"""jax_ppo.training: the kit every stage trains with.

`loop` (the run loop: run folders, `RunOptions`, checkpoints, resume, preemption, the
non-finite stop, rollback), `optim` (the optimizer and the checks of its fields), `monitor` (the
stability monitor).
"""

from jax_ppo.training.loop import NonFiniteUpdates, RunCollapsed, RunOptions
from jax_ppo.training.optim import make_optimizer

__all__ = ["NonFiniteUpdates", "RunCollapsed", "RunOptions", "make_optimizer"]
