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
"""

from __future__ import annotations

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

logger = logging.getLogger("jax_ppo.checkpoint")

BEST_MODES = ("max", "min")
FORMAT_VERSION = 1
STATE_ITEM = "state"
META_ITEM = "meta"
ARRAYS_ITEM = "arrays"


class CheckpointError(RuntimeError):
  """A checkpoint exists but cannot be read (or a requested step does not exist)."""


class CheckpointConfigMismatch(ValueError):
  """The checkpoint directory holds a run whose configuration differs from the current one.

  Attributes:
    differences: `(dotted key, saved value, current value)` for every differing field.
  """

  def __init__(self, message: str, differences: Sequence[tuple[str, Any, Any]]):
    super().__init__(message)
    self.differences = list(differences)


_MISSING = "<missing>"


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, Mapping):
    out: dict[str, Any] = {}
    for key, value in tree.items():
      out.update(_flatten(value, f"{prefix}{key}."))
    if not tree and prefix:
      out[prefix[:-1]] = {}
    return out
  return {prefix[:-1]: tree}


def config_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, ignore: Sequence[str] = ()
) -> list[tuple[str, Any, Any]]:
  """Fields (dotted keys) whose values differ between two config dicts.

  Args:
    saved: the configuration stored with a checkpoint (plain dict).
    current: the configuration of the run being started (plain dict).
    ignore: dotted keys (or prefixes of them, e.g. "monitor") that may differ.

  Returns:
    `(key, saved value, current value)` triples in key order; a key present on one side only
    shows `"<missing>"` on the other.
  """
  a, b = _flatten(saved), _flatten(current)

  def ignored(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in ignore)

  return [
      (key, a.get(key, _MISSING), b.get(key, _MISSING))
      for key in sorted(set(a) | set(b))
      if not ignored(key) and a.get(key, _MISSING) != b.get(key, _MISSING)
  ]


def check_config(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    where: str,
    ignore: Sequence[str] = (),
) -> None:
  """Raises `CheckpointConfigMismatch` naming every differing field (see `config_differences`).

  Args:
    saved: the stored configuration (plain dict).
    current: the configuration of the run being started (plain dict).
    where: what holds the saved configuration, for the message (e.g. "'runs/a' (step 40)").
    ignore: dotted keys (or prefixes) allowed to differ.
  """
  diffs = config_differences(saved, current, ignore=ignore)
  if not diffs:
    return
  shown = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in diffs[:20])
  more = f" (and {len(diffs) - 20} more)" if len(diffs) > 20 else ""
  raise CheckpointConfigMismatch(
      f"{where} holds a run with a different configuration: {shown}{more}. Resume with the "
      "saved configuration, or start the new run in another directory; nothing was changed.",
      diffs,
  )


def _plain_config(config: Any) -> dict[str, Any] | None:
  """A dataclass config or mapping as JSON-round-tripped plain types (None stays None)."""
  if config is None:
    return None
  if isinstance(config, Mapping):
    data = dict(config)
  else:
    from jax_ppo.config_io import config_to_dict

    data = config_to_dict(config)
  return json.loads(json.dumps(data))


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


def abstract_like(tree: Any) -> Any:
  """`jax.ShapeDtypeStruct`s (with shardings) of a live pytree: the restore target."""

  def spec(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return jax.eval_shape(lambda: x)

  return jax.tree.map(spec, tree)


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
    CheckpointError: `read_only` and the directory does not exist, or its latest checkpoint's
      metadata cannot be read.
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
    self.config = _plain_config(config)
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
    latest = self.latest_step()
    if latest is not None and self.config is not None:
      self._check_config(self.read_meta(latest), latest)

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
      CheckpointError: the step does not exist or its metadata cannot be read.
    """
    self._check_step(step)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          META_ITEM: ocp.args.JsonRestore()
      }))
      meta = restored[META_ITEM]
    except Exception as e:  # Orbax raises many types for unreadable files.
      raise self._unreadable(step, e) from e
    if not isinstance(meta, Mapping) or "extra" not in meta:
      raise self._unreadable(step, ValueError(f"metadata is {meta!r}"))
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

  def restore(self, step: int | None = None, *, like: Any) -> tuple[Any, dict[str, Any]]:
    """Restores a checkpoint into the structure, dtypes and shardings of `like`.

    Args:
      step: the step to restore; None restores the latest.
      like: a live state (or a tree of `jax.ShapeDtypeStruct`) of the same structure; only its
        shapes, dtypes and shardings are used.

    Returns:
      `(state, extra)`: the restored pytree (same treedef as `like`) and the `extra` dict given
      when it was saved.

    Raises:
      CheckpointError: there is no checkpoint, the step does not exist, or it cannot be read
        (including a state whose structure differs from `like`).
      CheckpointConfigMismatch: the checkpoint's configuration differs from `config`.
    """
    self.wait()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise CheckpointError(f"No checkpoint in {str(self.directory)!r} to restore.")
    meta = self.read_meta(step)
    if self.config is not None:
      self._check_config(meta, step)
    target = abstract_like(like)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.StandardRestore(target)
      }))
      state = restored[STATE_ITEM]
    except Exception as e:
      raise self._unreadable(step, e) from e
    if jax.tree.structure(state) != jax.tree.structure(target):
      raise self._unreadable(step, ValueError("the restored tree has another structure"))
    return state, dict(meta["extra"])

  def restore_arrays(self, step: int, *, like: Mapping[str, Any]) -> dict[str, Any]:
    """Restores the `arrays` saved with `step` into the structure, dtypes and shardings of `like`.

    Args:
      step: a committed step saved with `arrays`.
      like: `{name: pytree}` of live arrays or `jax.ShapeDtypeStruct`s, as saved.

    Raises:
      CheckpointError: the step does not exist, holds no arrays, or they cannot be read into
        `like`.
    """
    self.wait()
    self._check_step(step)
    target = abstract_like(dict(like))
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          ARRAYS_ITEM: ocp.args.StandardRestore(target)
      }))[ARRAYS_ITEM]
    except Exception as e:
      raise self._unreadable(step, e) from e
    if jax.tree.structure(restored) != jax.tree.structure(target):
      raise self._unreadable(step, ValueError("the restored arrays have another structure"))
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

  def _unreadable(self, step: int, error: BaseException) -> CheckpointError:
    others = [s for s in self.steps() if s != step]
    damaged = (f"restore another step ({others}) or move {str(self.directory / str(step))!r} "
               "aside to resume from the previous one" if others else
               "start a new run in another directory")
    return CheckpointError(
        f"Cannot read checkpoint step {step} in {str(self.directory)!r}: "
        f"{type(error).__name__}: {error}. Nothing was changed. If the model or trainer setup "
        f"changed (LoRA, critic, architecture), restore with the setup that wrote it; if the "
        f"files are damaged, {damaged}."
    )

  def _check_config(self, meta: Mapping[str, Any], step: int) -> None:
    saved = meta.get("config")
    if saved is not None:
      check_config(saved, self.config, ignore=self.config_ignore,
                   where=f"{str(self.directory)!r} (checkpoint of step {step})")
