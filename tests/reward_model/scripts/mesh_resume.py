"""A reward-model run on a mesh, stopped after 2 of 4 steps and resumed on another mesh, against
the uninterrupted run (tests/reward_model/test_mesh.py; a subprocess with 8 fake CPU devices).

Usage: `mesh_resume.py RUN_DIR`. The first invocation trains on (data=2, fsdp=2, tensor=2) and
checkpoints at step 2; the resumed one restores into the shardings of (data=2, fsdp=4,
tensor=1) and trains to step 4. Prints JSON with the largest parameter and optimizer-state
differences to an uninterrupted 4-step run on the first mesh, the steps of each run, the
metrics the run folder logged and the resumed parameters' shardings.
"""

import faulthandler
import json
import pathlib
import sys

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sharded_step import EOS, MODEL, max_abs_diff, records  # noqa: E402

from jax_ppo.models.heads import ScalarModel  # noqa: E402
from jax_ppo.parallel import MeshConfig, make_mesh  # noqa: E402
from jax_ppo.reward_model import (  # noqa: E402
  RewardModelConfig,
  RewardModelOptimizer,
  RewardModelTrainer,
)
from jax_ppo.training.loop import RunOptions  # noqa: E402


def trainer(mesh, run_dir=None):
  config = RewardModelConfig(
      batch_size=8, gradient_accumulation_steps=2, total_steps=4, max_length=16,
      eos_token_id=EOS, optimizer=RewardModelOptimizer(learning_rate=0.1, lr_schedule="constant",
                                                       adam_eps=1.0))
  options = RunOptions(save_every=2, progress=False, tensorboard=False,
                       async_checkpointing=False)
  return RewardModelTrainer(config, ScalarModel(MODEL, rngs=nnx.Rngs(0)),
                            train_data=records(20, 0), mesh=mesh, run_dir=run_dir,
                            run_options=options)


def main(run_dir: str) -> None:
  faulthandler.dump_traceback_later(600, exit=True)
  first_mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  other_mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
  straight = trainer(first_mesh)
  straight.train()
  with trainer(first_mesh, run_dir) as first:
    first.train(2)
    first_steps = first.step_count
  with trainer(other_mesh, run_dir) as resumed:
    restored_at = resumed.step_count
    resumed.train()
    leaves = jax.tree.leaves(resumed.state.params)
    out = {
        "steps": [first_steps, restored_at, resumed.step_count, straight.step_count],
        "max_param_diff": max_abs_diff(straight.state.params, resumed.state.params),
        "max_opt_diff": max_abs_diff(straight.state.opt_state, resumed.state.opt_state),
        "resumed_mesh": dict(resumed.mesh.shape),
        "param_specs": sorted({str(x.sharding.spec) for x in leaves}),
        "param_mesh_shapes": sorted({str(dict(x.sharding.mesh.shape)) for x in leaves}),
    }
  logged = [json.loads(line) for line in
            (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
  out["logged_steps"] = [r["step"] for r in logged if "train/loss" in r]
  out["moved"] = float(np.max(np.abs(np.asarray(
      jax.tree.leaves(straight.state.params)[0]) - np.asarray(
      jax.tree.leaves(nnx.state(ScalarModel(MODEL, rngs=nnx.Rngs(0)), nnx.Param))[0]))))
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])
