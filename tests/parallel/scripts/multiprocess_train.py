"""One process of the multi-process `jax-ppo train` test (test_multiprocess_train.py).

Usage:
  `multiprocess_train.py ROOT NAME` (one process, all its devices), or
  `multiprocess_train.py ROOT NAME PORT NUM_PROCESSES PROCESS_ID` (one process of a job joined
  through `jax.distributed` over 127.0.0.1).

Runs the command line `jax-ppo train ROOT/config.yaml run_dir=ROOT/NAME ...` twice (2 updates,
then the resume to `ppo.total_updates=3`), rebuilds a bare trainer on the final checkpoint,
exports its policy to ROOT/NAME_export, evaluates the final checkpoint greedily on the prompts
(`evaluate_run`, ROOT/NAME/eval/step_3.json), and writes, from process 0, the trained parameters
(gathered from every process) to ROOT/NAME_params.npz. Every process records (Python audit
hook) each file it opened for writing, created, moved or deleted under ROOT/NAME and
ROOT/NAME_export, and writes its findings to ROOT/NAME_processI.json, with the prompt batches
it read (`PromptDataset.batch`: position, batch size, shard index and count, rows) and the
number of prompts each batch tokenized (a lazy dataset, several processes).
"""

import json
import os
import pathlib
import sys

# Compiling dominates this test (a few updates of a tiny model): XLA:CPU's cheaper code
# generation roughly halves it; both runs compared use the same flags.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_backend_optimization_level=0",
                                    "--xla_llvm_disable_expensive_passes=true"]).strip()
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # tests/: tiny_hf_run
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # the repository: tests.*

from tests.write_audit import record_writes  # noqa: E402

ROOT = pathlib.Path(sys.argv[1]).resolve()
NAME = sys.argv[2]
WRITES = record_writes(str(ROOT / NAME), str(ROOT / f"{NAME}_export"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_ppo.cli import main as cli  # noqa: E402
from jax_ppo.data.prompts import PromptDataset  # noqa: E402
from jax_ppo.runs.ppo import build_trainer, evaluate_run  # noqa: E402
from jax_ppo.runs.ppo_config import saved_run_config  # noqa: E402

BATCHES: list[list] = []
_batch = PromptDataset.batch


def _recorded_batch(self, position, batch_size, *, shard=None):
  """`PromptDataset.batch`, recording `[position, batch_size, shard index, shard count, rows]`."""
  prompts, texts = _batch(self, position, batch_size, shard=shard)
  BATCHES.append([position, batch_size, None if shard is None else shard.shard_index,
                  None if shard is None else shard.shard_count, len(prompts)])
  return prompts, texts


PromptDataset.batch = _recorded_batch
TOKENIZED: list[int] = []
_tokenized = PromptDataset._tokenized


def _recorded_tokenized(self, idx):
  """`PromptDataset._tokenized` (a lazy dataset), recording how many prompts it tokenized."""
  TOKENIZED.append(sum(self.prompts[i] is None for i in set(idx)))
  _tokenized(self, idx)


PromptDataset._tokenized = _recorded_tokenized


def main() -> None:
  argv = ["train", str(ROOT / "config.yaml"), f"run_dir={ROOT / NAME}"]
  pid = 0
  if len(sys.argv) > 3:
    port, count, pid = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    argv += [f"distributed.coordinator_address=127.0.0.1:{port}",
             f"distributed.num_processes={count}", f"distributed.process_id={pid}",
             "distributed.initialization_timeout=120"]
  codes = [cli([*argv, "run.updates_per_run=2"]), cli(argv)]  # 2 updates, then the resume
  config = saved_run_config(ROOT / NAME)
  trainer = build_trainer(config, open_run=False)
  step = trainer.load_checkpoint(ROOT / NAME)
  params = trainer.state.params
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    params = multihost_utils.process_allgather(params, tiled=True)
  flat = {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  trainer.export(ROOT / f"{NAME}_export")
  evaluate_run(ROOT / NAME, ROOT / "prompts.jsonl")  # (greedy; writes NAME/eval/step_3.json)
  if jax.process_index() == 0:
    np.savez(ROOT / f"{NAME}_params.npz", **flat)
  result = {"process": jax.process_index(), "processes": jax.process_count(),
            "devices": jax.device_count(), "codes": codes, "step": step, "writes": WRITES,
            "batches": BATCHES, "tokenized": TOKENIZED,
            "retokenize": [getattr(scorer, "retokenize", None)
                           for _, scorer, _ in trainer.scorer.sources]}
  (ROOT / f"{NAME}_process{pid}.json").write_text(json.dumps(result))
  if jax.process_count() > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
