"""Multi-host runs: `jax.distributed` set-up from a config or the environment, process-0-only
side effects, per-process RNG streams and the preemption notice.

A multi-host (multi-controller) JAX job runs the same program in one process per host; each
process sees its local devices and `jax.devices()` lists all of them. Before any JAX computation
every process calls `initialize(config)`, which calls `jax.distributed.initialize`:

* with the config's `coordinator_address` ("host:port" of process 0), `num_processes` and
  `process_id` (and optionally `local_device_ids`), e.g. on a GPU cluster launched by hand or by
  SkyPilot (tpu/skypilot.yaml);
* with none of them, from the environment: JAX's own `JAX_COORDINATOR_ADDRESS` /
  `JAX_LOCAL_DEVICE_IDS`, and its cluster auto-detection (Cloud TPU VM metadata, SLURM, Open MPI,
  Kubernetes), so on a TPU slice `jax.distributed.initialize()` with no argument is enough.

`DistributedConfig.mode` "auto" (the default) initializes only when the config names a
coordinator or the environment says the job is distributed (`distributed_environment`); a plain
single-process run never touches `jax.distributed`. `initialize` is idempotent.

After it: only process 0 writes logs and other non-checkpoint files (`is_main_process`; the others
wait at a `barrier` where a file must be complete before anyone goes on, and gather what process 0
writes with `host_array`, tensor by tensor), every process takes part in Orbax checkpoint saves
(Orbax writes each array shard once and the metadata from the primary host), and
`preemption_notice(step)` tells every process, at the same step, that one of them received a
preemption notice (SIGTERM), through JAX's preemption sync point.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re
import secrets
import signal
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

logger = logging.getLogger("jax_ppo.parallel")

MODES = ("auto", "on", "off")
"""`DistributedConfig.mode` values."""

ENV_FLAG = "JAX_PPO_DISTRIBUTED"
"""Environment variable that makes mode "auto" initialize (set to 1 by tpu/launch.sh, where the
TPU metadata, not the environment, describes the slice)."""

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
  """How a process joins a multi-host job (`RunConfig.distributed`, `jax_ppo.parallel`)."""

  mode: str = "auto"
  """"auto": initialize when a field below is set or the environment describes a distributed job
  (`distributed_environment`); "on": always call `jax.distributed.initialize` (unset fields are
  auto-detected by JAX, e.g. on a TPU slice); "off": never (a single-process run)."""
  coordinator_address: str | None = None
  """"host:port" of process 0's coordinator, reachable from every process (e.g.
  "10.0.0.2:12355"); None: from `JAX_COORDINATOR_ADDRESS` or JAX's cluster detection."""
  num_processes: int | None = None
  """Number of processes in the job (usually one per host); None: auto-detected."""
  process_id: int | None = None
  """This process's index, 0 <= process_id < num_processes; None: auto-detected."""
  local_device_ids: tuple[int, ...] | None = None
  """Local devices this process uses (e.g. [0] for one process per GPU); None: all of them."""
  initialization_timeout: int = 300
  """Seconds to wait for every process to join before failing."""

  def __post_init__(self):
    def bad(field: str, fix: str):
      raise ValueError(f"DistributedConfig.{field}={getattr(self, field)!r} is invalid: {fix}.")

    if self.mode not in MODES:
      bad("mode", f"choose one of {list(MODES)}")
    if self.coordinator_address is not None and (
        not isinstance(self.coordinator_address, str)
        or not _ADDRESS.match(self.coordinator_address)
        or not 0 < int(_ADDRESS.match(self.coordinator_address).group(2)) < 65536):
      bad("coordinator_address", 'give "host:port" of process 0, e.g. "10.0.0.2:12355"')
    if self.num_processes is not None and not _is_int(self.num_processes, low=1):
      bad("num_processes", "use an int >= 1 or null (auto-detect)")
    if self.process_id is not None and not _is_int(self.process_id, low=0):
      bad("process_id", "use an int >= 0 or null (auto-detect)")
    if (self.process_id is not None and self.num_processes is not None
        and self.process_id >= self.num_processes):
      bad("process_id", f"it must be below num_processes={self.num_processes}")
    if self.local_device_ids is not None and (
        not isinstance(self.local_device_ids, tuple) or not self.local_device_ids
        or not all(_is_int(i, low=0) for i in self.local_device_ids)):
      bad("local_device_ids", "give a non-empty list of device ids >= 0, or null (all)")
    if not _is_int(self.initialization_timeout, low=1):
      bad("initialization_timeout", "use an int >= 1 (seconds)")
    if self.mode == "off" and self.explicit:
      bad("mode", "it is 'off' but coordinator_address/num_processes/process_id/"
                  "local_device_ids are set; use mode 'auto' or 'on', or drop those fields")

  @property
  def explicit(self) -> bool:
    """Whether any connection field is set."""
    return any(v is not None for v in (self.coordinator_address, self.num_processes,
                                       self.process_id, self.local_device_ids))


