"""Two processes (2 fake CPU devices each) over 127.0.0.1: a run folder must be one folder that
both processes see (`check_shared_folder`: a folder of each process's own is refused on both), an
Orbax checkpoint of an array
sharded over both processes' devices saves and restores with every process taking part, a
damaged step is moved aside by process 0 alone (`RunCheckpointer.set_aside`), only process 0
writes logs, and a preemption notice (SIGTERM) sent to process 1 stops both processes
at the same step (`jax_ppo.parallel.distributed.preemption_notice`). The processes run
tests/parallel/multihost_worker.py."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from jax_ppo.diagnostics.scale_check import free_port

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
ROOT = WORKER.parents[2]


@pytest.mark.slow
def test_checkpoint_logs_and_preemption_over_two_processes(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
  port = str(free_port())
  logs = [open(tmp_path / f"log{i}", "w+", encoding="utf-8") for i in range(2)]  # noqa: SIM115
  procs = [subprocess.Popen([sys.executable, str(WORKER), port, str(i), str(tmp_path)], env=env,
                            stdout=logs[i], stderr=subprocess.STDOUT) for i in range(2)]
  try:
    deadline = time.monotonic() + 150
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
      assert all(p.poll() is None for p in procs), _output(logs)
      assert time.monotonic() < deadline, "the processes did not get ready:\n" + _output(logs)
      time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)  # the preemption notice reaches one process only
    for p in procs:
      p.wait(timeout=60)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert [p.returncode for p in procs] == [0, 0], _output(logs)
  results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(2)]
  for i, r in enumerate(results):
    assert r["process"] == i and r["devices"] == 4 and r["multi"] and r["main"] == (i == 0)
    assert r["shared_left"] == []  # the check's file is removed
    assert r["own_error"].startswith(f"RunConfig.run_dir={str(tmp_path / f'own{i}')!r} is not "
                                     f"one folder shared by every process")
    assert "process(es) [1] of 2 do not see the file" in r["own_error"]
    assert r["restored_sharding_ok"] and r["restored_equal"]
    assert r["extra"] == {"data_position": 3}  # step 2 was damaged: step 1 restored
    assert r["steps_after_restore"] == [1]
  assert results[0]["moves"] == [["checkpoints/2", "checkpoints/corrupt/2"]]
  assert results[1]["moves"] == []
  stops = [r["stopped_at"] for r in results]
  assert stops[0] is not None and stops[0] == stops[1]  # the same step on both
  assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.25}\n'
  assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
      "metrics.jsonl", "samples.jsonl", "tensorboard"]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "corrupt"]
  assert sorted(p.name for p in (tmp_path / "checkpoints" / "corrupt").iterdir()) == ["2"]


def _output(logs) -> str:
  text = []
  for i, log in enumerate(logs):
    log.flush()
    log.seek(0)
    text.append(f"--- process {i} ---\n{log.read()[-3000:]}")
  return "\n".join(text)
