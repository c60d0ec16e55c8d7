"""One process of the multi-process `jax-ppo reward` test
(tests/reward_model/test_reward_multiprocess.py).

Usage:
  `multiprocess_reward.py ROOT NAME` (one process, all its devices), or
  `multiprocess_reward.py ROOT NAME PORT NUM_PROCESSES PROCESS_ID` (one process of a job joined
  through `jax.distributed` over 127.0.0.1).

Runs the command line `jax-ppo reward ROOT/config.yaml run_dir=ROOT/NAME` (train, evaluate,
normalise on policy samples drawn on the mesh, export to ROOT/NAME/hf_model). Every process
records (Python audit hook) each file it opened for writing, created, moved or deleted under
ROOT/NAME, and writes its exit code, the rows of every training batch it put into the global
arrays and those records to ROOT/NAME_processI.json.
"""

import json
import os
import pathlib
import sys

# Compiling dominates this test (a few steps of a tiny model): XLA:CPU's cheaper code generation
# roughly halves it; both runs compared use the same flags.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_backend_optimization_level=0",
                                    "--xla_llvm_disable_expensive_passes=true"]).strip()
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # the repository: tests.*

from tests.write_audit import record_writes  # noqa: E402

ROOT = pathlib.Path(sys.argv[1]).resolve()
NAME = sys.argv[2]
WRITES = record_writes(str(ROOT / NAME))

import jax  # noqa: E402

from jax_ppo.cli import main as cli  # noqa: E402
from jax_ppo.reward_model.trainer import RewardModelTrainer  # noqa: E402

ROWS: list[list[int]] = []
_place_rows = RewardModelTrainer.place_rows


def _recorded_place_rows(self, tree):
  """`RewardModelTrainer.place_rows`, recording how many rows of each batch this process held."""
  out = _place_rows(self, tree)
  first = jax.tree.leaves(out)[0]
  local = (sum(s.data.shape[0] for s in first.addressable_shards if s.replica_id == 0)
           if isinstance(first, jax.Array) else first.shape[0])  # (one process: host rows)
  ROWS.append([int(first.shape[0]), local])
  return out


RewardModelTrainer.place_rows = _recorded_place_rows


def main() -> None:
  argv = ["reward", str(ROOT / "config.yaml"), f"run_dir={ROOT / NAME}"]
  pid = 0
  if len(sys.argv) > 3:
    port, count, pid = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    argv += [f"distributed.coordinator_address=127.0.0.1:{port}",
             f"distributed.num_processes={count}", f"distributed.process_id={pid}",
             "distributed.initialization_timeout=120"]
  code = cli(argv)
  result = {"process": jax.process_index(), "processes": jax.process_count(),
            "devices": jax.device_count(), "code": code, "writes": WRITES, "rows": ROWS}
  (ROOT / f"{NAME}_process{pid}.json").write_text(json.dumps(result))
  if jax.process_count() > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