def _is_int(value: object, *, low: int) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= low


def distributed_environment(environ: Mapping[str, str] | None = None) -> str | None:
  """The environment variable that marks this process as part of a multi-process job, or None.

  Recognised: `JAX_PPO_DISTRIBUTED=1` (tpu/launch.sh), `JAX_COORDINATOR_ADDRESS` (JAX's own),
  `SLURM_NTASKS` > 1 and `OMPI_COMM_WORLD_SIZE` > 1 (JAX auto-detects SLURM and Open MPI jobs).
  """
  env = os.environ if environ is None else environ
  if env.get(ENV_FLAG, "").strip() not in ("", "0"):
    return ENV_FLAG
  if env.get("JAX_COORDINATOR_ADDRESS"):
    return "JAX_COORDINATOR_ADDRESS"
  for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    value = env.get(name, "")
    if value.isdigit() and int(value) > 1:
      return name
  return None


def initialize(config: DistributedConfig | None = None, *,
               environ: Mapping[str, str] | None = None) -> bool:
  """Joins the multi-host job described by `config` and the environment (see the module doc).

  Call it in every process before any JAX computation. Idempotent: once `jax.distributed` is
  initialized (by this function or by the caller) it returns at once, after checking that a
  given `num_processes`/`process_id` match.

  Returns:
    True when `jax.distributed` is initialized on return, False for a single-process run.

  Raises:
    ValueError: a JAX computation already ran in this process (too late to join), or the job
      that is already initialized differs from `config`.
    RuntimeError: the coordinator could not be reached within `initialization_timeout`.
  """
  config = DistributedConfig() if config is None else config
  if jax.distributed.is_initialized():
    for field, actual in (("num_processes", jax.process_count()),
                          ("process_id", jax.process_index())):
      wanted = getattr(config, field)
      if wanted is not None and wanted != actual:
        raise ValueError(f"DistributedConfig.{field}={wanted} but jax.distributed is already "
                         f"initialized with {field}={actual}; give the same values.")
    return True
  if config.mode == "off":
    return False
  if config.mode == "auto" and not config.explicit:
    source = distributed_environment(environ)
    if source is None:
      return False
    logger.info("Joining a multi-process job (%s is set).", source)
  kwargs = {
      "coordinator_address": config.coordinator_address,
      "num_processes": config.num_processes,
      "process_id": config.process_id,
      "local_device_ids": (None if config.local_device_ids is None
                           else list(config.local_device_ids)),
      "initialization_timeout": config.initialization_timeout,
  }
  try:
    jax.distributed.initialize(**kwargs)
  except RuntimeError as e:
    if "must be called before" in str(e):
      raise ValueError(
          "jax.distributed must be initialized before any JAX computation; call "
          "jax_ppo.parallel.distributed.initialize(config) first in the program (jax-ppo "
          f"train/sft/reward do). JAX said: {e}") from e
    raise
  logger.info("jax.distributed initialized: process %d of %d, %d local of %d devices.",
              jax.process_index(), jax.process_count(), jax.local_device_count(),
              jax.device_count())
  return True


def is_main_process() -> bool:
  """True on process 0 (the only one that writes logs, samples, plots and exported models)."""
  return jax.process_index() == 0


def multi_process() -> bool:
  """True when more than one process takes part in the computation."""
  return jax.process_count() > 1


def require_mesh(mesh: Any, *, config_field: str, trainer: str) -> None:
  """Raises a ValueError naming the fix when this is one of several processes and `mesh` is None:
  a multi-process run trains on one device mesh over every process's devices (alone, each
  process would train the whole model on its own).

  Args:
    mesh: the trainer's mesh, or None.
    config_field: the run-config field that sets it (e.g. "SFTRunConfig.mesh").
    trainer: the trainer class that takes it (e.g. "SFTTrainer").
  """
  if mesh is None and multi_process():
    raise ValueError(
        f"This is process {jax.process_index()} of {jax.process_count()}: a multi-process run "
        f"trains on one device mesh over every process's devices; give a mesh ({config_field}, "
        f"e.g. mesh.data=-1, or {trainer}(mesh=jax_ppo.parallel.make_mesh(...))).")


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (`multihost_utils.
  sync_global_devices`); nothing on one process. Process 0 writes a file, moves or deletes one
  (exports, damaged checkpoints set aside), then every process passes the same barrier, so no
  process reads the folder before it is complete or races another on the file system."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  multihost_utils.sync_global_devices(name)


