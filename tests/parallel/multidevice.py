"""Runs a script in a fresh Python process that sees several fake CPU devices.

The pytest process has one CPU device and JAX fixes the device count when it starts, so every
test that needs a mesh runs a script of `tests/parallel/scripts/` (or any file) through
`run_on_devices`, with `XLA_FLAGS=--xla_force_host_platform_device_count=N`; the script prints
one JSON object on its last stdout line, which is returned.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"


def device_env(devices: int) -> dict[str, str]:
  """The environment of a child process with `devices` fake CPU devices (repo on the path)."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith(("--xla_force_host_platform_device_count",
                                "--xla_cpu_collective"))]
  # On a loaded CI machine the fake devices' threads can reach a collective far apart; XLA:CPU
  # aborts the process after its default rendezvous timeout, so the tests allow 10 minutes.
  env["XLA_FLAGS"] = " ".join([
      *flags, f"--xla_force_host_platform_device_count={devices}",
      "--xla_cpu_collective_timeout_seconds=600",
      "--xla_cpu_collective_call_terminate_timeout_seconds=600",
      "--xla_cpu_enable_concurrency_optimized_scheduler=false",
      # Compiling dominates these tests (a few steps of tiny models) and every comparison runs
      # both sides under the same flags: XLA:CPU's cheaper code generation roughly halves them.
      "--xla_backend_optimization_level=0",
  ])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


def run_on_devices(script: str | os.PathLike, *args: str, devices: int = 8,
                   timeout: float = 420) -> dict:
  """Runs `script` (a file name in `scripts/` or a path) with `args` on `devices` fake CPU
  devices and returns the JSON object printed on its last stdout line.

  Raises:
    AssertionError: the script failed (with its stderr tail) or printed no JSON.
  """
  path = pathlib.Path(script)
  if not path.is_absolute():
    path = SCRIPTS / path
  command = [sys.executable, str(path), *map(str, args)]
  for attempt in (1, 2):
    try:
      proc = subprocess.run(command, cwd=REPO, env=device_env(devices), capture_output=True,
                            text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
      if attempt == 2:
        raise
      continue
    # XLA:CPU's fake devices can deadlock in a collective on a loaded 2-core machine (threads
    # of all devices blocked in two different rendezvous): such a run is retried once.
    stuck = "rendezvous" in proc.stderr and proc.returncode != 0
    if not stuck:
      break
  if proc.returncode != 0:
    raise AssertionError(f"{path.name} {' '.join(map(str, args))} failed (exit "
                         f"{proc.returncode}):\n{proc.stderr[-4000:]}")
  lines = [line for line in proc.stdout.splitlines() if line.strip()]
  if not lines:
    raise AssertionError(f"{path.name} printed nothing; stderr:\n{proc.stderr[-2000:]}")
  return json.loads(lines[-1])


def assert_steps_and_evals_agree(result: dict, keys: set[str], tol: float, *,
                                 eval_pairs: int) -> None:
  """The single-device and mesh runs of a script (`result["history"]`: two lists of step
  metrics; `result["eval"]`: two evaluations) agree: two steps each with `keys` among their
  metrics, every metric within `tol` (absolute), the steps moved the training loss, and both
  evaluations cover `eval_pairs` pairs and agree within `tol`."""
  single, sharded = result["history"]
  assert len(single) == len(sharded) == 2
  for a, b in zip(single, sharded, strict=True):
    assert a.keys() == b.keys() and keys <= a.keys()
    for key in a:
      assert b[key] == pytest.approx(a[key], abs=tol), key
  assert abs(single[1]["train/loss"] - single[0]["train/loss"]) > 1e-3  # the steps moved
  eval1, eval8 = result["eval"]
  assert eval1["eval/pairs"] == eval8["eval/pairs"] == eval_pairs
  for key in eval1:
    assert eval8[key] == pytest.approx(eval1[key], abs=tol), key


def run_processes_of(script: str | os.PathLike, *args: str, num_processes: int,
                     devices_per_process: int, timeout: float = 420) -> list[str]:
  """Runs `script ARGS... PORT NUM_PROCESSES PROCESS_ID` in `num_processes` processes with
  `devices_per_process` fake CPU devices each (the script joins them through `jax.distributed`
  on 127.0.0.1:PORT); returns each process's output.

  Raises:
    AssertionError: a process failed or the job ran past `timeout` (with every output's tail).
  """
  import tempfile

  from jax_ppo.diagnostics.scale_check import free_port

  path = pathlib.Path(script)
  if not path.is_absolute():
    path = SCRIPTS / path
  port = str(free_port())
  env = device_env(devices_per_process)
  with tempfile.TemporaryDirectory() as tmp:
    logs = [open(pathlib.Path(tmp) / f"{i}.log", "w+", encoding="utf-8")  # noqa: SIM115
            for i in range(num_processes)]
    procs = [subprocess.Popen([sys.executable, str(path), *map(str, args), port,
                               str(num_processes), str(i)],
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
             for i, log in enumerate(logs)]
    failure = None
    try:
      for p in procs:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      failure = f"the job ran past {timeout} s"
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
    outputs = []
    for log in logs:
      log.seek(0)
      outputs.append(log.read())
      log.close()
  codes = [p.returncode for p in procs]
  if failure or any(codes):
    tails = "\n".join(f"--- process {i} ---\n{out[-4000:]}" for i, out in enumerate(outputs))
    raise AssertionError(f"{path.name}: {failure or f'exit codes {codes}'}\n{tails}")
  return outputs


def run_job_beside_reference(script: str | os.PathLike, root: str | os.PathLike, *,
                             devices: int) -> None:
  """Runs `script ROOT one` in one process with `devices` fake CPU devices (the reference) and,
  at the same time, `script ROOT two` as a job of 2 processes with `devices / 2` each (the
  reference runs beside the job: the job's processes often wait for each other in collectives).
  Each process writes `ROOT/<name>_process<id>.json` (`read_process_result`)."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    reference = pool.submit(run_on_devices, script, str(root), "one", devices=devices)
    run_processes_of(script, str(root), "two", num_processes=2,
                     devices_per_process=devices // 2)
    reference.result()


def read_process_result(root: str | os.PathLike, name: str, pid: int) -> dict:
  """The JSON that process `pid` of run `name` ("one" or "two") wrote into `root`."""
  return json.loads((pathlib.Path(root) / f"{name}_process{pid}.json").read_text())
