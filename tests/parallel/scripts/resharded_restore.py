"""`jax-ppo train ... mesh.*=...` on one mesh, then the checkpoint restored on another.

Usage:
  `resharded_restore.py train ROOT`: writes a tiny Hugging Face policy and reward model under
    ROOT and runs `jax-ppo train` (the CLI) for 2 updates on a (data=2, fsdp=2, tensor=2) mesh,
    checkpointing every update; saves the restored final state's arrays to ROOT/state.npz.
  `resharded_restore.py restore ROOT DATA FSDP TENSOR` (or `... restore ROOT none` for no mesh):
    restores the latest checkpoint into a trainer built for that mesh, compares every array
    with ROOT/state.npz and, on a mesh, resumes the run for one more update on it.
Prints JSON: the device count, the largest difference, the sharding of one kernel and of its
Adam moment, and the steps.
"""

import dataclasses
import json
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # tests/: tiny_hf_run
import tiny_hf_run  # noqa: E402

from jax_ppo.cli import main as cli  # noqa: E402
from jax_ppo.parallel import MeshConfig  # noqa: E402
from jax_ppo.runs.ppo import build_trainer, run_training  # noqa: E402
from jax_ppo.runs.ppo_config import saved_run_config  # noqa: E402

KERNEL = "decoder/layers/up/kernel"


def arrays(state) -> dict[str, np.ndarray]:
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


def kernel_specs(state) -> dict[str, str]:
  out = {}
  for p, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    key = jax.tree_util.keystr(p)
    if all(f"'{n}'" in key for n in KERNEL.split("/")) and "policy" in key:
      out["moment" if ".mu" in key else "param"] = str(getattr(x.sharding, "spec", "one device"))
  return out


def train(root: pathlib.Path) -> dict:
  policy = tiny_hf_run.make_checkpoint(root)
  reward = tiny_hf_run.make_reward_checkpoint(root)
  data = tiny_hf_run.write_data(root)
  argv = ["train", f"policy_path={policy}", f"reward_model_path={reward}",
          f"prompts_path={data['prompts']}", f"run_dir={root / 'run'}", "ppo.batch_size=8",
          "ppo.num_minibatches=2", "ppo.ppo_epochs=1", "ppo.sampling.max_new_tokens=4",
          "ppo.total_updates=3", "ppo.optimizer.learning_rate=1e-2", "run.updates_per_run=2",
          "run.save_every=1", "run.plots=false", "run.tensorboard=false", "run.progress=false",
          "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
  if cli(argv) != 0:
    raise SystemExit("jax-ppo train failed")
  config = saved_run_config(root / "run")
  trainer = build_trainer(config, open_run=False)
  step = trainer.load_checkpoint(root / "run")
  np.savez(root / "state.npz", **arrays(trainer.state))
  return {"devices": len(jax.devices()), "mesh": dataclasses.asdict(config.mesh), "step": step,
          "specs": kernel_specs(trainer.state)}


def restore(root: pathlib.Path, layout: list[str]) -> dict:
  config = saved_run_config(root / "run")
  mesh = None if layout == ["none"] else MeshConfig(
      data=int(layout[0]), fsdp=int(layout[1]), tensor=int(layout[2]))
  config = dataclasses.replace(config, mesh=mesh)
  trainer = build_trainer(config, open_run=False)
  step = trainer.load_checkpoint(root / "run")
  saved = np.load(root / "state.npz")
  now = arrays(trainer.state)
  out = {"devices": len(jax.devices()), "step": step, "same_keys": set(saved) == set(now),
         "max_diff": max(float(np.max(np.abs(saved[k].astype(np.float64)
                                             - now[k].astype(np.float64)))) for k in now
                         if now[k].size),
         "specs": kernel_specs(trainer.state)}
  if mesh is not None:  # the run continues on the new mesh (a resume across meshes)
    history = run_training(config)
    out["resumed_steps"] = [int(m["step"]) for m in history]
    out["resumed_finite"] = all(np.isfinite(m["loss/total_avg"]) for m in history)
  return out


if __name__ == "__main__":
  root = pathlib.Path(sys.argv[2])
  result = train(root) if sys.argv[1] == "train" else restore(root, sys.argv[3:])
  print(json.dumps(result))
