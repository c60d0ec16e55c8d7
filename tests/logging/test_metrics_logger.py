"""Tests of jax_ppo.logging.MetricsLogger: JSONL files, TensorBoard events read back, JAX arrays
accepted without blocking the caller, NaN -> null, draining on flush/close, resume truncation,
optional W&B and the progress bar."""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import json
import logging
import math
import pathlib
import struct
import subprocess
import sys
import threading
import types

import jax.numpy as jnp
import numpy as np
import pytest

import jax_ppo.logging.metrics_logger as metrics_logger
from jax_ppo.logging import (
    METRICS_FILE,
    SAMPLES_FILE,
    TENSORBOARD_DIR,
    WANDB_ID_FILE,
    MetricsLogger,
)


def read_jsonl(path) -> list[dict]:
  """Parses strict JSON lines (NaN/Infinity tokens are rejected)."""

  def reject(token):
    raise ValueError(f"non-standard JSON token {token}")

  with open(path, encoding="utf-8") as f:
    return [json.loads(line, parse_constant=reject) for line in f]


def read_tb_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] from the event files, with tensorboard's loader when installed, else
  by reading the TFRecord framing (u64 length, u32 crc, payload, u32 crc) with tensorboardX's
  Event proto."""
  events = []
  files = sorted(logdir.rglob("events.out.tfevents.*"))
  assert files, f"no event files under {logdir}"
  try:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    for file in files:
      events.extend(EventFileLoader(str(file)).Load())
  except ImportError:
    from tensorboardX.proto import event_pb2

    for file in files:
      data, pos = file.read_bytes(), 0
      while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        pos += 12
        events.append(event_pb2.Event.FromString(data[pos : pos + length]))
        pos += length + 4
  scalars: dict[str, list[tuple[int, float]]] = {}
  for event in events:
    for value in event.summary.value:
      if value.HasField("simple_value"):
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_metrics_jsonl_and_tensorboard(tmp_path):
  with MetricsLogger(tmp_path) as log:
    for step in range(3):
      log.log(
          step,
          {
              "objective/scores": jnp.float32(0.5 * step),  # a JAX scalar on the device
              "objective/kl": np.float64(0.01),
              "loss/value_avg": jnp.asarray(2.0, jnp.bfloat16),
              "episode": 8 * (step + 1),
              "val/num_eos_tokens": jnp.int32(3),
              "eos_ok": True,
              "nan_metric": jnp.float32(jnp.nan),
              "inf_metric": math.inf,
              "histogram": jnp.arange(4.0),
          },
      )
  records = read_jsonl(tmp_path / METRICS_FILE)
  assert [r["step"] for r in records] == [0, 1, 2]
  assert list(records[0])[0] == "step"
  r = records[2]
  assert r["objective/scores"] == 1.0 and r["objective/kl"] == 0.01
  assert r["loss/value_avg"] == 2.0 and r["episode"] == 24 and r["val/num_eos_tokens"] == 3
  assert r["eos_ok"] is True
  assert r["nan_metric"] is None and r["inf_metric"] is None  # valid JSON
  assert r["histogram"] == [0.0, 1.0, 2.0, 3.0]

  scalars = read_tb_scalars(tmp_path / TENSORBOARD_DIR)
  assert scalars["objective/scores"] == [(0, 0.0), (1, 0.5), (2, 1.0)]
  assert [v for _, v in scalars["objective/kl"]] == pytest.approx([0.01] * 3)
  assert all(math.isnan(v) for _, v in scalars["nan_metric"])  # NaN kept in TensorBoard
  assert all(math.isinf(v) for _, v in scalars["inf_metric"])


def test_samples_jsonl(tmp_path):
  with MetricsLogger(tmp_path, tensorboard=False) as log:
    log.log_samples(4, ["a|b", "ü"], ["x\ny", "z"], jnp.array([1.5, jnp.nan]), stage="eval")
    log.log_samples(5, ["p"], ["r"])
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
      log.log_samples(6, ["p", "q"], ["r"])
  records = read_jsonl(tmp_path / SAMPLES_FILE)
  assert records == [
      {"stage": "eval", "step": 4, "prompt": "a|b", "response": "x\ny", "reward": 1.5},
      {"stage": "eval", "step": 4, "prompt": "ü", "response": "z", "reward": None},
      {"stage": "train", "step": 5, "prompt": "p", "response": "r", "reward": None},
  ]


def test_samples_appear_as_tensorboard_text(tmp_path):
  with MetricsLogger(tmp_path) as log:
    log.log_samples(1, ["hello"], ["world"], [0.25])
  payload = b"".join(f.read_bytes() for f in (tmp_path / TENSORBOARD_DIR).rglob("events.*"))
  assert b"samples/train" in payload and b"hello" in payload and b"world" in payload


def test_log_does_not_wait_for_the_writer(tmp_path, monkeypatch):
  """While the writer thread is stuck (e.g. waiting on the device), `log` still returns."""
  release = threading.Event()
  to_python = metrics_logger._to_python

  def slow_to_python(value):
    release.wait(timeout=10)
    return to_python(value)

  monkeypatch.setattr(metrics_logger, "_to_python", slow_to_python)
  log = MetricsLogger(tmp_path, tensorboard=False)
  for step in range(20):
    log.log(step, {"x": jnp.float32(step)})
  assert (tmp_path / METRICS_FILE).read_text() == ""  # nothing written yet, nothing blocked
  release.set()
  log.flush()
  assert [r["x"] for r in read_jsonl(tmp_path / METRICS_FILE)] == list(range(20))
  log.close()


def test_close_drains_the_queue(tmp_path):
  log = MetricsLogger(tmp_path)
  for step in range(300):
    log.log(step, {"objective/kl": jnp.float32(step / 300)})
  log.close()
  assert [r["step"] for r in read_jsonl(tmp_path / METRICS_FILE)] == list(range(300))
  assert len(read_tb_scalars(tmp_path / TENSORBOARD_DIR)["objective/kl"]) == 300
  log.close()  # idempotent
  with pytest.raises(RuntimeError, match="closed"):
    log.log(300, {"x": 1.0})


def test_caller_may_reuse_numpy_buffers(tmp_path):
  buffer = np.zeros(2)
  with MetricsLogger(tmp_path, tensorboard=False) as log:
    for step in range(3):
      buffer[:] = step
      log.log(step, {"v": buffer})
  assert [r["v"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [[0, 0], [1, 1], [2, 2]]


def test_writer_errors_surface_at_flush_and_the_logger_keeps_working(tmp_path, caplog):
  log = MetricsLogger(tmp_path, tensorboard=False)
  with caplog.at_level(logging.ERROR, logger="jax_ppo.logging"):
    log.log(0, {"bad": object()})  # not JSON-serialisable
    with pytest.raises(RuntimeError, match="background thread"):
      log.flush()
  assert any("metrics failed" in r.getMessage() for r in caplog.records)
  log.log(1, {"good": 1.0})
  log.close()
  assert read_jsonl(tmp_path / METRICS_FILE) == [{"step": 1, "good": 1.0}]


def test_truncate_after_step_for_an_exact_resume(tmp_path):
  with MetricsLogger(tmp_path) as log:
    for step in range(10):
      log.log(step, {"x": float(step)})
      log.log_samples(step, ["p"], ["r"], [float(step)])
  with MetricsLogger(tmp_path, truncate_after_step=4) as log:
    for step in range(5, 8):
      log.log(step, {"x": 10.0 + step})
  records = read_jsonl(tmp_path / METRICS_FILE)
  assert [r["step"] for r in records] == list(range(8))
  assert [r["x"] for r in records] == [0, 1, 2, 3, 4, 15, 16, 17]
  assert [r["step"] for r in read_jsonl(tmp_path / SAMPLES_FILE)] == list(range(5))


def test_resume_appends_and_drops_a_torn_last_line(tmp_path):
  with MetricsLogger(tmp_path, tensorboard=False) as log:
    log.log(0, {"x": 0.0})
  with open(tmp_path / METRICS_FILE, "a") as f:
    f.write('{"step": 1, "x":')  # a crash in the middle of a write
  with MetricsLogger(tmp_path, tensorboard=False) as log:
    log.log(1, {"x": 1.0})
  assert read_jsonl(tmp_path / METRICS_FILE) == [{"step": 0, "x": 0.0}, {"step": 1, "x": 1.0}]


def test_truncation_drops_unparseable_lines(tmp_path):
  (tmp_path / METRICS_FILE).write_text('{"step": 0}\nnot json\n{"step": 3}\n{"step": 1}\n{"st')
  MetricsLogger(tmp_path, tensorboard=False, truncate_after_step=1).close()
  assert read_jsonl(tmp_path / METRICS_FILE) == [{"step": 0}, {"step": 1}]


def test_step_given_as_an_array(tmp_path):
  with MetricsLogger(tmp_path, tensorboard=False) as log:
    log.log(jnp.int32(7), {"x": 1.0, "step": 99})
  assert read_jsonl(tmp_path / METRICS_FILE) == [{"step": 7, "x": 1.0}]


def test_wandb_is_optional(tmp_path, monkeypatch, caplog):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  with caplog.at_level(logging.WARNING, logger="jax_ppo.logging"):
    with MetricsLogger(tmp_path, tensorboard=False, wandb=True) as log:
      log.log(0, {"x": 1.0})
  assert "not installed" in caplog.text
  assert read_jsonl(tmp_path / METRICS_FILE) == [{"step": 0, "x": 1.0}]


def test_wandb_receives_metrics_when_installed(tmp_path, monkeypatch):
  calls = []

  class FakeRun:
    id = "abc123"

    def define_metric(self, name, **kwargs):
      calls.append(("define_metric", name, kwargs))

    def log(self, data):
      calls.append(("log", data))

    def finish(self):
      calls.append(("finish",))

  def init(**kwargs):
    calls.append(("init", kwargs))
    return FakeRun()

  monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
  with MetricsLogger(
      tmp_path, tensorboard=False, wandb=True, wandb_init={"project": "p"}, config={"lr": 1e-6}
  ) as log:
    log.log(3, {"objective/kl": jnp.float32(0.5), "h": jnp.arange(2)})
  assert calls == [
      ("init", {"project": "p", "dir": str(tmp_path), "config": {"lr": 1e-6}}),
      ("define_metric", "step", {}),
      ("define_metric", "*", {"step_metric": "step"}),
      ("log", {"step": 3, "objective/kl": 0.5}),  # the step as a metric, never W&B's step=
      ("finish",),
  ]
  assert (tmp_path / WANDB_ID_FILE).read_text() == "abc123\n"


class _WandbWatch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """A meta-path hook that counts every `import wandb` and serves `module` for it.

  Placed first on `sys.meta_path`, it sees the import before any real `wandb` could be found, so
  the tests behave the same whether or not W&B is installed, and never touch the network.
  """

  def __init__(self, module: types.ModuleType):
    self.module = module
    self.imports = 0

  def find_spec(self, name, path=None, target=None):
    if name != "wandb":
      return None
    self.imports += 1
    return importlib.util.spec_from_loader(name, self)

  def create_module(self, spec):
    return self.module

  def exec_module(self, module):
    pass


def _watch_wandb(monkeypatch) -> tuple[_WandbWatch, list]:
  """Removes any imported `wandb` and installs a `_WandbWatch` serving a fake module whose
  `init` records its keyword arguments and returns a run recording `log`/`finish` calls."""
  calls = []

  class FakeRun:
    id = "fake"

    def define_metric(self, name, **kwargs):
      pass

    def log(self, data):
      calls.append(("log", data))

    def finish(self):
      calls.append(("finish",))

  fake = types.ModuleType("wandb")
  fake.init = lambda **kwargs: calls.append(("init", kwargs)) or FakeRun()
  watch = _WandbWatch(fake)
  monkeypatch.delitem(sys.modules, "wandb", raising=False)
  monkeypatch.setattr(sys, "meta_path", [watch, *sys.meta_path])
  return watch, calls


def test_wandb_is_not_imported_unless_enabled(tmp_path, monkeypatch):
  watch, calls = _watch_wandb(monkeypatch)
  with MetricsLogger(tmp_path, tensorboard=True, progress=True, total_steps=2) as log:
    log.log(0, {"objective/kl": jnp.float32(0.5)})
    log.log_samples(0, ["p"], ["r"], [1.0])
    log.flush()
  assert watch.imports == 0 and calls == []
  assert "wandb" not in sys.modules
  assert [r["step"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [0]

  # The same hook does see the import once W&B is enabled (so the check above can fail).
  with MetricsLogger(tmp_path / "on", tensorboard=False, wandb=True) as log:
    log.log(1, {"objective/kl": 0.25})
  assert watch.imports == 1 and sys.modules["wandb"] is watch.module
  assert calls == [("init", {"dir": str(tmp_path / "on")}),
                   ("log", {"step": 1, "objective/kl": 0.25}), ("finish",)]


def test_importing_the_logging_package_does_not_import_wandb():
  """In a fresh interpreter: importing `jax_ppo.logging` and logging without W&B never runs
  `import wandb` (checked with the same meta-path hook, installed before the import)."""
  code = "\n".join([
      "import importlib.abc, importlib.util, sys, tempfile, types",
      inspect.getsource(_WandbWatch),
      "watch = _WandbWatch(types.ModuleType('wandb'))",
      "sys.meta_path.insert(0, watch)",
      "from jax_ppo.logging import MetricsLogger",
      "with MetricsLogger(tempfile.mkdtemp(), progress=True, total_steps=1) as log:",
      "  log.log(0, {'x': 1.0})",
      "assert watch.imports == 0 and 'wandb' not in sys.modules, watch.imports",
      "print('ok')",
  ])
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=pathlib.Path(__file__).resolve().parents[2])
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_progress_bar_shows_reward_and_kl(tmp_path, capsys):
  with MetricsLogger(tmp_path, tensorboard=False, progress=True, total_steps=4) as log:
    for step in range(4):
      log.log(step, {"objective/rlhf_reward": jnp.float32(1.5), "objective/kl": 0.25})
  err = capsys.readouterr().err
  assert "4/4" in err and "reward=1.5" in err and "kl=0.25" in err
