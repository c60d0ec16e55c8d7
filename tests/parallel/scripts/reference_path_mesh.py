"""`RunConfig.reference_path` on a mesh: the reference loaded from its own checkpoint is placed
as the default reference (the policy's starting weights) is, on the shared mesh and on a
sub-mesh of its own (`placement.reference`), and its log-probs are that checkpoint's.

Usage: `reference_path_mesh.py ROOT` on 4 fake CPU devices. Prints JSON `{mode: result}` with,
per mode (`shared`: mesh data=2 x fsdp=2; `split`: the policy on devices 0-1, the reference on
2-3): whether every reference array has the default reference's sharding, the reference's device
ids, and the largest difference between its log-probs and those of a run whose policy is the
reference checkpoint.
"""

import json
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # tests/: tiny_hf_run
import tiny_hf_run  # noqa: E402

from jax_ppo.parallel import MeshConfig, PlacementConfig, RoleMesh  # noqa: E402
from jax_ppo.ppo import PPOConfig, PPOSampling  # noqa: E402
from jax_ppo.runs.ppo import build_trainer  # noqa: E402
from jax_ppo.runs.ppo_config import RunConfig  # noqa: E402

MODES = {
    "shared": dict(mesh=MeshConfig(data=2, fsdp=2)),
    "split": dict(mesh=MeshConfig(data=2), placement=PlacementConfig(
        policy_devices=(0, 2), reference=RoleMesh(devices=(2, 4), mesh=MeshConfig(data=2)))),
}


def main(root: pathlib.Path) -> dict:
  policy = tiny_hf_run.make_checkpoint(root / "policy", seed=0)
  other = tiny_hf_run.make_checkpoint(root / "other", seed=7)
  data = tiny_hf_run.write_data(root)
  ppo = PPOConfig(batch_size=4, sampling=PPOSampling(max_new_tokens=4, temperature=1.0),
                  total_updates=1)
  out = {}
  for mode, placed in MODES.items():
    def build(placed=placed, **kwargs):
      fields = dict(policy_path=policy, prompts_path=data["prompts"], reward_function="length",
                    run_dir=str(root / "run"), dtype="float32", ppo=ppo, **placed)
      return build_trainer(RunConfig(**{**fields, **kwargs}), open_run=False)

    trainer, default, as_policy = (build(reference_path=other), build(),
                                   build(policy_path=other))
    shardings = [(a.sharding, b.sharding) for a, b in zip(
        jax.tree.leaves(trainer.frozen.ref), jax.tree.leaves(default.frozen.ref), strict=True)]
    prompts = [trainer.tokenizer(p)["input_ids"] for p in ("the movie was", "the actor is")] * 2
    rollout = trainer.sampler(prompts, jax.random.PRNGKey(0), state=trainer.policy_state())
    mask = np.asarray(rollout.response_mask).astype(bool)
    ref = np.asarray(trainer.eval_logprobs(trainer.state.policy, trainer.frozen, rollout)[1])
    own = np.asarray(as_policy.eval_logprobs(as_policy.state.policy, as_policy.frozen,
                                             rollout)[0])
    out[mode] = {
        "same_sharding": all(a == b for a, b in shardings),
        "ref_devices": sorted({d.id for x in jax.tree.leaves(trainer.frozen.ref)
                               for d in x.sharding.device_set}),
        "max_ref_diff": float(np.max(np.abs(ref[mask] - own[mask]))),
        "tokens": int(mask.sum()),
    }
  return out


if __name__ == "__main__":
  print(json.dumps(main(pathlib.Path(sys.argv[1]))))
