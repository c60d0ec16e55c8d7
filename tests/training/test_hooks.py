"""Tests of `RunLoop`'s hooks (jax_ppo.training.hooks.LoopHook) on a stage with a trivial step:
each hook sees every step's metrics and may add to them, its collapse triggers the rollback, its
state travels in the checkpoint's extra; a stage without hooks never rolls back."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.toy_stage import ToyStage


@dataclasses.dataclass(frozen=True)
class _Collapse:
  step: int
  kind: str = "toy_collapse"
  message: str = "the toy collapsed"


class _Hook:
  """Counts the steps it saw; reports a collapse at `collapse_at` (once)."""

  name = "toy_hook"

  def __init__(self, collapse_at: int | None = None):
    self.seen: list[int] = []
    self.collapse_at = collapse_at
    self.pending: _Collapse | None = None
    self.rollbacks: list[int] = []
    self.loaded: list = []

  def after_step(self, step, metrics):
    self.seen.append(step)
    metrics["toy/seen"] = float(len(self.seen))
    if step == self.collapse_at and not self.rollbacks:
      self.pending = _Collapse(step)

  def collapse(self):
    return self.pending

  def clear_collapse(self):
    self.pending = None

  def rolled_back(self, step):
    self.rollbacks.append(step)
    self.seen = [s for s in self.seen if s <= step]
    self.pending = None

  def state_dict(self):
    return {"seen": list(self.seen)}

  def load_state_dict(self, state):
    self.loaded.append(state)
    self.seen = list(state["seen"])


def test_a_hook_adds_metrics_triggers_the_rollback_and_resumes_with_its_state(tmp_path):
  hook = _Hook(collapse_at=5)
  with ToyStage(tmp_path, hooks=(hook,), rollback=True) as stage:
    history = stage.train(6)
  assert [m["toy/seen"] for m in history][:4] == [1.0, 2.0, 3.0, 4.0]
  rolled = [m for m in history if "rollback/to_step" in m]
  assert len(rolled) == 1 and rolled[0]["rollback/to_step"] == 4.0
  assert hook.rollbacks == [4] and float(stage.state.lr_scale) == 0.5
  logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert all("toy/seen" in r for r in logged)

  again = _Hook()
  resumed = ToyStage(tmp_path, hooks=(again,))
  assert again.loaded == [hook.state_dict()]  # the hook's state came back from the checkpoint
  resumed.close()


def test_a_stage_without_hooks_never_rolls_back(tmp_path):
  with ToyStage(tmp_path, rollback=True) as stage:
    history = stage.train(6)
  assert [int(m["w"]) for m in history] == [1, 2, 3, 4, 5, 6]
  assert not any("rollback/to_step" in m or "toy/seen" in m for m in history)


def test_hooks_need_distinct_names_apart_from_the_loops_own_keys(tmp_path):
  with pytest.raises(ValueError, match="distinct names"):
    ToyStage(None, hooks=(_Hook(), _Hook()))
  named = _Hook()
  named.name = "rollbacks"
  with pytest.raises(ValueError, match="distinct names"):
    ToyStage(None, hooks=(named,))
