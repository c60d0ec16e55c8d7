"""The run loop a trainer shares with every other training stage: run folder, logs, checkpoints,
the stage's hooks, rollback, preemption and the stop after repeated non-finite updates.

A trainer (a `Stage`: PPO today; SFT and reward-model training share it) owns its state and its
`step()`; `RunLoop` owns everything around the steps:

* with a run folder (`run_dir`): `config.yaml` (the run's configuration, checked against the
  checkpoints' when resuming), `MetricsLogger` (`metrics.jsonl`, `samples.jsonl`, TensorBoard),
  a tqdm progress bar, `RunCheckpointer` saves (`run_dir/checkpoints`, every
  `RunOptions.save_every` steps and at the end of `train()`), the stage's hooks (`LoopHook`)
  and rollback on a collapse a hook reports (`RunOptions.rollback`);
* preemption: while `train()` runs in the main thread with a run folder, SIGTERM and SIGINT are
  caught; the step in flight finishes (or, when the stage checks `stop_requested` between its
  phases, is abandoned before it changes any state), a checkpoint is written, and `train()`
  returns a `TrainingHistory` whose `preempted` names the signal. Further signals while the
  checkpoint is being written are ignored (Orbax commits a step atomically anyway). The previous
  handlers are restored when `train()` returns. With several processes (multi-host) JAX's
  preemption service catches SIGTERM instead and every process stops at the same step
  (`jax_ppo.parallel.distributed.preemption_notice`); only process 0 writes logs and plots;
* non-finite updates: a stage reports optimizer steps it skipped in its `skipped_updates`
  metric; after `max_consecutive_skips` consecutive steps with skips the run stops with
  `NonFiniteUpdates`, naming likely causes and the last checkpoint before the skips began.

Hooks (`jax_ppo.training.hooks`): a stage's hooks see every step's metrics, may add to them
and may report a collapse that triggers the rollback; their state travels in the checkpoints.

Resuming: a run folder that holds checkpoints restores the latest one (through
`Stage.restore_checkpoint`), the hooks' state and the rollback count, and truncates the logs
after that step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import pathlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from jax_ppo.checkpoint import CheckpointCorrupt, RunCheckpointer, check_config
from jax_ppo.config_io import CONFIG_FILENAME, config_to_dict, read_config_file, save_config
from jax_ppo.logging import MetricsLogger
from jax_ppo.parallel.distributed import (
  check_shared_folder,
  is_main_process,
  multi_process,
  preemption_notice,
)
from jax_ppo.training.hooks import Collapse, LoopHook

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
"""Sub-folder of a run folder that holds the checkpoints."""

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""Signals that stop `train()` cleanly (checkpoint, then return) while it runs."""

SKIPPED_METRIC = "skipped_updates"
"""Metric in which a stage counts the optimizer steps it skipped (non-finite loss/gradient)."""


class RunCollapsed(RuntimeError):
  """Training collapsed again after `RunOptions.max_rollbacks` rollbacks."""


class NonFiniteUpdates(RunCollapsed):
  """Optimizer steps were skipped (non-finite loss or gradient) in too many consecutive steps."""


