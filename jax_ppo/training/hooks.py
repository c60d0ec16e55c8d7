"""The hooks a stage installs on its run loop (`jax_ppo.training.loop.RunLoop(hooks=...)`).

A hook sees every step's metrics after the step (with a run folder), may add metrics to them
(warnings, counts), and may report that the run has collapsed: with `RunOptions.rollback` the
loop then restores the latest checkpoint before the collapse, lowers the learning rate and
continues. Its state is saved in each checkpoint's extra under its `name` and restored when the
run resumes (not when it rolls back: `rolled_back(step)` tells it instead).

PPO installs its stability monitor as a hook (`jax_ppo.ppo.monitor.StabilityMonitor`); SFT and
the reward model install none, so they have no collapse detection (the non-finite stop applies
to every stage).
"""

from __future__ import annotations

from typing import Any, Protocol


class Collapse(Protocol):
  """What a hook reports when the run has collapsed."""

  step: int
  """The step at which the collapse began (a rollback restores a checkpoint before it)."""
  kind: str
  """A short name of what collapsed (e.g. "reward_collapse")."""
  message: str
  """What was seen and the usual fix."""


class LoopHook(Protocol):
  """A stage's hook on `RunLoop` (e.g. PPO's stability monitor).

  `name` is the key of its `state_dict()` (JSON) in each checkpoint's extra;
  `after_step(step, metrics)` runs after every step with a run folder and may add metrics
  (host floats) to `metrics` in place; `collapse()` is the collapse it reports (None: none):
  with `RunOptions.rollback` the loop then restores the latest checkpoint before
  `collapse().step`, calls `clear_collapse()` when it cannot, and `rolled_back(step)` when it
  did (the hook forgets what it saw after `step`).
  """

  name: str

  def after_step(self, step: int, metrics: dict[str, float]) -> None: ...

  def collapse(self) -> Collapse | None: ...

  def clear_collapse(self) -> None: ...

  def rolled_back(self, step: int) -> None: ...

  def state_dict(self) -> Any: ...

  def load_state_dict(self, state: Any) -> None: ...


__all__ = ["Collapse", "LoopHook"]
