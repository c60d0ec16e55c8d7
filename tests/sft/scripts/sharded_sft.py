"""Two SFT steps and an evaluation on one device and on a (data, fsdp, tensor) mesh, from the same
model and rows (tests/sft/test_sft_mesh.py; run in a subprocess with fake CPU devices).

Usage: `sharded_sft.py DATA FSDP TENSOR`. Packing on, gradient accumulation 2 (each microbatch's
rows split over `data` x `fsdp`). Prints JSON with the largest parameter and optimizer-state
differences, both runs' metrics and evaluations, the parameters' and the batch's shardings and
the number of compiled train steps.
"""

import faulthandler
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "parallel" / "scripts"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tiny_setup import EOS, MODEL, max_abs_diff  # noqa: E402

from jax_ppo.data.sft import example_from_ids  # noqa: E402
from jax_ppo.models.transformer import CausalLM  # noqa: E402
from jax_ppo.parallel import MeshConfig, make_mesh  # noqa: E402
from jax_ppo.sft import SFTConfig, SFTOptimizer, SFTTrainer  # noqa: E402
from jax_ppo.training.state import batch_rows  # noqa: E402

# adam_eps 1e-6, not the default 1e-8: Adam's first step moves a parameter by lr * g / (|g| + eps),
# and a few entries here get a gradient that is zero up to rounding (~1e-10). At eps 1e-8 their
# step is a rounding-dependent fraction of lr, so the mesh and one device (different summation
# orders) ended 2.8e-5 apart on an AVX-512 host (under the test's 1e-5 on AVX2 hosts); at 1e-6
# those steps stay near 1e-4 * lr and the runs agree to 1.2e-6 on that AVX-512 host.
CONFIG = SFTConfig(max_length=16, batch_size=8, gradient_accumulation_steps=2, packing=True,
                   eos_token_id=EOS, total_steps=4, seed=1,
                   optimizer=SFTOptimizer(learning_rate=5e-3, lr_schedule="constant",
                                          adam_eps=1e-6))


def examples(n: int, seed: int):
  rng = np.random.default_rng(seed)
  return [example_from_ids(rng.integers(3, MODEL.vocab_size, size=int(rng.integers(1, 6))),
                           rng.integers(3, MODEL.vocab_size, size=int(rng.integers(2, 8))),
                           eos_token_id=EOS) for _ in range(n)]


def run(mesh) -> tuple[SFTTrainer, list[dict], dict]:
  trainer = SFTTrainer(CONFIG, CausalLM(MODEL, rngs=nnx.Rngs(0)), train_data=examples(40, 0),
                       eval_data=examples(12, 1), mesh=mesh)
  history = [trainer.step() for _ in range(2)]  # (one program in flight at a time)
  return trainer, history, trainer.evaluate()


def main():
  faulthandler.dump_traceback_later(360, exit=True)  # a stuck collective: say where, then exit
  mesh = make_mesh(MeshConfig(data=int(sys.argv[1]), fsdp=int(sys.argv[2]),
                              tensor=int(sys.argv[3])))
  single, history1, eval1 = run(None)
  sharded, history8, eval8 = run(mesh)
  rows = sharded.train_rows
  index = batch_rows(CONFIG.seed, 0, CONFIG.batch_size, rows.num_rows, epoch_end="pad")
  batch = sharded.batch(rows, index)
  first = jax.tree.leaves(sharded.state.params)[0]
  print(json.dumps({
      "devices": len(jax.devices()),
      "mesh": dict(mesh.shape),
      "max_param_diff": max_abs_diff(single.state.params, sharded.state.params),
      "max_opt_diff": max_abs_diff(single.state.opt_state, sharded.state.opt_state),
      "moved": max_abs_diff(nnx.state(CausalLM(MODEL, rngs=nnx.Rngs(0)), nnx.Param),
                            single.state.params),
      "metrics": [history1, history8],
      "eval": [eval1, eval8],
      "param_specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(sharded.state.params)}),
      "param_devices": len(first.sharding.device_set),
      "batch_spec": str(batch.input_ids.sharding.spec),
      "segments": int(np.max(rows.segment_ids)),
      "train_programs": sharded.steps.train_step._cache_size(),
  }))


if __name__ == "__main__":
  main()