class StepAbandoned(Exception):
  """Raised by `Stage.step` when it sees `RunLoop.stop_requested` before changing any state."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunOptions:
  """How a trainer with a `run_dir` logs, checkpoints and rolls back."""

  save_every: int = 10
  """Save a checkpoint every this many updates (and always at the end of `train()`)."""
  keep_last: int = 3
  """Number of most recent checkpoints kept."""
  best_metric: str | None = None
  """Also keep the checkpoint with the best value of this metric (e.g. "objective/scores")."""
  best_mode: str = "max"
  """"max" or "min": what "best" means for `best_metric`."""
  log_samples_every: int = 10
  """Write samples of the rollout to `samples.jsonl` every this many updates (0: never)."""
  samples_per_log: int = 4
  """Samples written each time."""
  tensorboard: bool = True
  """Write TensorBoard events under `run_dir/tensorboard`."""
  wandb: bool = False
  """Also log metrics to Weights & Biases (`MetricsLogger(wandb=True)`; needs `wandb`)."""
  wandb_init: dict[str, Any] | None = None
  """Keyword arguments of `wandb.init` (project, name, entity...). The run folder keeps its W&B
  run's id (`run_dir/wandb_run_id`) and a resumed run continues that W&B run, unless these give
  `id` or `resume` (`MetricsLogger`)."""
  plots: bool = True
  """Write PNG plots of `metrics.jsonl` into `run_dir/plots` at the end of `train()`
  (`jax_ppo.logging.plots`; skipped with a warning without matplotlib)."""
  progress: bool = True
  """Show a tqdm progress bar with the stage's main metrics (PPO: the reward and the KL)."""
  async_checkpointing: bool = True
  """Write checkpoint files on a background thread (Orbax async)."""
  rollback: bool = False
  """On a collapse reported by a hook of the stage (PPO's stability monitor), restore the last
  checkpoint before it, scale the learning rate by `rollback_lr_factor` and continue. Stages
  without hooks never collapse."""
  rollback_lr_factor: float = 0.5
  """Multiplier of `TrainState.lr_scale` at each rollback."""
  max_rollbacks: int = 3
  """A collapse after this many rollbacks stops training with `RunCollapsed`."""
  resume_ignore: tuple[str, ...] = ()
  """Dotted keys of the run configuration that may differ from the checkpoints' when resuming
  (operational settings such as logging intervals); every other difference is an error."""

  def __post_init__(self):
    def bad(field: str, fix: str):
      raise ValueError(f"RunOptions.{field}={getattr(self, field)!r} is invalid: {fix}.")

    for field, low in (("save_every", 1), ("keep_last", 1), ("log_samples_every", 0),
                       ("samples_per_log", 1), ("max_rollbacks", 0)):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        bad(field, f"use an int >= {low}")
    for field in ("wandb", "plots"):
      if not isinstance(getattr(self, field), bool):
        bad(field, "use True or False")
    if self.wandb_init is not None and not isinstance(self.wandb_init, dict):
      bad("wandb_init", "give a dict of wandb.init keyword arguments or None")
    if self.best_mode not in ("max", "min"):
      bad("best_mode", "use 'max' or 'min'")
    if self.best_metric is not None and not (isinstance(self.best_metric, str)
                                             and self.best_metric):
      bad("best_metric", "give a metric name (e.g. 'objective/scores') or None")
    if not 0 < self.rollback_lr_factor <= 1:
      bad("rollback_lr_factor", "use a factor in (0, 1]")


class Stage(Protocol):
  """What a trainer gives `RunLoop`.

  `state` is the pytree of arrays that is checkpointed; `step()` runs one step and returns its
  metrics (host floats, with a `skipped_updates` count of skipped optimizer steps when the stage
  skips non-finite ones); `checkpoint_extra()` is the JSON the stage needs besides `state`, and
  `checkpoint_arrays()` further pytrees of arrays (e.g. a replay buffer) saved beside it;
  `restore_checkpoint(checkpointer, step)` restores all of them (None: the latest) and returns
  the checkpoint's extra; `scale_learning_rate(factor)` multiplies the learning-rate scale (a
  rollback) and returns the new scale; `samples(limit=n)` gives `{prompt, response, reward}`
  records of the last step (or []).
  """

  state: Any

  @property
  def step_count(self) -> int: ...

  def step(self) -> dict[str, float]: ...

  def samples(self, *, limit: int) -> list[dict[str, Any]]: ...

  def checkpoint_extra(self) -> dict[str, Any]: ...

  def checkpoint_arrays(self) -> dict[str, Any]: ...

  def restore_checkpoint(self, checkpointer: RunCheckpointer, step: int | None) -> dict: ...

  def scale_learning_rate(self, factor: float) -> float: ...


