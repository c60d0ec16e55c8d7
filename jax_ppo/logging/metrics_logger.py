"""`MetricsLogger`: asynchronous metric and sample logging for training runs.

The training loop hands over metrics as they come out of a jitted step (JAX arrays still on the
device, NumPy values or Python numbers) and goes on; a background thread fetches them
(`jax.device_get`), converts them and writes

* `metrics.jsonl`: one JSON object per `log` call, `{"step": ..., <metric>: <value>, ...}`;
  non-finite numbers are written as `null`, so every line is valid JSON;
* `samples.jsonl`: one object per sample, `{"stage", "step", "prompt", "response", "reward"}`;
* TensorBoard event files under `tensorboard/` (tensorboardX; non-finite values stay NaN/inf);
* Weights & Biases, when enabled and installed (imported lazily, never required): each metric
  against the training step, logged as the metric `step` (`STEP_METRIC`, W&B's x-axis of every
  other metric), never as W&B's own `step=`, which must only grow: a resumed run logs again the
  steps after its checkpoint, and W&B would drop them;
* a tqdm progress bar showing the reward and the KL.

`flush()` and `close()` (also on leaving a `with` block) wait until everything queued so far is
written. Errors on the writer thread are logged and re-raised by the next `flush()`/`close()`.

Resuming: files are appended to. `truncate_after_step=N` first drops records with `step > N`
from both JSONL files (and purges TensorBoard events after N), so resuming from the checkpoint of
step N does not duplicate steps. A line cut short by a crash is always dropped. The W&B run's id
is kept in the folder (`WANDB_ID_FILE`) when the run starts, and a logger opened again on that
folder continues the same W&B run (`wandb.init(id=<kept id>, resume="allow")`), unless
`wandb_init` (or the environment: `WANDB_RUN_ID`, `WANDB_RESUME`) names an id or a resume mode
itself: then those are used as given.

Multi-host: only process 0 writes (`write=None`, the default, means `jax.process_index() == 0`);
on the other processes `log` and `log_samples` do nothing and no file is opened or truncated.

Do not pass arrays whose buffers a later jitted call donates: the writer thread reads them after
`log` returns.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import pathlib
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

logger = logging.getLogger("jax_ppo.logging")

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
"""File of the log folder holding the id of its W&B run (one line), written by the process that
writes the logs when W&B starts; a logger opened again on the folder resumes that W&B run."""
STEP_METRIC = "step"
"""The W&B metric holding the training step: the x-axis (`define_metric(step_metric=...)`) of
every other metric."""

DEFAULT_PROGRESS_KEYS: Mapping[str, tuple[str, ...]] = {
    "reward": ("objective/scores", "objective/rlhf_reward"),
    "kl": ("objective/kl",),
}
"""Progress-bar label -> metric names to show, first present wins."""

_STOP = object()


class MetricsLogger:
  """Writes metrics and samples to JSONL, TensorBoard and (optionally) W&B off the main thread.

  Example::

    with MetricsLogger(run_dir, total_steps=config.total_updates, progress=True) as log:
      for step in range(start, config.total_updates):
        state, metrics = train_step(state, batch)       # metrics: dict of device arrays
        log.log(step, metrics)                          # returns at once
        if step % 10 == 0:
          log.log_samples(step, prompts, responses, scores, stage="eval")
  """

  def __init__(
      self,
      log_dir: str | os.PathLike,
      *,
      tensorboard: bool = True,
      wandb: bool = False,
      wandb_init: Mapping[str, Any] | None = None,
      config: Mapping[str, Any] | None = None,
      progress: bool = False,
      total_steps: int | None = None,
      initial_step: int | None = None,
      progress_keys: Mapping[str, Sequence[str]] = DEFAULT_PROGRESS_KEYS,
      truncate_after_step: int | None = None,
      max_text_samples: int = 8,
      write: bool | None = None,
  ):
    """Opens (or resumes) the run folder and starts the writer thread.

    Args:
      log_dir: run folder; created if missing.
      tensorboard: write TensorBoard events under `log_dir/tensorboard`.
      wandb: also log to Weights & Biases; ignored with a warning when `wandb` is not installed.
      wandb_init: keyword arguments of `wandb.init` (project, name...). Without `id` and
        `resume` (here or as `WANDB_RUN_ID` / `WANDB_RESUME`), the W&B run of an earlier logger
        on `log_dir` (its id in `WANDB_ID_FILE`) is resumed; otherwise a new one starts.
      config: the run's configuration as a plain dict, given to W&B.
      progress: show a tqdm progress bar with the reward and KL.
      total_steps: length of the progress bar.
      initial_step: where the progress bar starts (default: `truncate_after_step + 1`, or 0).
      progress_keys: bar label -> metric names, the first one present is shown.
      truncate_after_step: drop records with `step` greater than this from existing files.
      max_text_samples: samples per `log_samples` call shown as TensorBoard text.
      write: whether this process writes anything; None: only process 0 of a multi-host job.
    """
    self.log_dir = pathlib.Path(log_dir)
    self.metrics_path = self.log_dir / METRICS_FILE
    self.samples_path = self.log_dir / SAMPLES_FILE
    self._progress_keys = {k: tuple(v) for k, v in progress_keys.items()}
    self._max_text_samples = max_text_samples
    self._error: BaseException | None = None
    self._closed = False
    self.writes = jax.process_index() == 0 if write is None else bool(write)
    self._metrics_file = self._samples_file = self._tb = self._wandb_run = self._bar = None
    self._queue: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._work, name="MetricsLogger", daemon=True)
    if not self.writes:  # another process of a multi-host job: process 0 writes
      self._thread.start()
      atexit.register(self._close_at_exit)
      return
    self.log_dir.mkdir(parents=True, exist_ok=True)
    for path in (self.metrics_path, self.samples_path):
      _prepare_jsonl(path, truncate_after_step)
    self._metrics_file = open(self.metrics_path, "a", encoding="utf-8")
    self._samples_file = open(self.samples_path, "a", encoding="utf-8")

    if tensorboard:
      import tensorboardX

      purge = None if truncate_after_step is None else truncate_after_step + 1
      self._tb = tensorboardX.SummaryWriter(
          logdir=str(self.log_dir / TENSORBOARD_DIR), purge_step=purge, flush_secs=30
      )

    if wandb:
      self._wandb_run = _start_wandb(self.log_dir, config, dict(wandb_init or {}))

    if progress:
      import tqdm

      if initial_step is None:
        initial_step = 0 if truncate_after_step is None else truncate_after_step + 1
      self._bar = tqdm.tqdm(total=total_steps, initial=initial_step, desc="train", unit="step")

    self._thread.start()
    atexit.register(self._close_at_exit)

  # ---- producer side (training thread) ---------------------------------------------------------

  def log(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Queues one step's metrics; returns without waiting for the device.

    Args:
      step: the training step (an int, or a scalar array that is fetched with the metrics).
      metrics: metric name -> scalar or array (JAX, NumPy, Python numbers, strings).
    """
    self._check_open()
    if not self.writes:
      return
    items = {}
    for key, value in metrics.items():
      if not isinstance(key, str):
        raise TypeError(f"metric names must be strings, got {key!r}")
      items[key] = _snapshot(value)
    self._queue.put(("metrics", _snapshot(step), items))

  def log_samples(
      self,
      step: int,
      prompts: Sequence[str],
      responses: Sequence[str],
      rewards: Any = None,
      *,
      stage: str = "train",
  ) -> None:
    """Queues decoded samples; each becomes one line of `samples.jsonl`.

    Args:
      step: the training step.
      prompts: `[N]` prompt texts.
      responses: `[N]` response texts.
      rewards: `[N]` scores (array or sequence), or None.
      stage: e.g. "train" or "eval".
    """
    self._check_open()
    if not self.writes:
      return
    prompts, responses = list(prompts), list(responses)
    if len(prompts) != len(responses):
      raise ValueError(
          f"log_samples: {len(prompts)} prompts but {len(responses)} responses; pass one "
          "response per prompt (repeat prompts for several samples per prompt)."
      )
    self._queue.put(("samples", _snapshot(step), stage, prompts, responses, _snapshot(rewards)))

  def flush(self, timeout: float | None = None) -> None:
    """Waits until everything queued so far is written and flushed to disk.

    Raises:
      RuntimeError: when writing failed on the background thread (the first error), or the
        queue did not drain within `timeout` seconds.
    """
    if not self._closed:
      done = threading.Event()
      self._queue.put(("flush", done))
      if not done.wait(timeout):
        raise RuntimeError(f"MetricsLogger.flush: not drained within {timeout} s")
    self._raise_error()

  def close(self) -> None:
    """Drains the queue, closes files, TensorBoard, W&B and the progress bar. Idempotent."""
    if self._closed:
      return
    self._closed = True
    atexit.unregister(self._close_at_exit)
    self._queue.put(_STOP)
    self._thread.join()
    for file in (self._metrics_file, self._samples_file):
      if file is not None:
        file.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb_run is not None:
      self._wandb_run.finish()
    if self._bar is not None:
      self._bar.close()
    self._raise_error()

  def __enter__(self) -> MetricsLogger:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
      return
    try:
      self.close()
    except RuntimeError:
      logger.exception("MetricsLogger failed while closing after an error")

  # ---- consumer side (writer thread) -----------------------------------------------------------

  def _work(self) -> None:
    while True:
      item = self._queue.get()
      try:
        if item is _STOP:
          self._flush_outputs()
          return
        kind = item[0]
        if kind == "metrics":
          self._write_metrics(*item[1:])
        elif kind == "samples":
          self._write_samples(*item[1:])
        elif kind == "flush":
          try:
            self._flush_outputs()
          finally:
            item[1].set()
      except Exception as e:  # Never let the writer thread die: report at the next flush.
        what = item[0] if isinstance(item, tuple) else "close"
        logger.exception("MetricsLogger: %s failed", what)
        if self._error is None:
          self._error = e
      finally:
        self._queue.task_done()

  def _write_metrics(self, step: Any, metrics: dict[str, Any]) -> None:
    step = int(_to_python(jax.device_get(step)))
    values = {k: _to_python(v) for k, v in jax.device_get(metrics).items()}
    record = {"step": step, **{k: v for k, v in values.items() if k != "step"}}
    self._metrics_file.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
    if self._tb is not None:
      for key, value in values.items():
        _tb_write(self._tb, key, value, step)
    if self._wandb_run is not None:  # The step as a metric: resumed steps are not dropped.
      scalars = {k: v for k, v in values.items()
                 if k != STEP_METRIC and isinstance(v, int | float | str)}
      self._wandb_run.log({STEP_METRIC: step, **scalars})
    if self._bar is not None:
      self._update_bar(step, values)

  def _write_samples(self, step, stage, prompts, responses, rewards) -> None:
    step = int(_to_python(jax.device_get(step)))
    if rewards is None:
      scores = [None] * len(prompts)
    else:
      scores = _to_python(jax.device_get(rewards))
      scores = [scores] if not isinstance(scores, list) else scores
      if len(scores) != len(prompts):
        raise ValueError(f"log_samples: {len(scores)} rewards for {len(prompts)} samples")
    lines = []
    for prompt, response, reward in zip(prompts, responses, scores, strict=True):
      record = {"stage": stage, "step": step, "prompt": prompt, "response": response}
      record["reward"] = reward
      lines.append(json.dumps(_json_safe(record), allow_nan=False, ensure_ascii=False) + "\n")
    self._samples_file.write("".join(lines))
    if self._tb is not None and prompts:
      shown = list(zip(prompts, responses, scores, strict=True))[: self._max_text_samples]
      rows = ["| prompt | response | reward |", "| --- | --- | --- |"]
      rows += [f"| {_md(p)} | {_md(r)} | {s} |" for p, r, s in shown]
      self._tb.add_text(f"samples/{stage}", "\n".join(rows), step)

  def _update_bar(self, step: int, values: Mapping[str, Any]) -> None:
    bar = self._bar
    if step + 1 > bar.n:
      bar.update(step + 1 - bar.n)
    shown = []
    for label, keys in self._progress_keys.items():
      key = next((k for k in keys if isinstance(values.get(k), int | float)), None)
      if key is not None:
        shown.append(f"{label}={values[key]:.4g}")
    if shown:
      bar.set_postfix_str(" ".join(shown), refresh=False)

  def _flush_outputs(self) -> None:
    for file in (self._metrics_file, self._samples_file):
      if file is not None:
        file.flush()
    if self._tb is not None:
      self._tb.flush()
    if self._bar is not None:
      self._bar.refresh()

  # ---- helpers ---------------------------------------------------------------------------------

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("MetricsLogger is closed")

  def _raise_error(self) -> None:
    if self._error is not None:
      error, self._error = self._error, None
      message = f"MetricsLogger: writing failed on the background thread: {error!r}"
      raise RuntimeError(message) from error

  def _close_at_exit(self) -> None:
    try:
      self.close()
    except Exception:  # Nothing left to raise to at interpreter exit.
      logger.exception("MetricsLogger failed while closing at exit")


