"""`jax-ppo train RUN.yaml` with the critic, the reference and the reward model on sub-meshes of
their own (a config file's `placement`), then the checkpoint restored and evaluated, split and
shared.

Usage: `placed_critic_run.py ROOT`: writes a tiny Hugging Face policy and reward model (the
critic starts as its copy) and a run config under ROOT, trains 2 updates on 8 devices (policy
on 0-3, critic on 4-5, reference and reward on 6-7), restores the last checkpoint into a
trainer built from the saved config and evaluates held-out prompts; then restores the same
checkpoint into a trainer with every role on the policy's mesh and evaluates again. Prints JSON:
the steps, whether the losses are finite, the critic metrics logged, where the restored state
lives, which evaluation programs ran, and both evaluations' metrics.
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
from jax_ppo.parallel.placement import PlacementConfig  # noqa: E402
from jax_ppo.ppo.placed_critic import split_state  # noqa: E402
from jax_ppo.ppo.placed_steps import PlacedEvalLogprobs  # noqa: E402
from jax_ppo.runs.ppo import build_trainer  # noqa: E402
from jax_ppo.runs.ppo_config import saved_run_config  # noqa: E402

CONFIG = """\
policy_path: {policy}
reward_model_path: {reward}
prompts_path: {prompts}
run_dir: {run_dir}
run: {{save_every: 1, plots: false, tensorboard: false, progress: false}}
ppo: {{batch_size: 8, num_minibatches: 2, ppo_epochs: 1, sampling: {{max_new_tokens: 4}},
      total_updates: 2, optimizer: {{learning_rate: 1.0e-2}}}}
mesh: {{data: 2, fsdp: 2}}
placement:
  policy_devices: [0, 4]
  critic: {{devices: [4, 6], mesh: {{data: 1, fsdp: 2}}}}
  reference: {{devices: [6, 8], mesh: {{data: 2}}}}
  reward: {{devices: [6, 8], mesh: {{data: 2}}}}
"""


def devices_of(tree) -> list[int]:
  return sorted({d.id for x in jax.tree.leaves(tree) for d in x.sharding.device_set})


def main():
  root = pathlib.Path(sys.argv[1])
  policy = tiny_hf_run.make_checkpoint(root)
  reward = tiny_hf_run.make_reward_checkpoint(root)
  data = tiny_hf_run.write_data(root)
  path = root / "run.yaml"
  path.write_text(CONFIG.format(policy=policy, reward=reward, prompts=data["prompts"],
                                run_dir=root / "run"))
  if cli(["train", str(path)]) != 0:
    raise SystemExit("jax-ppo train failed")
  logged = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
  config = saved_run_config(root / "run")
  trainer = build_trainer(config, open_run=False)
  step = trainer.load_checkpoint(root / "run")
  policy_state, value_opt, _ = split_state(trainer.state)
  prompts = [trainer.dataset.batch(0, 4)[0][i] for i in range(4)]
  prompts = [np.asarray(p)[np.asarray(p) != trainer.config.sampling.pad_token_id].tolist()
             for p in prompts]
  split_eval = trainer.evaluate(prompts)
  program = trainer.eval_logprobs
  out = {
      "steps": [int(m["step"]) for m in logged],
      "finite": all(np.isfinite(m["loss/total_avg"]) and np.isfinite(m["loss/value_avg"])
                    for m in logged),
      "critic_metrics": all("critic/grad_norm" in m for m in logged),
      "restored_step": step,
      "placement_critic": dataclasses.asdict(config.placement)["critic"],
      "policy_devices": devices_of((policy_state.policy, policy_state.opt_state)),
      "value_devices": devices_of((trainer.state.value, [x for x in jax.tree.leaves(value_opt)
                                                         if x.ndim > 0])),
      "ref_devices": devices_of(trainer.frozen.ref),
      "eval_placed": isinstance(program, PlacedEvalLogprobs),
      "eval_programs": {"reference": program.reference._cache_size(),
                        "policy": program.policy._cache_size(),
                        "shared": program.shared._cache_size()},
      "split_eval": split_eval,
  }
  shared = build_trainer(
      dataclasses.replace(config, placement=PlacementConfig(policy_devices=(0, 4))),
      open_run=False)
  out["shared_restored_step"] = shared.load_checkpoint(root / "run")
  out["shared_eval"] = shared.evaluate(prompts)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