class TrainingHistory(list):
  """The metrics of every step `train()` ran (a list), and how the call ended.

  Attributes:
    preempted: the name of the signal ("SIGTERM", "SIGINT") that stopped the call after a
      checkpoint was written, or None when it ran to its target.
  """

  preempted: str | None = None


class RunLoop:
  """Runs a `Stage`'s steps with the bookkeeping of its run folder (see the module docstring).

  Args:
    stage: the trainer.
    run_dir: the run folder, or None: then `train()` only runs the steps (and still stops after
      `max_consecutive_skips`), without logs, checkpoints, hooks or signal handling.
    options: `RunOptions`.
    run_config: the dataclass written to `config.yaml` and stored with every checkpoint.
    total_steps: the run's length (the progress bar's total).
    max_consecutive_skips: consecutive steps with skipped optimizer steps before
      `NonFiniteUpdates` (None: never stop).
    progress_metrics: `(label, metric name)` pairs shown in the progress bar's postfix.
    progress_desc: the progress bar's label (the stage's name).
    hooks: the stage's `LoopHook`s (distinct `name`s), run after every step with a run folder.

  Raises (before writing anything): `CheckpointConfigMismatch` when the folder holds a run of
  another configuration, `CheckpointError` when its latest checkpoint cannot be read.
  """

  def __init__(
      self,
      stage: Stage,
      run_dir: str | pathlib.Path | None,
      *,
      options: RunOptions,
      run_config: Any,
      total_steps: int,
      max_consecutive_skips: int | None = None,
      progress_metrics: tuple[tuple[str, str], ...] = (
          ("reward", "objective/scores"), ("kl", "objective/kl")),
      progress_desc: str = "train",
      hooks: tuple[LoopHook, ...] = (),
  ):
    names = [h.name for h in hooks]
    if len(set(names)) != len(names) or {"rollbacks", "consecutive_skips",
                                         "skips_since"} & set(names):
      raise ValueError(f"RunLoop hooks need distinct names other than the loop's own checkpoint "
                       f"keys; got {names}.")
    self.hooks = tuple(hooks)
    self.stage = stage
    self.progress_metrics = tuple(progress_metrics)
    self.progress_desc = progress_desc
    self.options = options
    self.run_config = run_config
    self.total_steps = total_steps
    self.max_consecutive_skips = max_consecutive_skips
    self.run_dir: pathlib.Path | None = None
    self.checkpointer: RunCheckpointer | None = None
    self.logger: MetricsLogger | None = None
    self.bar = None
    self.rollbacks = 0
    self.consecutive_skips = 0
    self.skips_since: int | None = None
    self._signal: int | None = None
    self._signals_seen = 0
    if run_dir is not None:
      self._open(pathlib.Path(run_dir))

  # -- run folder -----------------------------------------------------------------------------

  def _open(self, run_dir: pathlib.Path) -> None:
    opts = self.options
    if not dataclasses.is_dataclass(self.run_config) or isinstance(self.run_config, type):
      raise ValueError(
          f"run_config must be a dataclass instance (it is written to config.yaml), got "
          f"{type(self.run_config).__name__}."
      )
    # (several processes: one folder that every process sees, or checkpoints nobody can restore)
    check_shared_folder(run_dir, field=f"{type(self.run_config).__name__}.run_dir")
    checkpointer = RunCheckpointer(
        run_dir / CHECKPOINT_DIR, save_every=opts.save_every, keep_last=opts.keep_last,
        best_metric=opts.best_metric, best_mode=opts.best_mode, config=self.run_config,
        config_ignore=opts.resume_ignore, async_save=opts.async_checkpointing,
    )
    start = 0
    try:
      config_file = run_dir / CONFIG_FILENAME
      if checkpointer.latest_step() is None and config_file.is_file():
        # A run that stopped before its first checkpoint: its logs belong to that config.
        check_config(read_config_file(config_file), config_to_dict(self.run_config),
                     ignore=opts.resume_ignore, where=f"{str(run_dir)!r} ({CONFIG_FILENAME})",
                     config_type=type(self.run_config))
      if checkpointer.latest_step() is not None:
        start = self.restore(checkpointer, None)
        logger.info("Resumed %s from step %d.", run_dir, start)
    except BaseException:
      checkpointer.close()
      raise
    self.checkpointer = checkpointer
    self.run_dir = run_dir
    if is_main_process():
      save_config(self.run_config, run_dir)
    self.logger = MetricsLogger(
        run_dir, tensorboard=opts.tensorboard, progress=False, truncate_after_step=start,
        wandb=opts.wandb, wandb_init=opts.wandb_init, config=config_to_dict(self.run_config),
    )
    if opts.progress and is_main_process():
      import tqdm

      self.bar = tqdm.tqdm(total=self.total_steps, initial=start, desc=self.progress_desc,
                           unit="update")

  def restore(self, checkpointer: RunCheckpointer, step: int | None, *,
              hooks: bool = True) -> int:
    """Restores the stage (and, with `hooks`, the hooks' state and the loop's counters);
    returns the step."""
    extra = self.stage.restore_checkpoint(checkpointer, step)
    if hooks:
      for hook in self.hooks:
        if extra.get(hook.name) is not None:
          hook.load_state_dict(extra[hook.name])
      self.rollbacks = int(extra.get("rollbacks", 0))
      self.consecutive_skips = int(extra.get("consecutive_skips", 0))
      since = extra.get("skips_since")
      self.skips_since = None if since is None else int(since)
    return self.stage.step_count

  def checkpoint_extra(self) -> dict[str, Any]:
    """What a checkpoint stores besides the state (JSON): the stage's, then the loop's."""
    return {
        **self.stage.checkpoint_extra(),
        **{hook.name: hook.state_dict() for hook in self.hooks},
        "rollbacks": self.rollbacks,
        "consecutive_skips": self.consecutive_skips,
        "skips_since": self.skips_since,
    }

  def save(self, step: int, metrics: dict[str, float], *, force: bool) -> None:
    """Saves the stage's state, extra and arrays (every `save_every` steps, or now)."""
    save = self.checkpointer.save if force else self.checkpointer.maybe_save
    save(step, self.stage.state, metrics, self.checkpoint_extra(),
         arrays=self.stage.checkpoint_arrays())

  def record(self, metrics: dict[str, float]) -> dict[str, float]:
    """Hooks, rollback, logs, checkpoint and progress bar after one step."""
    opts = self.options
    step = self.stage.step_count
    for hook in self.hooks:
      hook.after_step(step, metrics)
    samples = []
    if opts.log_samples_every and step % opts.log_samples_every == 0:
      samples = self.stage.samples(limit=opts.samples_per_log)  # before a rollback forgets them
    collapsed = self._collapsed() if opts.rollback else None
    if collapsed is not None:
      metrics.update(self._rollback(step, *collapsed))
    self.logger.log(step, metrics)
    if samples:
      self.logger.log_samples(
          step, [r["prompt"] for r in samples], [r["response"] for r in samples],
          [r["reward"] for r in samples],
      )
    if collapsed is None:
      self.save(step, metrics, force=False)
    if self.bar is not None:
      self.bar.n = self.stage.step_count
      shown = {k: metrics[v] for k, v in self.progress_metrics
               if v in metrics and math.isfinite(metrics[v])}
      self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
      self.bar.refresh()
    return metrics

  def _collapsed(self) -> tuple[LoopHook, Collapse] | None:
    """The first hook that reports a collapse, and its report (None: no collapse)."""
    for hook in self.hooks:
      reason = hook.collapse()
      if reason is not None:
        return hook, reason
    return None

  def _rollback(self, step: int, hook: LoopHook, reason: Collapse) -> dict[str, float]:
    """Restores the latest checkpoint before the collapse and lowers the learning rate."""
    opts = self.options
    if self.rollbacks >= opts.max_rollbacks:
      self.logger.log(step, {"rollback/count": float(self.rollbacks)})
      run_dir = self.run_dir
      self.close()
      raise RunCollapsed(
          f"The run collapsed at step {step} ({reason.kind}: {reason.message}) after "
          f"{self.rollbacks} rollbacks (RunOptions.max_rollbacks={opts.max_rollbacks}). Lower "
          "learning_rate, raise kl_coef or check the reward; the checkpoints in "
          f"{str(run_dir)!r} are kept."
      )
    self.checkpointer.wait()
    good = [s for s in self.checkpointer.steps() if s < reason.step]
    if not good:
      logger.error("Step %d: collapse (%s) but no checkpoint before it; continuing without "
                   "rollback.", step, reason.kind)
      hook.clear_collapse()
      return {}
    damaged = []
    for target in reversed(good):  # a damaged checkpoint gives way to the one before it
      try:
        self.restore(self.checkpointer, target, hooks=False)
        break
      except CheckpointCorrupt as e:
        logger.warning("Step %d: rollback skips damaged checkpoint %d: %s", step, target, e)
        damaged.append(e)
    else:
      logger.error("Step %d: collapse (%s) but every checkpoint before it is damaged; "
                   "continuing without rollback.", step, reason.kind)
      hook.clear_collapse()
      return {}
    if damaged:  # moved into corrupt/ (never deleted) so that their steps can be saved again
      self.checkpointer.set_aside(damaged, target)
    scale = self.stage.scale_learning_rate(opts.rollback_lr_factor)
    for each in self.hooks:
      each.rolled_back(target)
    self.rollbacks += 1
    logger.warning(
        "Step %d: collapse (%s); rolled back to the checkpoint of step %d with lr_scale %.4g "
        "(rollback %d of at most %d).", step, reason.kind, target, scale, self.rollbacks,
        opts.max_rollbacks,
    )
    return {"rollback/to_step": float(target), "rollback/lr_scale": scale,
            "rollback/count": float(self.rollbacks)}

  # -- non-finite updates ---------------------------------------------------------------------

  def _check_skips(self, metrics: dict[str, float]) -> None:
    """Counts consecutive steps with skipped optimizer steps; raises `NonFiniteUpdates` after
    `max_consecutive_skips` of them."""
    skipped = metrics.get(SKIPPED_METRIC, 0.0)
    step = self.stage.step_count
    if not skipped:
      self.consecutive_skips, self.skips_since = 0, None
      return
    if self.consecutive_skips == 0:
      self.skips_since = step
    self.consecutive_skips += 1
    logger.warning("Step %d: %d optimizer step(s) skipped (non-finite loss or gradient); "
                   "%d consecutive step(s) with skips.", step, int(skipped),
                   self.consecutive_skips)
    limit = self.max_consecutive_skips
    if limit is None or self.consecutive_skips < limit:
      return
    where = "There is no run folder, so no checkpoint."
    if self.checkpointer is not None:
      self.checkpointer.wait()
      good = [s for s in self.checkpointer.steps() if s < self.skips_since]
      ckpt = self.run_dir / CHECKPOINT_DIR
      where = (f"The last checkpoint before the skips began is step {good[-1]} in "
               f"{str(ckpt)!r}." if good else
               f"No checkpoint in {str(ckpt)!r} predates the skips (they began at step "
               f"{self.skips_since}).")
    self.close()
    raise NonFiniteUpdates(
        f"Steps {self.skips_since} to {step}: {self.consecutive_skips} consecutive steps "
        f"skipped optimizer steps whose loss or gradient was NaN or infinite "
        f"(max_consecutive_skips={limit}); the parameters were left unchanged, but training "
        "cannot progress. Likely causes: a learning rate too high (lower learning_rate), "
        "rewards on a large scale (set reward_scale/reward_clip or whiten them), float16/"
        "bfloat16 overflow (train in float32), or NaN in the inputs or the reward model's "
        f"scores. {where}"
    )

  # -- preemption -----------------------------------------------------------------------------

  @property
  def stop_requested(self) -> bool:
    """Whether a preemption signal arrived during this `train()` call."""
    return self._signal is not None

  def _on_signal(self, signum: int, frame: Any) -> None:
    del frame
    self._signals_seen += 1
    if self._signal is None:
      self._signal = signum

  @contextlib.contextmanager
  def _preemption_handlers(self) -> Iterator[None]:
    """Catches SIGTERM/SIGINT (main thread, run folder only); restores the old handlers."""
    self._signal, self._signals_seen = None, 0
    if (self.checkpointer is None or threading.current_thread() is not threading.main_thread()
        or multi_process()):  # (several processes: JAX's preemption service has SIGTERM)
      yield
      return
    previous = {s: signal.signal(s, self._on_signal) for s in PREEMPTION_SIGNALS}
    try:
      yield
    finally:
      for s, handler in previous.items():
        signal.signal(s, handler)

  # -- the loop -------------------------------------------------------------------------------

  def train(
      self, target: int, *, callback: Callable[[dict], Any] | None = None
  ) -> TrainingHistory:
    """Runs steps until `stage.step_count` reaches `target` or a preemption signal arrives.

    With a run folder every step goes through the hooks, is logged and checkpointed, and the
    last step is
    saved before returning; `callback(metrics)` runs after that bookkeeping.
    """
    history = TrainingHistory()
    metrics: dict[str, float] = {}
    with self._preemption_handlers():
      while self.stage.step_count < target and not self.stop_requested:
        if self.checkpointer is not None and (notice := preemption_notice(self.stage.step_count)):
          self._signal = notice  # every process stops at this same step
          break
        try:
          metrics = self.stage.step()
        except StepAbandoned:
          break
        if self.checkpointer is not None:
          metrics = self.record(metrics)
        history.append(metrics)
        self._check_skips(metrics)
        if callback is not None:
          callback(metrics)
      if self.checkpointer is not None:
        if history:
          self.save(self.stage.step_count, metrics, force=True)
        self.checkpointer.wait()
        self.logger.flush()
        if self.options.plots and is_main_process():
          self._write_plots()
      if self.stop_requested:
        history.preempted = signal.Signals(self._signal).name
        logger.warning(
            "%s received: stopped after step %d%s.", history.preempted, self.stage.step_count,
            "" if self.run_dir is None else
            f"; the checkpoint is in {str(self.run_dir / CHECKPOINT_DIR)!r}",
        )
    return history

  def _write_plots(self) -> None:
    """PNG plots of the run so far; a failure is a warning, never the end of a run."""
    from jax_ppo.logging.plots import write_plots

    try:
      write_plots(self.run_dir)
    except ImportError as e:
      logger.warning("No plots written: %s", e)
    except Exception as e:  # noqa: BLE001 - plots are a by-product; training results are saved.
      logger.warning("Writing plots into %s failed: %s: %s", self.run_dir, type(e).__name__, e)

  def close(self) -> None:
    """Flushes the logs, waits for the last checkpoint and closes the run folder. Idempotent."""
    checkpointer, self.checkpointer = self.checkpointer, None
    run_logger, self.logger = self.logger, None
    bar, self.bar = self.bar, None
    if checkpointer is not None:
      checkpointer.close()
    if run_logger is not None:
      run_logger.close()
    if bar is not None:
      bar.close()


__all__ = [
    "CHECKPOINT_DIR",
    "NonFiniteUpdates",
    "RunCollapsed",
    "RunLoop",
    "RunOptions",
    "Stage",
    "StepAbandoned",
    "TrainingHistory",
]
