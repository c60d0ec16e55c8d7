"""One process of the multi-process `jax-ppo sft` test (tests/sft/test_sft_multiprocess.py).

Usage:
  `multiprocess_sft.py ROOT NAME` (one process, all its devices), or
  `multiprocess_sft.py ROOT NAME PORT NUM_PROCESSES PROCESS_ID` (one process of a job joined
  through `jax.distributed` over 127.0.0.1).

Runs the command line `jax-ppo sft ROOT/config.yaml run_dir=ROOT/NAME ...` twice (2 steps, then
the resume to `sft.total_steps`, the held-out evaluation and the export to ROOT/NAME/hf_model),
keeping the JSON summary each call prints.
Every process records (Python audit hook) each file it opened for writing, created, moved or
deleted under ROOT/NAME, and the rows it placed into each global batch
(`jax_ppo.parallel.host_rows.global_rows`: this process's rows, the global rows), and writes its
findings to ROOT/NAME_processI.json.
"""

import contextlib
import io
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
from jax_ppo.parallel import host_rows  # noqa: E402

PLACED: list[list[int]] = []
_global_rows = host_rows.global_rows


def _recorded_global_rows(local, sharding, shape):
  """`host_rows.global_rows`, recording `[this process's rows, global rows]`."""
  PLACED.append([int(local.shape[0]), int(shape[0])])
  return _global_rows(local, sharding, shape)


host_rows.global_rows = _recorded_global_rows


def main() -> None:
  argv = ["sft", str(ROOT / "config.yaml"), f"run_dir={ROOT / NAME}"]
  pid = 0
  if len(sys.argv) > 3:
    port, count, pid = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    argv += [f"distributed.coordinator_address=127.0.0.1:{port}",
             f"distributed.num_processes={count}", f"distributed.process_id={pid}",
             "distributed.initialization_timeout=120"]
  codes, summaries = [], []
  for args in ([*argv, "run.steps_per_run=2"], argv):  # 2 steps, then the resume and the export
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      codes.append(cli(args))
    summaries.append(json.loads([line for line in out.getvalue().splitlines()
                                 if line.startswith("{")][-1]))
  result = {"process": jax.process_index(), "processes": jax.process_count(),
            "devices": jax.device_count(), "codes": codes, "summaries": summaries,
            "writes": WRITES, "placed": PLACED}
  (ROOT / f"{NAME}_process{pid}.json").write_text(json.dumps(result))
  print(json.dumps({"codes": codes}))
  if jax.process_count() > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