def _snapshot(value: Any) -> Any:
  """Makes a value safe to read later on another thread, without waiting for the device."""
  if isinstance(value, jax.Array):
    try:
      value.copy_to_host_async()  # Start the transfer now; the writer thread collects it.
    except Exception:  # E.g. a deleted buffer: the writer thread reports it.
      pass
    return value
  if isinstance(value, np.ndarray):
    return value.copy()  # The caller may reuse its buffer.
  return value


def _to_python(value: Any) -> Any:
  """Fetched value -> bool, int, float, str, None or a (nested) list of them."""
  if value is None or isinstance(value, bool | int | float | str):
    return value
  array = np.asarray(value)
  if array.dtype == np.bool_ or np.issubdtype(array.dtype, np.integer):
    return array.tolist()
  if array.dtype.kind in "OUS":
    return array.tolist()
  return np.asarray(array, dtype=np.float64).tolist()  # Also bfloat16 and float16.


def _json_safe(value: Any) -> Any:
  """Replaces non-finite floats (also inside lists) with None."""
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, list):
    return [_json_safe(v) for v in value]
  if isinstance(value, dict):
    return {k: _json_safe(v) for k, v in value.items()}
  return value


def _tb_write(writer: Any, key: str, value: Any, step: int) -> None:
  if isinstance(value, bool | int | float):
    writer.add_scalar(key, float(value), step)  # NaN/inf are kept as such.
  elif isinstance(value, str):
    writer.add_text(key, value, step)
  elif isinstance(value, list):
    array = np.asarray(value, dtype=np.float64).ravel()
    if array.size and np.isfinite(array).all():
      writer.add_histogram(key, array, step)


