"""One process of tests/parallel/test_multiprocess_io.py (run as a script, never imported by
pytest: its name does not start with test_).

    python multihost_worker.py PORT PROCESS_ID OUT_DIR

Joins a 2-process job over 127.0.0.1 (2 fake CPU devices each), then: checks a run folder both
processes see (`check_shared_folder`) and one of each process's own (refused on both), saves
steps 1 and 2 of an array sharded over all 4 devices with `RunCheckpointer` (every process calls
save), damages step 2 (process 0 deletes its metadata item) and restores the latest readable
step, 1 (every process restores; only process 0 may move step 2 into corrupt/, each process
records its moves),
logs one step with `MetricsLogger` into OUT_DIR/run (only process 0 may write), writes OUT_DIR/
readyI, and polls `preemption_notice(step)` every 50 ms until it fires (the test sends SIGTERM to
one process). Its findings go to OUT_DIR/resultI.json.
"""

import json
import pathlib
import shutil
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jax_ppo.checkpoint import RunCheckpointer
from jax_ppo.logging import MetricsLogger
from jax_ppo.parallel.distributed import (
    DistributedConfig,
    check_shared_folder,
    initialize,
    is_main_process,
    multi_process,
    preemption_notice,
)

MOVES: list[list[str]] = []


def _audit(event: str, args: tuple) -> None:
  if event == "os.rename" and "checkpoints" in str(args[0]):
    MOVES.append([str(args[0]), str(args[1])])


def main(port: str, pid: int, out: pathlib.Path) -> None:
  assert initialize(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                      process_id=pid, initialization_timeout=60))
  assert initialize(DistributedConfig(num_processes=2, process_id=pid))  # idempotent
  result = {"process": jax.process_index(), "devices": jax.device_count(),
            "main": is_main_process(), "multi": multi_process()}
  check_shared_folder(out / "shared", field="RunConfig.run_dir", wait_s=0)
  result["shared_left"] = sorted(p.name for p in (out / "shared").iterdir())
  try:  # a folder of its own on each "host": every process refuses it, naming process 1
    check_shared_folder(out / f"own{pid}", field="RunConfig.run_dir", wait_s=1)
    result["own_error"] = None
  except ValueError as e:
    result["own_error"] = str(e)
  mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
  host = np.arange(32, dtype=np.float32).reshape(8, 4)
  w = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
  with RunCheckpointer(out / "checkpoints", async_save=False) as ckpt:
    ckpt.save(1, {"w": w}, {"loss": 0.5}, {"data_position": 3})
    ckpt.save(2, {"w": w}, {"loss": 0.5}, {"data_position": 4})
  if pid == 0:
    shutil.rmtree(out / "checkpoints" / "2" / "meta")
  multihost_utils.sync_global_devices("damaged")
  sys.addaudithook(_audit)  # (from here on: the moves of the restore)
  with RunCheckpointer(out / "checkpoints") as ckpt:
    state, extra = ckpt.restore(like={"w": w})
    result["steps_after_restore"] = ckpt.steps()
  result["moves"] = [[pathlib.Path(a).relative_to(out).as_posix(),
                      pathlib.Path(b).relative_to(out).as_posix()] for a, b in MOVES]
  result["restored_sharding_ok"] = state["w"].sharding == sharding
  result["restored_equal"] = all(
      np.array_equal(np.asarray(s.data), host[s.index]) for s in state["w"].addressable_shards)
  result["extra"] = extra
  with MetricsLogger(out / "run", tensorboard=True) as log:
    log.log(1, {"loss": 0.25 + pid})
  (out / f"ready{pid}").write_text("1")
  stop = None
  for step in range(2400):
    if preemption_notice(step):
      stop = step
      break
    time.sleep(0.05)
  result["stopped_at"] = stop
  (out / f"result{pid}.json").write_text(json.dumps(result))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3]))
