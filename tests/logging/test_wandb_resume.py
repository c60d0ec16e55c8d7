"""W&B runs that resume with their log folder: the run id kept in the folder
(`WANDB_ID_FILE`), `wandb.init(id=<kept>, resume="allow")` when a logger (or a run loop) opens the
folder again, the user's `id`/`resume` winning, and the step logged as a metric.

The real `wandb` package runs in offline mode (no network): it writes
`<folder>/wandb/offline-run-<time>-<id>/run-<id>.wandb`, whose history records are read back here.
"""

from __future__ import annotations

import json
import pathlib
import struct
import sys
import types

import jax.numpy as jnp
import pytest

from jax_ppo.logging import WANDB_ID_FILE, MetricsLogger
from tests.toy_stage import ToyStage

pytest.importorskip("wandb")  # the `test` extra installs it


@pytest.fixture
def offline(tmp_path, monkeypatch):
  """W&B in offline mode, silent, with every folder it writes under `tmp_path`."""
  for name in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_API_KEY", "WANDB_PROJECT"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.setenv("WANDB_CONSOLE", "off")
  for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
    monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))


def _kept_id(folder: pathlib.Path) -> str:
  return (folder / WANDB_ID_FILE).read_text().strip()


def _offline_runs(folder: pathlib.Path) -> dict[pathlib.Path, str]:
  """The offline run folders W&B wrote under `folder` (`offline-run-<time>-<id>`, with a `-1`
  suffix for a second one in the same second) -> the id of their run (`run-<id>.wandb`).

  Stops W&B's service process first (`wandb.teardown`): `run.finish()` may return before it
  has written the last records; the next `wandb.init` starts it again."""
  import wandb

  wandb.teardown()
  runs = {}
  for run in sorted((folder / "wandb").glob("offline-run-*")):
    (file,) = run.glob("run-*.wandb")
    assert f"-{file.stem[len('run-'):]}" in run.name
    runs[run] = file.stem[len("run-"):]
  return runs


def _records(path: pathlib.Path):
  """The protobuf records of a `.wandb` file: a 7-byte header (":W&B", magic, version), then
  LevelDB-log chunks (4-byte CRC, 2-byte length, 1-byte type) in 32 KiB blocks."""
  from wandb.proto import wandb_internal_pb2

  data = path.read_bytes()
  assert data[:4] == b":W&B"
  pos, block, parts = 7, 32768, b""
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:  # a block's tail too short for a header is padding
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    parts += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # a full record, or the last chunk of one
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      parts = b""
      yield record


def _history(run_folder: pathlib.Path) -> list[dict]:
  """The rows `run.log` wrote into one offline run folder, without W&B's own `_` keys."""
  (file,) = run_folder.glob("run-*.wandb")
  rows = []
  for record in _records(file):
    if record.WhichOneof("record_type") == "history":
      row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in record.history.item}
      rows.append({k: v for k, v in row.items() if not k.startswith("_")})
  return rows


def test_a_reopened_folder_continues_its_wandb_run_and_a_new_folder_starts_another(
    tmp_path, offline):
  run = tmp_path / "run"
  with MetricsLogger(run, tensorboard=False, wandb=True, wandb_init={"project": "p"}) as log:
    for step in range(3):
      log.log(step, {"loss": float(step)})
  first = _kept_id(run)
  ((folder, run_id),) = _offline_runs(run).items()
  assert run_id == first
  assert _history(folder) == [{"step": s, "loss": float(s)} for s in range(3)]

  # Resumed from the checkpoint of step 1: steps 2 and 3 are logged (step 2 again).
  with MetricsLogger(run, tensorboard=False, wandb=True, wandb_init={"project": "p"},
                     truncate_after_step=1) as log:
    for step in (2, 3):
      log.log(jnp.int32(step), {"loss": 10.0 + step})
  assert _kept_id(run) == first
  folders = _offline_runs(run)
  assert len(folders) == 2 and set(folders.values()) == {first}
  rows = [row for f in folders for row in _history(f)]
  assert rows[-2:] == [{"step": 2, "loss": 12.0}, {"step": 3, "loss": 13.0}]

  other = tmp_path / "other"
  with MetricsLogger(other, tensorboard=False, wandb=True) as log:
    log.log(0, {"loss": 1.0})
  assert _kept_id(other) != first
  assert list(_offline_runs(other).values()) == [_kept_id(other)]


def test_the_users_id_or_resume_wins_over_the_kept_id(tmp_path, monkeypatch):
  inits = []

  class FakeRun:
    def __init__(self, run_id):
      self.id = run_id

    def define_metric(self, name, **kwargs):
      pass

    def log(self, data):
      pass

    def finish(self):
      pass

  def init(**kwargs):
    inits.append(kwargs)
    return FakeRun(kwargs.get("id", "fresh"))

  monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
  monkeypatch.delenv("WANDB_RUN_ID", raising=False)
  monkeypatch.delenv("WANDB_RESUME", raising=False)
  (tmp_path / WANDB_ID_FILE).write_text("kept\n")

  def start(**init_kwargs):
    MetricsLogger(tmp_path, tensorboard=False, wandb=True, wandb_init=init_kwargs).close()
    return {k: v for k, v in inits.pop().items() if k != "dir"}

  assert start() == {"id": "kept", "resume": "allow"}
  assert start(id="mine") == {"id": "mine"}
  assert _kept_id(tmp_path) == "mine"  # the folder keeps the id its W&B run has
  assert start(resume="never") == {"resume": "never"}  # (the fake run's id is "fresh")
  assert _kept_id(tmp_path) == "fresh"
  monkeypatch.setenv("WANDB_RUN_ID", "from-env")
  assert start() == {}  # W&B reads the environment itself


def test_a_resumed_run_folder_continues_its_wandb_run(tmp_path, offline):
  with ToyStage(tmp_path, total_steps=4, wandb=True) as stage:
    stage.train(2)
  first = _kept_id(tmp_path)
  with ToyStage(tmp_path, total_steps=4, wandb=True) as stage:  # resumes from step 2
    assert stage.step_count == 2
    stage.train(2)
  assert _kept_id(tmp_path) == first
  folders = _offline_runs(tmp_path)
  assert len(folders) == 2 and set(folders.values()) == {first}
  rows = [row for f in folders for row in _history(f)]
  assert [(r["step"], r["w"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
