"""`RunStage`: the base every trainer on the run loop shares (PPO, SFT, reward model, DPO).

A trainer owns its state (a pytree with `step` and `lr_scale` arrays) and its `step()`; it hands
both to a `jax_ppo.training.loop.RunLoop` (its `run`), which owns the run folder, the
checkpoints, the hooks and preemption. `RunStage` gives a trainer what does not differ from one
stage to the next: its step count, a checkpoint's stage mark and its restore, the learning-rate
scale a rollback changes, `train(n)` through the loop, and `close()`.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jax_ppo.checkpoint import CheckpointError, RunCheckpointer
from jax_ppo.training.loop import RunLoop, TrainingHistory


class RunStage:
  """What every trainer on a `RunLoop` shares (PPO, SFT, reward model): a `Stage` whose
  `state` has `step` and `lr_scale` arrays, whose loop is `self.run` and whose length is
  `total_steps`.

  `train(n)` runs `n` more steps, never past `total_steps`; `close()` (or leaving a `with`
  block) flushes the logs and closes the run folder.
  """

  run: RunLoop
  state: Any
  total_steps: int
  preempted: str | None = None
  CHECKPOINT_STAGE: ClassVar[str | None] = None
  """The `stage` mark that `checkpoint_extra` writes into this trainer's checkpoints and
  `restore_checkpoint` requires of them ("sft", "reward_model", "dpo"); a trainer that leaves it
  None (PPO) defines both methods itself."""

  @property
  def run_dir(self) -> pathlib.Path | None:
    return self.run.run_dir

  @property
  def step_count(self) -> int:
    return int(self.state.step)

  def samples(self, *, limit: int) -> list[dict[str, Any]]:
    """Records `{prompt, response, reward}` of the last step; none for stages that generate
    nothing."""
    del limit
    return []

  def checkpoint_arrays(self) -> dict[str, Any]:
    return {}

  def checkpoint_extra(self) -> dict[str, Any]:
    return {"stage": self.CHECKPOINT_STAGE, "step": self.step_count}

  def restore_checkpoint(self, checkpointer: RunCheckpointer, step: int | None) -> dict:
    """Restores the state of a checkpoint (None: the latest) of this stage
    (`CHECKPOINT_STAGE`); returns its extra."""
    return self.restore_stage_state(checkpointer, step, stage=self.CHECKPOINT_STAGE)

  def restore_stage_state(self, checkpointer: RunCheckpointer, step: int | None, *,
                          stage: str) -> dict:
    """Restores `state` from a checkpoint (None: the latest) that `checkpoint_extra` marked
    with `stage`; returns its extra."""
    state, extra = checkpointer.restore(step, like=self.state)
    if extra.get("stage") != stage:
      raise CheckpointError(
          f"The checkpoint in {str(checkpointer.directory)!r} was not written by a "
          f"{type(self).__name__}; give a run folder of this stage ({stage}) or another run_dir."
      )
    self.state = state
    return extra

  def scale_learning_rate(self, factor: float) -> float:
    """Multiplies `state.lr_scale` by `factor` (a rollback); returns the new scale."""
    scale = float(self.state.lr_scale) * factor
    lr_scale = self.state.lr_scale
    self.state = self.state.replace(
        lr_scale=jax.device_put(jnp.asarray(scale, lr_scale.dtype), lr_scale.sharding))
    return scale

  def train(self, num_steps: int | None = None, *,
            callback: Callable[[dict], Any] | None = None) -> TrainingHistory:
    """Runs `num_steps` more steps (None: up to `total_steps`, and never past it); returns their
    metrics. With a run folder a preemption signal stops early after a checkpoint; `preempted`
    (here and on the returned history) then names the signal."""
    target = (self.total_steps if num_steps is None
              else min(self.total_steps, self.step_count + num_steps))
    history = self.run.train(target, callback=callback)
    self.preempted = history.preempted
    return history

  def close(self) -> None:
    """Flushes the logs, waits for the last checkpoint and closes the run folder. Idempotent;
    the trainer can still train afterwards, without logging or checkpointing."""
    self.run.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


__all__ = ["RunStage"]
