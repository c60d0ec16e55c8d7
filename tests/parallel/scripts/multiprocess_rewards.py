"""One process of tests/parallel/test_multiprocess_rewards.py.

    multiprocess_rewards.py OUT_DIR PORT NUM_PROCESSES PROCESS_ID

Joins a job of 2 processes x 2 fake CPU devices, builds a global rollout of 8 rows split over the
4 devices (each process fills its rows, `host_rows.global_rows`) and scores it with Python
reward functions of token ids (`FunctionScorer`, alone and in a `CombinedScorer`), then with one
that returns NaN on the first row of process 1 only, then asks for a trainer without a mesh;
writes what it saw to OUT_DIR/resultI.json.
"""

import json
import pathlib
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_ppo.parallel import MeshConfig, host_rows, make_mesh, rules
from jax_ppo.parallel.distributed import DistributedConfig, initialize
from jax_ppo.rewards.scorers import CombinedScorer, FunctionScorer
from jax_ppo.rollout.sampler import Rollout
from jax_ppo.runs.ppo import build_trainer
from jax_ppo.runs.ppo_config import RunConfig


def main(out: pathlib.Path, port: str, count: int, pid: int) -> None:
  initialize(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=count,
                               process_id=pid, initialization_timeout=60))
  mesh = make_mesh(MeshConfig(data=-1))
  rng = np.random.default_rng(0)  # the same global rollout on every process
  b, s, t = 8, 3, 4
  host = Rollout(
      prompt_ids=rng.integers(3, 20, (b, s)).astype(np.int32),
      prompt_mask=np.ones((b, s), np.int32),
      response_ids=rng.integers(3, 20, (b, t)).astype(np.int32),
      response_mask=np.arange(t)[None] < rng.integers(1, t + 1, (b, 1)),
      logprobs=np.zeros((b, t), np.float32),
      positions=np.tile(np.arange(s + t, dtype=np.int32), (b, 1)),
      has_stop=np.zeros(b, bool),
  )
  shardings = rules.batch_shardings(host, mesh)
  start, stop = host_rows.local_row_range(shardings.response_ids, (b, t))
  rollout = jax.tree.map(lambda x, sh: host_rows.global_rows(x[start:stop], sh, x.shape), host,
                         shardings)
  seen = []

  def total(prompts, responses):
    seen.append(len(responses))
    return [float(sum(r)) for r in responses]

  def nan_on_process_1(prompts, responses):
    return [float("nan") if pid == 1 and i == 0 else 0.0 for i in range(len(responses))]

  result = {"rows": [start, stop], "global": host_rows.is_global(rollout.response_ids)}
  result["scores"] = host_rows.gathered(FunctionScorer(total)(rollout)).tolist()
  combined = CombinedScorer([("total", FunctionScorer(total), 2.0)])
  result["combined"] = host_rows.gathered(combined(rollout)).tolist()
  result["metric"] = combined.metrics()["reward/total"]
  result["expected"] = np.where(host.response_mask, host.response_ids, 0).sum(1).tolist()
  result["rows_seen"] = seen
  try:
    FunctionScorer(nan_on_process_1, name="nan_on_process_1")(rollout)
    result["error"] = None
  except Exception as e:  # noqa: BLE001 - recorded for the test
    result["error"] = [type(e).__name__, str(e)]
  multihost_utils.sync_global_devices("after the failure")  # no process was left waiting
  folder = out / f"model{pid}"  # (only its config.json is looked at before the refusal)
  folder.mkdir()
  (folder / "config.json").write_text("{}")
  (folder / "prompts.txt").write_text("the movie was\n")
  try:
    build_trainer(RunConfig(policy_path=str(folder), prompts_path=str(folder / "prompts.txt"),
                            run_dir=str(out / f"run{pid}"), reward_function="length"))
    result["no_mesh"] = None
  except ValueError as e:
    result["no_mesh"] = str(e)
  from jax_ppo.parallel import PlacementConfig, RoleMesh
  try:  # roles on sub-meshes of their own: single-process only, refused before any model loads
    build_trainer(RunConfig(
        policy_path=str(folder), prompts_path=str(folder / "prompts.txt"),
        run_dir=str(out / f"run{pid}"), reward_function="length", mesh=MeshConfig(data=2),
        placement=PlacementConfig(policy_devices=(0, 2),
                                  reference=RoleMesh(devices=(2, 4), mesh=MeshConfig(data=2)))))
    result["split_roles"] = None
  except ValueError as e:
    result["split_roles"] = str(e)
  (out / f"result{pid}.json").write_text(json.dumps(result))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
