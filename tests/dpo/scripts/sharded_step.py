"""DPO training on one device and on a (data, fsdp, tensor) mesh from the same pairs.

Usage: `sharded_step.py DATA FSDP TENSOR [PRECOMPUTE]` (the device count is their product).
Trains two `DPOTrainer`s built alike (gradient accumulation 2) for 2 steps, one with `mesh=None`
and one on the mesh (with PRECOMPUTE=1: `precompute_reference=True` on the mesh, the reference
on the fly on one device), then evaluates with both. Prints JSON with the largest parameter and
optimizer-state differences, both runs' metrics, the evaluations and whether the parameters (and
the reference) are really split.
"""

import faulthandler
import json
import sys

import jax
import numpy as np
from flax import nnx

from jax_ppo.dpo import DPOConfig, DPOOptimizer, DPOTrainer
from jax_ppo.models import CausalLM
from jax_ppo.models.config import ModelConfig
from jax_ppo.parallel import MeshConfig, make_mesh

# Every sharded dimension divides 2: D = 32 (fsdp), H*Dh = 32, K*Dh = 16, F = 64, V = 64 (tensor).
MODEL = ModelConfig(
    model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
)
EOS = 2


def records(n: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  ids = lambda lo, hi: [int(t) for t in rng.integers(3, 64, size=int(rng.integers(lo, hi)))]  # noqa: E731
  return [{"prompt": ids(2, 6), "chosen": ids(1, 6), "rejected": ids(1, 6)} for _ in range(n)]


def trainer(mesh, precompute: bool = False):
  config = DPOConfig(
      precompute_reference=precompute,
      batch_size=8, gradient_accumulation_steps=2, total_steps=2, max_length=16,
      eos_token_id=EOS, eval_batch_size=8, beta=0.5,
      # adam_eps = 1 keeps Adam's steps proportional to the gradient, so the parameters show any
      # difference of the gradients (eps = 1e-8 would step by +-lr on near-zero noise).
      optimizer=DPOOptimizer(learning_rate=0.1, lr_schedule="constant", adam_eps=1.0))
  return DPOTrainer(config, CausalLM(MODEL, rngs=nnx.Rngs(0)), train_data=records(20, 0),
                    eval_data=records(12, 1), mesh=mesh)


def max_abs_diff(a, b) -> float:
  diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64)
                                                        - np.asarray(y, np.float64)))), a, b)
  return max(jax.tree.leaves(diffs), default=0.0)


def main(data: int, fsdp: int, tensor: int, precompute: int = 0) -> None:
  faulthandler.dump_traceback_later(600, exit=True)
  mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
  single, sharded = trainer(None), trainer(mesh, bool(precompute))
  history1, history8 = single.train(), sharded.train()
  reference_s = history8[0].pop("time/reference_s", None)
  eval1, eval8 = single.evaluate(), sharded.evaluate()
  leaves = jax.tree.leaves(sharded.state.params)
  print(json.dumps({
      "devices": len(jax.devices()),
      "mesh": dict(mesh.shape),
      "param_devices": len(leaves[0].sharding.device_set),
      "param_specs": sorted({str(x.sharding.spec) for x in leaves}),
      "ref_specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(sharded.ref)}),
      "max_param_diff": max_abs_diff(single.state.params, sharded.state.params),
      "max_opt_diff": max_abs_diff(single.state.opt_state, sharded.state.opt_state),
      "max_ref_diff": None if sharded.reference_freed else max_abs_diff(single.ref, sharded.ref),
      "reference_freed": sharded.reference_freed,
      "reference_s": reference_s,
      "history": [list(history1), list(history8)],
      "eval": [eval1, eval8],
      "steps": [single.step_count, sharded.step_count],
  }))


if __name__ == "__main__":
  main(*map(int, sys.argv[1:5]))
