"""`RunCheckpointer`: periodic, asynchronous, resumable checkpoints of a training run (Orbax).

One checkpoint per saved step, under `directory/<step>/`, with two or three Orbax items:

* `state`: the `TrainState` pytree (any pytree of arrays), written by Orbax's
  `StandardCheckpointHandler` and restored against the abstract shape of a live state, so dtypes
  and shardings come back as they are in the running program;
* `meta`: a JSON object `{"format", "step", "config", "extra"}`: the run's configuration as a
  plain dict (`jax_ppo.config_io.config_to_dict`), and whatever the trainer needs besides the
  arrays (data position, monitor state, host step...);
* `arrays` (only when `save(..., arrays=...)` gives some): further pytrees of arrays stored
  beside the state (e.g. a replay buffer whose shapes vary), read back with `restore_arrays`.

Saving, retention and asynchrony are Orbax's (`CheckpointManager`): a `FixedIntervalPolicy`
decides which steps are saved, `LatestN` + `BestN` which are kept (the last `keep_last` and the
best one by `best_metric`), and saves return once the arrays are copied off the device, the
files being written on a background thread (`wait()` blocks until they are committed). A save
that crashed half way is never listed: Orbax commits a step atomically.

Opening a directory that holds checkpoints of a run with another configuration raises a
`CheckpointConfigMismatch` naming the differing fields; nothing is deleted or overwritten.

Restoring checks a step before Orbax reads its arrays: the saved array metadata must list the
same parameter paths, shapes and dtypes as the live state (else `CheckpointStructureMismatch`,
naming each differing path with its saved and expected shape), and every item must be present
and readable (else `CheckpointCorrupt`, naming the step, the file or array and why). Restoring
the latest step falls back to the newest earlier step that reads, with a warning naming each
damaged step; the damaged folders are moved (never deleted) into `directory/corrupt/` so that
the resumed run can save those steps again. A save killed half way leaves only an uncommitted
`<step>.orbax-checkpoint-tmp*` folder, which Orbax never lists as a step (and replaces when
that step is saved again).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jax_ppo.checkpoint.errors import (
  CheckpointCorrupt,
  CheckpointError,
  CheckpointStructureMismatch,
  check_config,
  plain_config,
)
from jax_ppo.checkpoint.integrity import (
  ARRAY_KEY,
  abstract_like,
  error_summary,
  expected_specs,
  has_json_error,
  orbax_reads_drained,
  structure_differences,
  unparsable_json_files,
)
from jax_ppo.parallel.distributed import barrier, is_main_process

logger = logging.getLogger("jax_ppo.checkpoint")

BEST_MODES = ("max", "min")
FORMAT_VERSION = 1
STATE_ITEM = "state"
META_ITEM = "meta"
CORRUPT_DIR = "corrupt"
"""Sub-folder of the checkpoint directory that damaged step folders are moved into."""
ARRAYS_ITEM = "arrays"


def _finite_scalars(metrics: Mapping[str, Any] | None) -> dict[str, float]:
  """The finite scalar entries of a metrics dict, as Python floats (JSON-safe)."""
  out = {}
  for key, value in (metrics or {}).items():
    if isinstance(value, str | bytes):
      continue
    try:
      number = float(value)
    except (TypeError, ValueError):
      continue
    if math.isfinite(number):
      out[str(key)] = number
  return out


def _metric_getter(name: str, mode: str) -> Callable[[Any], float]:
  """Orbax `best_fn`: the named metric, or the worst possible value when absent or not finite."""
  worst = -math.inf if mode == "max" else math.inf

  def get(metrics: Any) -> float:
    value = metrics.get(name) if isinstance(metrics, Mapping) else None
    try:
      value = float(value)
    except (TypeError, ValueError):
      return worst
    return value if math.isfinite(value) else worst

  return get


class RunCheckpointer:
  """Saves a run's state every `save_every` steps; keeps the last `keep_last` and the best.

  Example::

    ckpt = RunCheckpointer(run_dir / "checkpoints", save_every=10, keep_last=3,
                           best_metric="objective/scores", config=config)
    if ckpt.latest_step() is not None:
      state, extra = ckpt.restore(like=state)
    for step in range(...):
      state, metrics = update(state)
      ckpt.maybe_save(step, state, metrics=metrics, extra={"data_position": pos})
    ckpt.close()

  Args:
    directory: folder of the checkpoints (created unless `read_only`).
    save_every: `maybe_save` saves steps that are multiples of this.
    keep_last: number of most recent checkpoints kept.
    best_metric: metric name whose best checkpoint is kept besides the last ones (None: only
      the last ones are kept).
    best_mode: "max" or "min": what "best" means for `best_metric`.
    config: the run's configuration (a dataclass or a plain mapping), stored with every
      checkpoint. When given and the directory already holds checkpoints, the latest one's
      configuration must match (see `config_ignore`), else `CheckpointConfigMismatch`.
    config_ignore: dotted config keys (or prefixes) allowed to differ between the saved and the
      current configuration (e.g. logging or checkpoint-frequency settings).
    async_save: write files on a background thread (Orbax async checkpointing).
    read_only: open existing checkpoints for restoring only (never writes or deletes).

  Raises:
    ValueError: invalid arguments (naming the argument).
    CheckpointConfigMismatch: the directory holds checkpoints of another configuration.
    CheckpointError: `read_only` and the directory does not exist.
  """

  def __init__(
      self,
      directory: str | os.PathLike,
      *,
      save_every: int = 1,
      keep_last: int = 3,
      best_metric: str | None = None,
      best_mode: str = "max",
      config: Any = None,
      config_ignore: Sequence[str] = (),
      async_save: bool = True,
      read_only: bool = False,
  ):
    for name, value in (("save_every", save_every), ("keep_last", keep_last)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"RunCheckpointer {name}={value!r} is invalid: use an int >= 1.")
    if best_mode not in BEST_MODES:
      raise ValueError(f"RunCheckpointer best_mode={best_mode!r} is invalid: use one of "
                       f"{BEST_MODES}.")
    if best_metric is not None and (not isinstance(best_metric, str) or not best_metric):
      raise ValueError(f"RunCheckpointer best_metric={best_metric!r} is invalid: give a metric "
                       "name or None.")
    self.directory = pathlib.Path(directory).absolute()
    if read_only and not self.directory.is_dir():
      raise CheckpointError(
          f"No checkpoint directory {str(self.directory)!r}; train first, or pass the run folder "
          "that holds it."
      )
    self.save_every = save_every
    self.keep_last = keep_last
    self.best_metric = best_metric
    self.best_mode = best_mode
    self.config = plain_config(config)
    self._config_type = type(config) if dataclasses.is_dataclass(config) else None
    self.config_ignore = tuple(config_ignore)
    self.read_only = read_only

    keep: list[Any] = [policies.LatestN(n=keep_last)]
    best_fn = None
    if best_metric is not None:
      best_fn = _metric_getter(best_metric, best_mode)
      keep.append(policies.BestN(get_metric_fn=best_fn, reverse=best_mode == "min", n=1))
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.AnySavePolicy([
            policies.FixedIntervalPolicy(save_every),
            policies.PreemptionCheckpointingPolicy(),
        ]),
        preservation_policy=policies.AnyPreservationPolicy(keep),
        save_interval_steps=0 if read_only else 1,  # (the decision policy decides)
        best_fn=best_fn,
        best_mode=best_mode,
        enable_async_checkpointing=async_save,
        create=not read_only,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,
    )
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=options,
        item_handlers={
            STATE_ITEM: ocp.StandardCheckpointHandler(),
            META_ITEM: ocp.JsonCheckpointHandler(),
            ARRAYS_ITEM: ocp.StandardCheckpointHandler(),
        },
    )
    if self.config is not None:
      self._check_newest_config()

  # ---- queries ---------------------------------------------------------------------------------

  def steps(self) -> list[int]:
    """Steps of the committed checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The most recent committed step, or None."""
    return self._manager.latest_step()

  def best_step(self) -> int | None:
    """The kept step with the best `best_metric` (None without `best_metric` or checkpoints)."""
    if self.best_metric is None:
      return None
    return self._manager.best_step()

  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON metadata `{"format", "step", "config", "extra"}` of a step.

    Raises:
      CheckpointError: the step does not exist.
      CheckpointCorrupt: its metadata item is missing or cannot be read.
    """
    self._check_step(step)
    folder = self._step_dir(step) / META_ITEM
    if not folder.is_dir():
      raise self._damaged(step, folder, "the item folder is missing (a partial copy or save?)")
    try:
      with orbax_reads_drained():
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            META_ITEM: ocp.args.JsonRestore()
        }))
      meta = restored[META_ITEM]
    except Exception as e:  # Orbax raises many types for unreadable files.
      raise self._damaged(step, folder, e) from e
    if not isinstance(meta, Mapping) or "extra" not in meta:
      raise self._damaged(step, folder, f"the metadata is {meta!r}, not a dict with 'extra'")
    return dict(meta)

  # ---- saving ----------------------------------------------------------------------------------

  def maybe_save(
      self,
      step: int,
      state: Any,
      metrics: Mapping[str, Any] | None = None,
      extra: Mapping[str, Any] | None = None,
      *,
      arrays: Mapping[str, Any] | None = None,
  ) -> bool:
    """Saves when `step` is a multiple of `save_every` (and newer than the latest checkpoint).

    Args:
      step: the training step the state belongs to.
      state: pytree of arrays (e.g. `TrainState`). Its buffers are copied before this returns,
        so it may be donated to the next jitted step at once.
      metrics: this step's metrics; finite scalars are stored with the checkpoint and rank it
        for `best_metric`.
      extra: JSON-serialisable dict restored with the state (data position, monitor...).
      arrays: further pytrees of arrays stored beside the state (e.g. a replay buffer), read
        back with `restore_arrays`; None or {}: none.

    Returns:
      True when a checkpoint was started.
    """
    return self._save(step, state, metrics, extra, arrays, force=False)

  def save(
      self,
      step: int,
      state: Any,
      metrics: Mapping[str, Any] | None = None,
      extra: Mapping[str, Any] | None = None,
      *,
      arrays: Mapping[str, Any] | None = None,
  ) -> bool:
    """Saves `step` regardless of `save_every` (no-op, False, when it is already saved)."""
    return self._save(step, state, metrics, extra, arrays, force=True)

  def _save(self, step, state, metrics, extra, arrays, *, force: bool) -> bool:
    if self.read_only:
      raise CheckpointError(f"RunCheckpointer on {str(self.directory)!r} is read-only.")
    step = int(step)
    if step in self._manager.all_steps():
      return False
    latest = self.latest_step()
    if latest is not None and step < latest:
      raise CheckpointError(
          f"Cannot save step {step}: the directory already holds the later step {latest}. "
          "Checkpoints of one run have increasing steps."
      )
    meta = {
        "format": FORMAT_VERSION,
        "step": step,
        "config": self.config,
        "extra": dict(extra or {}),
    }
    try:
      json.dumps(meta, allow_nan=True)
    except TypeError as e:
      raise TypeError(f"RunCheckpointer: `extra` must be JSON-serialisable: {e}") from e
    scalars = _finite_scalars(metrics)
    if self.best_metric is not None:
      scalars.setdefault(self.best_metric, None)
    items = {STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(meta)}
    if arrays:
      items[ARRAYS_ITEM] = ocp.args.StandardSave(dict(arrays))
    saved = self._manager.save(
        step,
        args=ocp.args.Composite(**items),
        metrics=scalars if self.best_metric is not None else None,
        force=force,
    )
    if saved:
      logger.info("Saving the checkpoint of step %d to %s.", step, self.directory)
    return bool(saved)

  # ---- restoring -------------------------------------------------------------------------------

  def restore(
      self, step: int | None = None, *, like: Any, before: int | None = None
  ) -> tuple[Any, dict[str, Any]]:
    """Restores a checkpoint into the structure, dtypes and shardings of `like`.

    Before Orbax reads any array, the step's items must be present and readable and its saved
    array metadata must match `like` path by path (shape and dtype).

    Latest (`step=None`): when the newest step is damaged (a missing, truncated or unreadable
    file; see `CheckpointCorrupt`), the newest earlier step that reads is restored instead, with
    a warning naming each damaged step and why. Unless `read_only`, the damaged step folders are
    then moved into `directory/corrupt/` (never deleted), so that the resumed run can save
    those steps again. A structure or configuration mismatch never falls back: it is the setup,
    not the files, that differs.

    Args:
      step: the step to restore; None restores the latest readable one (see above).
      like: a live state (or a tree of `jax.ShapeDtypeStruct`) of the same structure; only its
        shapes, dtypes and shardings are used.
      before: with `step=None`, consider only steps < `before` (e.g. the last good checkpoint
        before a collapse at that step), with the same fallback.

    Returns:
      `(state, extra)`: the restored pytree (same treedef as `like`) and the `extra` dict given
      when it was saved.

    Raises:
      CheckpointError: there is no checkpoint, the step does not exist, or (latest) every step
        is damaged (nothing is moved then).
      CheckpointCorrupt: the explicitly requested step is damaged (naming the file or array).
      CheckpointStructureMismatch: the saved arrays have other paths, shapes or dtypes than
        `like` (naming each differing path with its saved and expected shape).
      CheckpointConfigMismatch: the checkpoint's configuration differs from `config`.
    """
    self.wait()
    target = abstract_like(like)
    if step is not None:
      if before is not None:
        raise ValueError("RunCheckpointer.restore: give `step` or `before`, not both.")
      return self._restore_step(int(step), target, like)
    steps = [s for s in self.steps() if before is None or s < before]
    if not steps:
      below = f" before step {before}" if before is not None else ""
      raise CheckpointError(f"No checkpoint{below} in {str(self.directory)!r} to restore.")
    damaged: list[CheckpointCorrupt] = []
    for candidate in reversed(steps):
      try:
        restored = self._restore_step(candidate, target, like)
      except CheckpointCorrupt as e:
        damaged.append(e)
        continue
      if damaged:
        self.set_aside(damaged, candidate)
      return restored
    listed = "; ".join(f"step {e.step}: {e.where}: {e.reason}" for e in damaged)
    raise CheckpointError(
        f"Every checkpoint in {str(self.directory)!r} is damaged ({listed}). Nothing was "
        "restored, moved or deleted; start a new run in another directory, or replace the "
        "damaged step folders with good copies."
    )

  def restore_arrays(self, step: int, *, like: Mapping[str, Any]) -> dict[str, Any]:
    """Restores the `arrays` saved with `step` into the structure, dtypes and shardings of `like`.

    Args:
      step: a committed step saved with `arrays`.
      like: `{name: pytree}` of live arrays or `jax.ShapeDtypeStruct`s, as saved.

    Raises:
      CheckpointError: the step does not exist.
      CheckpointCorrupt: the step holds no arrays, or they cannot be read into `like`.
    """
    self.wait()
    self._check_step(step)
    target = abstract_like(dict(like))
    folder = self._step_dir(step) / ARRAYS_ITEM
    if not folder.is_dir():
      raise self._damaged(step, folder, "the item folder is missing (a partial copy or save?)")
    try:
      with orbax_reads_drained():
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            ARRAYS_ITEM: ocp.args.StandardRestore(target)
        }))[ARRAYS_ITEM]
    except Exception as e:
      raise self._damaged(step, folder, e) from e
    if jax.tree.structure(restored) != jax.tree.structure(target):
      raise self._damaged(step, folder, "the restored arrays have another structure")
    return dict(restored)

  # ---- lifecycle -------------------------------------------------------------------------------

  def wait(self) -> None:
    """Blocks until every started save is committed (re-raises a background failure)."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases Orbax's resources."""
    self._manager.close()

  def __enter__(self) -> RunCheckpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- helpers ---------------------------------------------------------------------------------

  def _check_step(self, step: int) -> None:
    steps = self.steps()
    if step not in steps:
      raise CheckpointError(
          f"No checkpoint of step {step} in {str(self.directory)!r}; available steps: "
          f"{steps or 'none'}."
      )

  def _step_dir(self, step: int) -> pathlib.Path:
    return self.directory / str(step)

  def _restore_step(self, step: int, target: Any, like: Any) -> tuple[Any, dict[str, Any]]:
    """Checks (metadata, config, array structure) then restores one step into `target`."""
    meta = self.read_meta(step)
    if self.config is not None:
      self._check_config(meta, step)
    self._check_structure(step, expected_specs(like, target))
    folder = self._step_dir(step) / STATE_ITEM
    try:
      with orbax_reads_drained():
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardRestore(target)
        }))
      state = restored[STATE_ITEM]
    except Exception as e:  # (structure and shapes were checked: the files are at fault)
      summary = error_summary(e)
      if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in summary:
        raise CheckpointError(
            f"Not enough memory to restore checkpoint step {step} in "
            f"{str(self.directory)!r}: {summary}. Nothing was changed."
        ) from e
      array = ARRAY_KEY.search(str(e)) or ARRAY_KEY.search(summary)
      where = f"{folder} (array {array.group(1)!r})" if array else folder
      raise self._damaged(step, where, e) from e
    if jax.tree.structure(state) != jax.tree.structure(target):
      raise CheckpointError(
          f"Checkpoint step {step} in {str(self.directory)!r} restored into another tree "
          f"structure ({jax.tree.structure(state)} instead of {jax.tree.structure(target)}); "
          "restore with the setup that wrote it. Nothing was changed."
      )
    return state, dict(meta["extra"])

  def _check_structure(self, step: int, expected: Any) -> None:
    """Compares the step's saved array metadata with `expected`, before any array is read.

    Raises:
      CheckpointCorrupt: the state item or its array metadata is missing or unreadable.
      CheckpointStructureMismatch: a parameter path, shape or dtype differs.
    """
    folder = self._step_dir(step) / STATE_ITEM
    if not folder.is_dir():
      raise self._damaged(step, folder, "the item folder is missing (a partial copy or save?)")
    try:
      with orbax_reads_drained():
        items = self._manager.metadata(step).item_metadata
      saved = items[STATE_ITEM] if items is not None else None
    except Exception as e:  # (a truncated or garbled metadata file)
      raise self._damaged(step, folder, e) from e
    if saved is None:
      raise self._damaged(step, folder, "its array metadata (shapes and dtypes) is missing")
    diffs = structure_differences(getattr(saved, "tree", saved),
                                   ocp.tree.serialize_tree(expected, keep_empty_nodes=True))
    if not diffs:
      return
    shown = "; ".join(f"{p}: saved {a}, expected {b}" for p, a, b in diffs[:20])
    more = f" (and {len(diffs) - 20} more)" if len(diffs) > 20 else ""
    raise CheckpointStructureMismatch(
        f"Checkpoint step {step} in {str(self.directory)!r} holds other arrays than the state "
        f"being restored ({len(diffs)} differ): {shown}{more}. The model or trainer setup "
        "(architecture, sizes, dtype, LoRA, critic) differs from the run that wrote it: restore "
        "with the setup that wrote it, or start the new run in another directory. Nothing was "
        "changed.",
        diffs,
    )

  def _damaged(
      self, step: int, where: str | os.PathLike, error: BaseException | str
  ) -> CheckpointCorrupt:
    """The `CheckpointCorrupt` of a damaged step, with what to do about it."""
    reason = (error if isinstance(error, str) else error_summary(error)).rstrip(".")
    if (not isinstance(error, str) and isinstance(where, pathlib.Path) and where.is_dir()
        and has_json_error(error)):
      where = ", ".join(str(p) for p in unparsable_json_files(where)) or where
    others = [s for s in self.steps() if s != step]
    hint = (f"restore an earlier step ({others}), or the latest (step=None), which falls back "
            f"to the newest readable step and moves this one into {CORRUPT_DIR}/"
            if others else "start a new run in another directory")
    return CheckpointCorrupt(
        f"Checkpoint step {step} in {str(self.directory)!r} is damaged: {str(where)}: {reason}. "
        f"Nothing was changed; {hint}.",
        step=step, where=str(where), reason=reason,
    )

  def set_aside(self, damaged: Sequence[CheckpointCorrupt], restored: int) -> None:
    """Warns about damaged steps after `restored` was used instead; moves them into `corrupt/`
    (unless read-only) so that their step numbers can be saved again. Never deletes.

    Several processes (all of them restore, find the same damaged steps and call this): only
    process 0 moves the folders; every process then waits at a barrier before re-reading the
    directory, so none sees it half moved and no two race on the same folder."""
    main = is_main_process()
    for error in damaged:
      where_now = "left in place (read-only)"
      if not self.read_only:
        parking = self.directory / CORRUPT_DIR
        dest, n = parking / str(error.step), 1
        if main:
          parking.mkdir(exist_ok=True)
          while dest.exists():
            dest, n = parking / f"{error.step}.{n}", n + 1
          os.replace(self._step_dir(error.step), dest)
          where_now = f"moved to {str(dest)!r}"
        else:
          where_now = f"moved into {str(parking)!r} by process 0"
      logger.warning(
          "Checkpoint step %d in %s is damaged (%s: %s); restored step %d instead. The damaged "
          "step folder was %s; nothing was deleted.",
          error.step, self.directory, error.where, error.reason, restored, where_now,
      )
    if not self.read_only:
      barrier(f"set_aside {self.directory} {sorted(e.step for e in damaged)}")
      self._manager.reload()

  def _check_newest_config(self) -> None:
    """Checks `config` against the newest step whose metadata reads (`restore` reports and
    sets aside damaged steps)."""
    for step in reversed(self.steps()):
      try:
        meta = self.read_meta(step)
      except CheckpointCorrupt:
        continue
      self._check_config(meta, step)
      return

  def _check_config(self, meta: Mapping[str, Any], step: int) -> None:
    saved = meta.get("config")
    if saved is not None:
      check_config(saved, self.config, ignore=self.config_ignore, config_type=self._config_type,
                   where=f"{str(self.directory)!r} (checkpoint of step {step})")