SHARED_CHECK_PREFIX = ".jax_ppo_shared_check."
"""Name prefix of the file `check_shared_folder` writes and removes (a fresh token follows)."""


def check_shared_folder(path: str | os.PathLike, *, field: str, wait_s: float = 20.0) -> None:
  """Raises a ValueError on every process, naming `field` and the processes concerned, when the
  processes of a multi-process job do not see one and the same folder at `path`; nothing in a
  single-process run.

  Every process writes its shards of each Orbax checkpoint into the run folder and process 0 the
  checkpoint's metadata, so a run folder on each host's own disk (e.g. /tmp on each node of a
  cluster) would leave checkpoints no host can restore. Process 0 writes a file named by a
  token drawn for this call into `path` (created if missing); after a barrier every process looks
  for it, for up to `wait_s` seconds (a network file system or a mounted bucket may show a new
  file late); the processes then gather who saw it, process 0 removes the file, and all of them
  raise the same error, or none does.

  Args:
    path: the folder every process must see (e.g. `RunConfig.run_dir`).
    field: the config field that names it, for the error (e.g. "RunConfig.run_dir").
    wait_s: how long a process keeps looking for process 0's file before it counts as unseen.
  """
  if not multi_process():
    return
  from jax.experimental import multihost_utils

  path = pathlib.Path(path)
  token = int(multihost_utils.broadcast_one_to_all(np.int32(secrets.randbelow(2**31 - 1))))
  marker = path / f"{SHARED_CHECK_PREFIX}{token}"
  if is_main_process():
    path.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"written by process 0 of this job ({field})\n")
  barrier(f"check_shared_folder {field} {token}: written")  # (the paths may differ)
  deadline = time.monotonic() + wait_s
  seen = marker.is_file()
  while not seen and time.monotonic() < deadline:
    time.sleep(0.5)
    seen = marker.is_file()
  seen_by = np.asarray(multihost_utils.process_allgather(np.asarray(seen))).reshape(-1)
  if is_main_process():
    marker.unlink(missing_ok=True)
  barrier(f"check_shared_folder {field} {token}: checked")
  blind = [int(i) for i in np.flatnonzero(~seen_by.astype(bool))]
  if blind:
    raise ValueError(
        f"{field}={str(path)!r} is not one folder shared by every process of this job: "
        f"process(es) {blind} of {len(seen_by)} do not see the file process 0 wrote there (each "
        f"host has a folder of its own at that path). Every process writes its shards of each "
        f"checkpoint into the run folder, so give a folder every host sees: a network file "
        f"system or a bucket mounted on every host (e.g. SkyPilot's file_mounts).")


def host_array(x: Any) -> np.ndarray:
  """The whole of array `x` on this host: `np.asarray(x)`, or, for a `jax.Array` with shards on
  other processes' devices, an all-gather (`multihost_utils.process_allgather`) that every
  process must call, in the same order (e.g. tensor by tensor while process 0 writes them)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)  # (a replicated array: every process holds all of it)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def process_key(key: jax.Array) -> jax.Array:
  """`fold_in(key, process_index)`: an RNG stream of this process's own.

  For host-side sampling where each process draws its own rows (its data shard); keys of jitted
  computations over global arrays stay the same on every process (they must: the program is
  one SPMD program). On one process this is still a fold-in of 0, so the stream of process 0 is
  the same whatever the process count.
  """
  return jax.random.fold_in(key, jax.process_index())


def preemption_notice(step: int) -> int | None:
  """`signal.SIGTERM` when every process has reached the preemption sync point at `step`.

  When any process of a multi-process job receives a preemption notice (SIGTERM, caught by JAX's
  preemption service), the processes agree on a step to stop at (the largest current step + 1);
  this returns SIGTERM on every process at that step, and None otherwise. Call it on every
  process at every step, with the same step numbers (Orbax's `PreemptionCheckpointingPolicy`,
  used by `RunCheckpointer`, asks at the same steps and saves there). None in a single-process
  run (the run loop's own signal handlers handle SIGTERM/SIGINT there) or when the preemption
  service is disabled (`jax_enable_preemption_service`).
  """
  if not jax.distributed.is_initialized() or jax.process_count() == 1:
    return None
  from jax.experimental import multihost_utils

  try:
    reached = multihost_utils.reached_preemption_sync_point(int(step))
  except RuntimeError:  # the preemption service is disabled
    return None
  return signal.SIGTERM if reached else None


__all__ = [
    "DistributedConfig",
    "ENV_FLAG",
    "SHARED_CHECK_PREFIX",
    "barrier",
    "check_shared_folder",
    "distributed_environment",
    "host_array",
    "initialize",
    "is_main_process",
    "multi_process",
    "preemption_notice",
    "process_key",
]
