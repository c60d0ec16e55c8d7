"""jax_ppo.checkpoint: periodic, asynchronous, resumable run checkpoints (Orbax).

    ckpt = RunCheckpointer(run_dir / "checkpoints", save_every=10, keep_last=3,
                           best_metric="objective/scores", config=config)
    ckpt.maybe_save(step, state, metrics, extra)       # returns at once (async)
    state, extra = ckpt.restore(like=state)            # latest, or restore(step, like=...)

Restoring checks each step before reading its arrays (`CheckpointCorrupt` for a damaged one,
`CheckpointStructureMismatch` for arrays of another model); the latest falls back to the newest
readable step, moving damaged ones into `checkpoints/corrupt/`, never deleting.
"""

from jax_ppo.checkpoint.errors import (
    CheckpointConfigMismatch,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointStructureMismatch,
    check_config,
    config_differences,
)
from jax_ppo.checkpoint.integrity import abstract_like
from jax_ppo.checkpoint.manager import BEST_MODES, RunCheckpointer

__all__ = [
    "BEST_MODES",
    "CheckpointConfigMismatch",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointStructureMismatch",
    "RunCheckpointer",
    "abstract_like",
    "check_config",
    "config_differences",
]