def _md(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", "<br>")


def _prepare_jsonl(path: pathlib.Path, truncate_after_step: int | None) -> None:
  """Drops a line cut short by a crash and, if asked, records with `step > truncate_after_step`."""
  if not path.exists() or path.stat().st_size == 0:
    return
  if truncate_after_step is None:
    with open(path, "rb+") as f:
      f.seek(-1, os.SEEK_END)
      if f.read(1) == b"\n":
        return
      f.seek(0)
      data = f.read()
      f.truncate(data.rfind(b"\n") + 1)
    return
  kept = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict) and isinstance(record.get("step"), int):
        if record["step"] <= truncate_after_step:
          kept.append(line if line.endswith("\n") else line + "\n")
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(tmp, path)


def _start_wandb(log_dir: pathlib.Path, config: Mapping[str, Any] | None, init: dict) -> Any:
  """Starts (or resumes) the W&B run of `log_dir`; None without the `wandb` package.

  Resumes the run whose id `log_dir/WANDB_ID_FILE` keeps (`resume="allow"`: a run W&B no longer
  has starts anew under that id) unless `init` or the environment gives `id` or `resume`; keeps
  the started run's id there, and makes `STEP_METRIC` the x-axis of every metric.
  """
  try:
    import wandb
  except ImportError:
    logger.warning("wandb=True but the wandb package is not installed; logging without W&B.")
    return None
  init.setdefault("dir", str(log_dir))
  if config is not None:
    init.setdefault("config", dict(config))
  id_file = log_dir / WANDB_ID_FILE
  user_chose = bool({"id", "resume"} & set(init)) or any(
      os.environ.get(name) for name in ("WANDB_RUN_ID", "WANDB_RESUME"))
  if not user_chose and id_file.is_file():
    kept = id_file.read_text(encoding="utf-8").strip()
    if kept:
      init.update(id=kept, resume="allow")
      logger.info("W&B: resuming run %s (its id is kept in %s).", kept, id_file)
  run = wandb.init(**init)
  if not getattr(run, "disabled", False) and getattr(run, "id", None):
    if not id_file.is_file() or id_file.read_text(encoding="utf-8").strip() != run.id:
      tmp = id_file.with_name(id_file.name + ".tmp")
      tmp.write_text(run.id + "\n", encoding="utf-8")
      os.replace(tmp, id_file)
  run.define_metric(STEP_METRIC)
  run.define_metric("*", step_metric=STEP_METRIC)
  return run
