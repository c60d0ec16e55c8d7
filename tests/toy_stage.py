"""A toy stage on the run loop, for the loop's own tests (hooks, W&B resume): its step adds the
learning-rate scale to one parameter, `w`, and returns `{"w": w}`; its checkpoints carry the
stage mark "toy"."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_ppo.training.loop import RunLoop, RunOptions
from jax_ppo.training.stage import RunStage
from jax_ppo.training.state import StageState


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyConfig:
  """The toy run's configuration (written to `config.yaml`)."""

  name: str = "toy"


class ToyStage(RunStage):
  """`total_steps` steps on `run_dir` (None: no run folder), with `hooks`; `options` are
  `RunOptions` fields over the toy's defaults (a checkpoint every 2 steps, written at once; no
  progress bar, TensorBoard or plots)."""

  CHECKPOINT_STAGE = "toy"

  def __init__(self, run_dir, *, total_steps: int = 8, hooks=(), **options):
    self.state = StageState(params={"w": jnp.zeros(())}, opt_state=(),
                            step=jnp.zeros((), jnp.int32), lr_scale=jnp.ones((), jnp.float32))
    self.total_steps = total_steps
    defaults = dict(save_every=2, progress=False, tensorboard=False, plots=False,
                    async_checkpointing=False)
    self.run = RunLoop(self, run_dir, run_config=ToyConfig(), total_steps=total_steps,
                       hooks=hooks, options=RunOptions(**{**defaults, **options}))

  def step(self):
    w = self.state.params["w"] + self.state.lr_scale
    self.state = self.state.replace(params={"w": w}, step=self.state.step + 1)
    return {"w": float(w)}
